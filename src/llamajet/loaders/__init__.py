"""Checkpoint loaders: a file on disk -> ModelConfig + canonical weights.

Weights stay where they are: every f32/f16/bf16 tensor, and every GGML block
format the kernels read (Q8_0, Q4_0, Q4_1), is a numpy view of the memory-mapped
file. Only GGUF formats the kernels do not read (Q4_K, Q6_K, ...) are
dequantized to f32 at load, a copy.

    load_model(path)   folder with llamajet.json -> load_llamajet (a `llamajet quantize` output);
                       folder with config.json -> load_hf; *.gguf file -> load_gguf
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from llamajet.config import ModelConfig
from llamajet.errors import ModelFormatError
from llamajet.loaders.names import iter_expected

# The kernels' storage formats -> numpy dtype of ``WeightTensor.data``.
STORAGE_DTYPE = {
    "f32": np.float32,
    "f16": np.float16,
    "bf16": np.uint16,  # raw bits; numpy has no bfloat16
    "q8_0": np.uint8,
    "q4_0": np.uint8,
    "q4_1": np.uint8,
}
# GGML block formats: (weights per block, bytes per block). Blocks run along K.
#   q8_0: fp16 d, 32 x int8                 (x = d * q)
#   q4_0: fp16 d, 16 B of nibbles           (x = d * (q - 8))
#   q4_1: fp16 d, fp16 m, 16 B of nibbles   (x = d * q + m)
GGML_BLOCKS = {"q8_0": (32, 34), "q4_0": (32, 18), "q4_1": (32, 20)}


@dataclass(frozen=True, eq=False)  # eq=False: equality of ndarrays is not a bool
class WeightTensor:
    name: str  # canonical, e.g. "blk.3.attn_q"
    dtype: str  # a key of STORAGE_DTYPE
    shape: tuple[int, ...]  # logical: matrices [N_out, K_in], embeddings [vocab, hidden], norms [hidden]
    data: np.ndarray  # raw storage: shape == `shape`, or [N, K // 32 * block bytes] for GGML blocks
    # GGUF attn_q / attn_k rows are in llama.cpp's interleaved RoPE order: within
    # each head, dims (2i, 2i+1) form a rotated pair (HF: (i, i + head_dim/2)).
    # The model picks the matching RoPE variant; q·k is unchanged by the permutation.
    rope_interleaved: bool = False

    def __post_init__(self):
        if self.dtype not in STORAGE_DTYPE:
            raise ModelFormatError(f"{self.name}: unknown storage dtype {self.dtype!r}")
        if self.data.dtype != STORAGE_DTYPE[self.dtype]:
            raise ModelFormatError(f"{self.name}: {self.dtype} data must be {np.dtype(STORAGE_DTYPE[self.dtype])}, "
                                   f"got {self.data.dtype}")
        if tuple(self.data.shape) != self.storage_shape():
            raise ModelFormatError(f"{self.name}: storage shape {tuple(self.data.shape)} does not hold a "
                                   f"{self.dtype} tensor of shape {self.shape} (expected {self.storage_shape()})")

    packed = False  # row-major storage (quant/pack.py PackedWeight: tiles)

    def storage_shape(self) -> tuple[int, ...]:
        if self.dtype not in GGML_BLOCKS:
            return tuple(self.shape)
        per_block, block_bytes = GGML_BLOCKS[self.dtype]
        if not self.shape or self.shape[-1] % per_block:
            raise ModelFormatError(f"{self.name}: {self.dtype} needs the last dim of {self.shape} "
                                   f"to be a multiple of {per_block}")
        return (*self.shape[:-1], self.shape[-1] // per_block * block_bytes)

    def to_f32(self) -> np.ndarray:
        """A dequantized float32 copy of shape ``shape`` (for references and tests)."""
        if self.dtype == "f32":
            return np.array(self.data, dtype=np.float32, copy=True)
        if self.dtype == "f16":
            return self.data.astype(np.float32)
        if self.dtype == "bf16":
            # bf16 is the top half of an fp32: shift the bits back into place
            return (self.data.astype(np.uint32) << 16).view(np.float32)
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        qtype = GGMLQuantizationType[self.dtype.upper()]
        return np.ascontiguousarray(dequantize(self.data, qtype), dtype=np.float32).reshape(self.shape)


@dataclass
class LoadedModel:
    config: ModelConfig
    weights: dict[str, WeightTensor]  # canonical name -> tensor
    source: str  # the path loaded
    gguf_reader: object | None  # the open gguf.GGUFReader (the tokenizer reuses it); None for HF
    keepalive: list = field(default_factory=list)  # mmaps/readers the views in `weights` point into

    @property
    def lm_head(self) -> WeightTensor:
        """The [vocab, hidden] output projection: ``output``, or ``token_embd`` when tied."""
        output = self.weights.get("output")
        return output if output is not None else self.weights["token_embd"]


def check_weights(config: ModelConfig, weights: dict[str, WeightTensor], source: str,
                  native_name: Callable[[str], str]) -> ModelConfig:
    """Every tensor ``config`` implies is present with its shape, none beyond.

    Returns ``config``, with ``tie_word_embeddings=False`` if a separate ``output``
    is present: it is used even when the config says tied, as transformers 5 does
    when the two differ. ``native_name`` turns a canonical name into the file's.
    """
    has_output = "output" in weights
    if not has_output and not config.tie_word_embeddings:
        raise ModelFormatError(f"{source}: missing tensor {native_name('output')!r} "
                               "(the config says the embeddings are not tied)")
    expected = set()
    for name, shape in iter_expected(config, with_output=has_output):
        expected.add(name)
        if name not in weights:
            raise ModelFormatError(f"{source}: missing tensor {native_name(name)!r}")
        if weights[name].shape != shape:
            raise ModelFormatError(f"{source}: tensor {native_name(name)!r} has shape {weights[name].shape}, "
                                   f"expected {shape} from the config")
    extra = sorted(set(weights) - expected)
    if extra:
        raise ModelFormatError(f"{source}: tensors {[native_name(n) for n in extra][:5]} do not fit the config "
                               f"({config.num_layers} layers)")
    if has_output and config.tie_word_embeddings:
        config = dataclasses.replace(config, tie_word_embeddings=False)
    return config


def load_model(path: str | Path) -> LoadedModel:
    """Load a Hugging Face folder (with config.json) or a GGUF file."""
    path = Path(path)
    if not path.exists():
        raise ModelFormatError(f"{path}: no such file or folder")
    if path.is_dir():
        if (path / "llamajet.json").is_file():  # written by `llamajet quantize` (loaders/llamajet.py)
            return load_llamajet(path)
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


# Imported last: the format modules use WeightTensor / LoadedModel defined above.
from llamajet.loaders.gguf import load_gguf  # noqa: E402
from llamajet.loaders.llamajet import load_llamajet  # noqa: E402
from llamajet.loaders.safetensors import load_hf  # noqa: E402

__all__ = ["WeightTensor", "LoadedModel", "load_model", "load_hf", "load_gguf", "load_llamajet", "check_weights",
           "GGML_BLOCKS"]
