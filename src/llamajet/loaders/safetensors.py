"""Hugging Face folders: config.json + one or many ``*.safetensors``.

Tensors are numpy views on a read-only mmap of each file (formats/
safetensors.py parses the headers): no tensor byte is copied. Every tensor is
named and typed by the architecture's tensor spec (model/spec.py); an unknown
name is an error naming it.
"""

from __future__ import annotations

import json
import mmap
from pathlib import Path


from llamajet.config import ModelConfig
from llamajet.errors import ModelFormatError, UnsupportedModelError
from llamajet.formats import safetensors as st
from llamajet.formats.layout import FLOATS
from llamajet.formats.weight import Weight
from llamajet.loaders.base import LoadedModel, check_weights
from llamajet.model import registry

INDEX_FILE = "model.safetensors.index.json"
# An index is one line per tensor (~100 bytes); a 405B model's is under 200 kB.
MAX_INDEX_BYTES = 64 * 1024 * 1024
# PyTorch's pickled checkpoints: never read (unpickling runs the file's code).
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt")


def _shard(folder: Path, index_path: Path, name: str) -> Path:
    """The shard file `name` of the index, which must stay inside `folder`: a
    downloaded index (or a cloned repository's symlink) could otherwise name
    ``../x``, ``/etc/...`` or a link that leads out, and make the loader map,
    and quote in its errors, any file it can read. One way out is allowed:
    the Hugging Face cache's own layout, where ``snapshots/<rev>/x`` links to
    ``blobs/<hash>`` beside ``snapshots``."""
    roots = [folder.resolve()]
    if folder.resolve().parent.name == "snapshots":
        roots.append(folder.resolve().parent.parent / "blobs")
    path = (folder / name).resolve()
    if Path(name).is_absolute() or ".." in Path(name).parts or not any(path.is_relative_to(r) for r in roots):
        raise ModelFormatError(f"{index_path} lists shard {name!r}, which lies outside the model folder {folder}")
    if not path.is_file():
        raise ModelFormatError(f"{index_path} lists {name}, which does not exist")
    return folder / name


def _weight_files(folder: Path) -> tuple[list[Path], dict[str, str] | None]:
    """The safetensors files to read, and the index's name -> file map if any."""
    index_path = folder / INDEX_FILE
    if index_path.is_file():
        if index_path.stat().st_size > MAX_INDEX_BYTES:
            raise ModelFormatError(f"{index_path}: {index_path.stat().st_size} bytes, above the limit of "
                                   f"{MAX_INDEX_BYTES} for a safetensors index")
        try:
            weight_map = json.loads(index_path.read_text(encoding="utf-8"))["weight_map"]
            assert isinstance(weight_map, dict) and all(isinstance(v, str) for v in weight_map.values())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, AssertionError,
                RecursionError) as e:  # RecursionError: JSON nested past Python's parser's depth
            raise ModelFormatError(f"{index_path}: not a valid safetensors index ({e!r})") from e
        files = [_shard(folder, index_path, f) for f in sorted(set(weight_map.values()))]
        return files, weight_map
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        others = sorted(p.name for p in folder.iterdir() if p.suffix in PICKLE_SUFFIXES)
        if others:
            raise UnsupportedModelError(
                f"{folder}: weights in {others[0]} (a PyTorch pickle, which llamajet never opens: unpickling "
                "runs code from the file); use a safetensors or GGUF copy of the model, or re-save it with "
                "save_pretrained(safe_serialization=True)")
        raise ModelFormatError(f"{folder}: no *.safetensors weight files")
    return files, None


def _view(entry: st.Entry, buf: mmap.mmap, hf_name: str, canonical: str, rule) -> Weight:
    fmt = FLOATS.get(st.FROM_FLOAT.get(entry.dtype, ""))
    if fmt is None:
        raise UnsupportedModelError(f"{entry.file}: tensor {hf_name!r} has dtype {entry.dtype}; "
                                    f"supported: {', '.join(st.FLOAT_DTYPES.values())}")
    return Weight(canonical, rule.kind, fmt, entry.shape, st.view(entry, buf, fmt.np_dtype, entry.shape))


def load_hf(folder: str | Path) -> LoadedModel:
    """Load a Hugging Face folder of a registered architecture; weights are views of mmapped files."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ModelFormatError(f"{folder}: not a folder")
    try:
        spec = registry.get(ModelConfig.architecture_of_hf(folder))
        config = ModelConfig.from_hf(folder)
    except (ModelFormatError, UnsupportedModelError) as e:
        if str(folder) in str(e):
            raise
        raise type(e)(f"{folder / 'config.json'}: {e}") from e
    except RecursionError:  # config.py's JSON read: [[[[...]]]] past Python's parser's depth
        raise ModelFormatError(f"{folder / 'config.json'}: JSON nested too deeply") from None
    files, weight_map = _weight_files(folder)

    maps: list[mmap.mmap] = []
    entries: dict[str, st.Entry] = {}
    buffers: dict[Path, mmap.mmap] = {}
    for path in files:
        buf = st.map_read_only(path)
        maps.append(buf)
        buffers[path] = buf
        for name, entry in st.read_header(path, buf).items():
            if name in entries:
                raise ModelFormatError(f"tensor {name!r} is in both {entries[name].file.name} and {path.name}")
            entries[name] = entry
    if weight_map is not None:
        for name, fname in weight_map.items():
            if name not in entries or entries[name].file.name != fname:
                raise ModelFormatError(f"{folder / INDEX_FILE} puts {name!r} in {fname}, which does not hold it")

    weights: dict[str, Weight] = {}
    for name, entry in entries.items():
        mapped = spec.from_hf(name)
        if mapped is None:
            if spec.is_ignored(name):
                continue  # e.g. a rotary inv_freq buffer: not a weight
            raise ModelFormatError(f"{entry.file}: tensor {name!r} is not part of a {spec.name} model")
        canonical, rule = mapped
        weights[canonical] = _view(entry, buffers[entry.file], name, canonical, rule)
    config = check_weights(config, spec, weights, str(folder), "hf")
    return LoadedModel(config=config, weights=weights, source=str(folder), gguf_reader=None, keepalive=maps)
