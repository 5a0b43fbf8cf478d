"""Checkpoint loaders: a file on disk -> ModelConfig + canonical Weights.

Weights stay where they are: every f32/f16/bf16 tensor, and every GGML block
format the kernels read (Q8_0, Q4_0, Q4_1), is a numpy view of the
memory-mapped file, named and typed by its architecture's tensor spec
(model/spec.py), and so is every GGUF block type with a packed twin (Q5_0,
Q5_1, Q4_K, Q5_K, Q6_K: repacked later, formats/pending.py). Only GGUF
formats without one (Q2_K, Q3_K, IQ*) are dequantized to f32 at load, a copy.

    load_model(path)   folder with llamajet.json -> load_saved (a `llamajet quantize` output);
                       folder with config.json -> load_hf; *.gguf file -> load_gguf
"""

from __future__ import annotations

from pathlib import Path

from llamajet.errors import ModelFormatError
from llamajet.formats import saved
from llamajet.loaders.base import LoadedModel, check_weights, page_releaser
from llamajet.loaders.gguf import load_gguf
from llamajet.loaders.safetensors import load_hf
from llamajet.model import registry


def load_saved(folder: str | Path) -> LoadedModel:
    """A folder written by ``llamajet quantize`` (formats/saved.py); weights are views of the mapped file."""
    folder = Path(folder)

    def kind_of(config, name: str):
        spec = registry.get(config.architecture)
        rule = spec.rule(name)
        if rule is None:
            raise ModelFormatError(f"{folder}: tensor {name!r} is not part of a {spec.name} model")
        return rule.kind

    config, weights, buf = saved.read(folder, kind_of)
    config = check_weights(config, registry.get(config.architecture), weights, str(folder), "canonical")
    return LoadedModel(config=config, weights=weights, source=str(folder), gguf_reader=None, keepalive=[buf])


def load_model(path: str | Path) -> LoadedModel:
    """Load a saved llamajet folder, a Hugging Face folder (with config.json) or a GGUF file."""
    path = Path(path)
    if not path.exists():
        raise ModelFormatError(f"{path}: no such file or folder")
    if path.is_dir():
        if (path / saved.META_FILE).is_file():
            return load_saved(path)
        if (path / "config.json").is_file():
            return load_hf(path)
        ggufs = sorted(path.glob("*.gguf"))
        hint = f"; it holds {ggufs[0].name}: pass that file" if len(ggufs) == 1 else ""
        raise ModelFormatError(f"{path}: folder has no config.json, so it is not a Hugging Face model{hint}")
    if path.suffix == ".gguf" or _has_gguf_magic(path):
        return load_gguf(path)
    if path.name == "config.json":
        return load_hf(path.parent)
    raise ModelFormatError(f"{path}: neither a .gguf file nor a folder with config.json")


def _has_gguf_magic(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


__all__ = ["LoadedModel", "check_weights", "load_gguf", "load_hf", "load_model", "load_saved", "page_releaser"]
