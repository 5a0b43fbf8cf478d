"""GGUF files, through gguf_meta.Reader (it memory-maps the file; each
tensor's ``data`` is a view of that map; gguf-py's GGUFReader offers the same
but took 8 s over a Llama-3 vocabulary).

- Every tensor is named and typed by the architecture's tensor spec
  (model/spec.py): an unknown name is an error naming it.
- F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K: kept as
  views, bytes exactly as in the file (the block types are repacked into
  their packed twins by prepare_weights, formats/gguf_blocks.py).
- Other formats ``gguf.quants`` can decode (Q2_K, Q3_K, IQ*, ...):
  dequantized to f32 at load, a copy; the quantizer can re-pack them later.
- RoPE-rotated rows (attn_q / attn_k) stay in the file's order, marked
  ``rope_interleaved`` where the architecture's converter permuted them
  (Llama); nothing is permuted here.
- GGUF lists dims fastest first (ne0 = K); ``Weight.shape`` is [N, K].
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

from llamajet.config import ModelConfig
from llamajet.errors import ModelFormatError, UnsupportedModelError
from llamajet.gguf_meta import Reader
from llamajet.formats.layout import get_format
from llamajet.formats.weight import Weight
from llamajet.loaders.base import LoadedModel, check_weights
from llamajet.model import registry
from llamajet.model.spec import ArchSpec, TensorRule

_Q = gguf.GGMLQuantizationType
# GGML types the kernels read as they are -> our format name
_RAW = {_Q.F32: "f32", _Q.F16: "f16", _Q.BF16: "bf16", _Q.Q8_0: "q8_0", _Q.Q4_0: "q4_0", _Q.Q4_1: "q4_1",
        _Q.Q5_0: "q5_0", _Q.Q5_1: "q5_1", _Q.Q4_K: "q4_k", _Q.Q5_K: "q5_k", _Q.Q6_K: "q6_k"}
# integer tensor types are never weights of a float model
_NOT_WEIGHTS = {_Q.I8, _Q.I16, _Q.I32, _Q.I64}


def open_reader(path: Path) -> Reader:
    """Open ``path`` with the reader; any failure on a truncated or corrupt file
    (the reader raises ValueError, IndexError, KeyError, ...) is a ModelFormatError."""
    try:
        reader = Reader(path)
    except Exception as e:
        raise ModelFormatError(f"{path}: not a readable GGUF file, truncated or corrupt "
                               f"({type(e).__name__}: {e})") from e
    if reader.byte_order != "I":
        raise UnsupportedModelError(f"{path}: GGUF written for the other byte order (big-endian)")
    size = len(reader.data)
    for t in reader.tensors:
        # the reader's slicing clips at the file end, so check the extent explicitly
        if t.data_offset + t.n_bytes > size or t.data.nbytes != t.n_bytes:
            raise ModelFormatError(f"{path}: tensor {t.name!r} runs past the end of the file; truncated?")
    return reader


def _weight(t, canonical: str, rule: TensorRule, spec: ArchSpec, path: Path) -> Weight:
    shape = tuple(int(d) for d in reversed(t.shape.tolist()))  # ne0 last: [N, K]
    qtype = t.tensor_type
    interleaved = rule.rope and spec.gguf_rope_interleaved
    if qtype in _RAW:
        data = t.data
        if qtype == _Q.BF16:
            data = data.view(np.uint16)  # the reader exposes bf16 as bytes: [..., 2K] u8 -> [..., K] u16
        # block formats arrive as [N, row bytes] u8, exactly the format's storage shape
        return Weight(canonical, rule.kind, get_format(_RAW[qtype]), shape, data, interleaved)
    if qtype in _NOT_WEIGHTS:
        raise UnsupportedModelError(f"{path}: tensor {t.name!r} has integer type {qtype.name}")
    try:
        f32 = gguf.quants.dequantize(t.data, qtype)
    except NotImplementedError as e:
        raise UnsupportedModelError(f"{path}: tensor {t.name!r} has type {qtype.name}, which llamajet "
                                    "cannot read") from e
    data = np.ascontiguousarray(f32, dtype=np.float32).reshape(shape)
    data.setflags(write=False)  # weights are read-only, copies like views
    return Weight(canonical, rule.kind, get_format("f32"), shape, data, interleaved)


def load_gguf(path: str | Path) -> LoadedModel:
    """Load a GGUF of a registered architecture; weights are views of the reader's memory map."""
    path = Path(path)
    if not path.is_file():
        raise ModelFormatError(f"{path}: no such file")
    reader = open_reader(path)
    try:
        spec = registry.get(ModelConfig.architecture_of_gguf(reader))
        config = ModelConfig.from_gguf(reader)
    except (ModelFormatError, UnsupportedModelError) as e:
        raise type(e)(f"{path}: {e}") from e

    weights: dict[str, Weight] = {}
    for t in reader.tensors:
        mapped = spec.from_gguf(t.name)
        if mapped is None:
            if spec.is_ignored(t.name):
                continue  # e.g. rope_freqs: already in the config
            raise ModelFormatError(f"{path}: tensor {t.name!r} is not part of a {spec.name} model")
        canonical, rule = mapped
        if canonical in weights:
            raise ModelFormatError(f"{path}: tensor {t.name!r} appears twice")
        weights[canonical] = _weight(t, canonical, rule, spec, path)
    config = check_weights(config, spec, weights, str(path), "gguf")
    return LoadedModel(config=config, weights=weights, source=str(path), gguf_reader=reader, keepalive=[reader])


def release_file_pages(model: LoadedModel) -> None:
    """After the weights were repacked (copied into the kernels' layout), drop
    the GGUF's file pages from this process's resident set and free the
    reader's metadata arrays (the tokenizer and config are built by then).
    Weights still used as views of the file (norms) fault back in on demand;
    the mapping is read-only, so nothing is lost."""
    reader = model.gguf_reader
    if reader is None:
        return
    reader.fields.clear()
    reader.release_pages()
    trim_heap()


def trim_heap() -> None:
    """Hand the heap freed while loading back to the OS: metadata arrays (~50
    MB for a 49k vocabulary), and the fp32 copies an HF checkpoint's matrices
    pass through on their way to int8 (glibc keeps freed heap otherwise:
    +700 MiB of resident set after a 1B bf16 folder)."""
    try:
        import ctypes
        import gc

        gc.collect()
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: the memory is only reused later
        pass
