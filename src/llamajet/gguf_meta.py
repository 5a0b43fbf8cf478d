"""GGUF metadata, read once for everyone: typed access to a ``gguf.GGUFReader``'s
key-value fields with errors that name the key (and file). Shared by the
model config (hyper-parameters, config.py) and the tokenizer (vocabulary,
tokenizer/gguf_vocab.py); imports nothing of llamajet but its errors.

Reader (below) parses the file for all of them:
  A GGUF reader for loading: the header parsed in one pass over the mapped
  file, tensors as numpy views of the map.

  It offers what the loader, the config and the tokenizer read of a
  ``gguf.GGUFReader`` (``fields[key].contents()`` / ``.types`` / ``.data``,
  ``tensors`` with name, shape, tensor_type, data, data_offset, n_bytes,
  ``data``, ``byte_order``), without building a numpy view per string:
  gguf-py's reader takes ~8 s for Llama-3's 128k-token vocabulary and 280k
  merges, this one ~0.3 s. Every count and size is checked against the bytes
  left in the file before anything is allocated, so a hostile header fails
  with a ValueError (the loader's ModelFormatError), never a huge allocation.
  The format: github.com/ggml-org/ggml docs/gguf.md (little-endian, v2/v3).
"""

from __future__ import annotations

import math
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from llamajet import _core
from llamajet.errors import ModelFormatError, UnsupportedModelError

# ---------------------------------------------------------------- the file


def typed(value, key: str, kind):
    """``value`` as ``kind`` (int or float; anything else passes through), or a
    ModelFormatError naming ``key``. Accepts numpy scalars (GGUF metadata) and
    JSON numbers (HF configs)."""
    if kind not in (int, float):
        return value
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise ModelFormatError(f"{key} must be {'an integer' if kind is int else 'a number'}, got {value!r}")
    if kind is float:
        return float(value)
    if not math.isfinite(value) or value != int(value):
        raise ModelFormatError(f"{key} must be an integer, got {value!r}")
    return int(value)


def f32_to_decimal(x: float) -> float:
    """GGUF stores floats as float32 (1e-5 becomes 9.99999974e-06). The writer
    meant the shortest decimal that rounds to that float32, so recover it: an
    HF and a GGUF copy of one model then agree exactly."""
    return float(str(np.float32(x)))


class GGUFMeta:
    """The metadata of an open GGUF reader."""

    def __init__(self, reader: Any) -> None:
        self.fields = reader.fields
        # our Reader names its file (its data is a plain view of the map); gguf's GGUFReader maps with np.memmap
        self.name = str(getattr(reader, "path", None) or getattr(getattr(reader, "data", None), "filename", None)
                        or "<gguf>")

    def has(self, key: str) -> bool:
        return key in self.fields

    def raw(self, key: str, default: Any = None) -> Any:
        """The field's Python value (a scalar, str or list), or `default`."""
        field = self.fields.get(key)
        if field is None:
            return default
        try:
            if hasattr(field, "contents"):  # gguf >= 0.11
                return field.contents()
            return _field_value_fallback(field)
        except Exception as e:  # a malformed field: surface as a format error
            raise ModelFormatError(f"GGUF metadata {key!r} is unreadable ({e})") from e

    def get(self, key: str, kind=None, default=None):
        """The field as `kind` (str, int, float; None: as stored), or `default`.
        Floats stored as float32 come back as the decimal their writer meant."""
        value = self.raw(key)
        if value is None:
            return default
        if kind is None:
            return value
        if kind is str:
            if not isinstance(value, str):
                raise ModelFormatError(f"GGUF metadata {key!r} must be a string, got {value!r}")
            return value
        if isinstance(value, list):
            raise UnsupportedModelError(f"GGUF metadata {key!r} is a per-layer array {value!r}; not supported")
        value = typed(value, f"GGUF metadata {key!r}", kind)
        if kind is float and [t.name for t in self.fields[key].types] == ["FLOAT32"]:
            value = f32_to_decimal(value)
        return value

    def require(self, key: str, kind=None):
        value = self.get(key, kind)
        if value is None:
            raise ModelFormatError(f"GGUF metadata is missing required key {key!r}")
        return value

    def array_len(self, key: str) -> int | None:
        field = self.fields.get(key)
        return None if field is None else len(field.data)  # no need to decode the strings


def _field_value_fallback(field: Any) -> Any:
    # Older gguf packages lack ReaderField.contents(): decode parts by hand.
    import gguf

    types = field.types
    if not types:
        return None
    if types[0] == gguf.GGUFValueType.ARRAY:
        if types[-1] == gguf.GGUFValueType.STRING:
            return [bytes(field.parts[i]).decode("utf-8") for i in field.data]
        return [v for i in field.data for v in field.parts[i].tolist()]
    if types[0] == gguf.GGUFValueType.STRING:
        return bytes(field.parts[-1]).decode("utf-8")
    return field.parts[-1].tolist()[0]


# ---------------------------------------------------------------- the reader
# GGUF metadata value types (gguf.GGUFValueType's numbers): struct and numpy codes
_STRING, _ARRAY = 8, 9
_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NP = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32, 7: np.bool_,
       10: np.uint64, 11: np.int64, 12: np.float64}
MAX_DIMS = 4  # GGML_MAX_DIMS
# Bounds on a header, beyond "fits in the file" (docs/limits.md): far above any
# real model (Llama-3-405B: 1,138 tensors, ~50 keys; the largest vocabularies,
# 262k tokens; 280k merges), far below what would exhaust memory when the
# values become Python objects (a GGUF array element costs ~40 bytes as one).
MAX_TENSORS = 1 << 20
MAX_KV = 1 << 16
MAX_ARRAY_LEN = 1 << 22  # metadata array elements (tokens, merges, scores, token types)
MAX_STRING_BYTES = 1 << 24  # one metadata string (a chat template is a few kB)
MAX_NAME_BYTES = 63  # a tensor name: ggml's GGML_MAX_NAME (64) with its NUL; llama.cpp refuses longer
MAX_ELEMENTS = 1 << 40  # elements of one tensor, and of one dimension


@dataclass
class Field:
    name: str
    types: list                 # [value type] or [ARRAY, element type]
    value: object               # scalar, str, or list (arrays)
    data: range                 # one index per element (len() = the array's length), as gguf's

    def contents(self):
        return self.value


@dataclass
class Tensor:
    name: str
    shape: np.ndarray           # ne0 first, as gguf's reader
    tensor_type: object         # gguf.GGMLQuantizationType
    n_elements: int
    n_bytes: int
    data_offset: int            # from the start of the file
    data: np.ndarray


class Reader:
    def release_pages(self) -> None:
        """Drop the file's pages from this process's resident set (the map is
        read-only: a page read again faults back in)."""
        if hasattr(self._mm, "madvise"):
            self._mm.madvise(mmap.MADV_DONTNEED)

    def __init__(self, path: str | Path):
        import gguf  # only GGUF users pay for importing it

        self._gguf = gguf
        self.path = str(path)
        with open(path, "rb") as f:
            self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        # the file as bytes: tensors are views of it, _core readers take it (one map for both)
        self.data = np.frombuffer(self._mm, np.uint8)
        self.byte_order = "I"
        self.fields: dict[str, Field] = {}
        self.tensors: list[Tensor] = []
        self._parse()

    # -------------------------------------------------------------- primitives
    def _need(self, n: int) -> None:
        if n < 0 or self._o + n > len(self._mm):
            raise ValueError(f"header runs past the end of the file (at byte {self._o}, {n} more wanted)")

    def _scalar(self, fmt: str):
        n = struct.calcsize(fmt)
        self._need(n)
        v = struct.unpack_from(fmt, self._mm, self._o)[0]
        self._o += n
        return v

    def _str(self, limit: int = MAX_STRING_BYTES) -> str:
        n = self._scalar("<Q")
        if n > limit:
            raise ValueError(f"a string of {n} bytes at byte {self._o - 8} (limit {limit})")
        self._need(n)
        s = self._mm[self._o : self._o + n]
        self._o += n
        return s.decode("utf-8", errors="replace")

    def _value(self, t: int):
        vt = self._gguf.GGUFValueType
        if t == _STRING:
            return self._str(), [vt(t)], range(1)
        if t in _SCALAR:
            return self._scalar(_SCALAR[t]), [vt(t)], range(1)
        if t != _ARRAY:
            raise ValueError(f"unknown metadata value type {t}")
        et = self._scalar("<I")
        count = self._scalar("<Q")
        if count > MAX_ARRAY_LEN:
            raise ValueError(f"an array of {count} elements at byte {self._o - 8} (limit {MAX_ARRAY_LEN})")
        if et == _STRING:
            self._need(count * 8)  # each string at least its 8-byte length
            # in C++ (each length checked against the file's end and MAX_STRING_BYTES, UTF-8
            # decoded with invalid bytes replaced): the Python loop was 0.35 s of a Llama-3 load
            out, self._o = _core.gguf_string_array(self.data, self._o, count, MAX_STRING_BYTES)
            return out, [vt(_ARRAY), vt(et)], range(count)
        if et not in _NP:
            raise ValueError(f"unsupported array element type {et}")
        item = np.dtype(_NP[et]).itemsize
        self._need(count * item)
        a = np.frombuffer(self._mm, dtype=_NP[et], count=count, offset=self._o)
        self._o += count * item
        return a.tolist(), [vt(_ARRAY), vt(et)], range(count)

    # -------------------------------------------------------------- the file
    def _parse(self) -> None:
        self._o = 0
        self._need(4)
        if self._mm[:4] != b"GGUF":
            raise ValueError("not a GGUF file (bad magic)")
        self._o = 4
        version = self._scalar("<I")
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} (big-endian file, or unsupported)")
        n_tensors, n_kv = self._scalar("<Q"), self._scalar("<Q")
        if n_tensors > MAX_TENSORS or n_kv > MAX_KV:
            raise ValueError(f"header declares {n_tensors} tensors and {n_kv} metadata keys "
                             f"(limits {MAX_TENSORS} and {MAX_KV})")
        # every tensor info and key-value takes at least 8 + 4 bytes
        self._need(n_tensors * 12 + n_kv * 12)
        for _ in range(n_kv):
            key = self._str(MAX_STRING_BYTES)
            value, types, data = self._value(self._scalar("<I"))
            self.fields[key] = Field(key, types, value, data)
        infos = []
        for _ in range(n_tensors):
            name = self._str(MAX_NAME_BYTES)
            nd = self._scalar("<I")
            if nd > MAX_DIMS:
                raise ValueError(f"tensor {name!r} has {nd} dimensions (at most {MAX_DIMS})")
            dims = [self._scalar("<Q") for _ in range(nd)]
            if any(d >= MAX_ELEMENTS for d in dims):
                raise ValueError(f"tensor {name!r} has dimensions {dims} (each below {MAX_ELEMENTS})")
            qt = self._gguf.GGMLQuantizationType(self._scalar("<I"))
            offset = self._scalar("<Q")
            infos.append((name, dims, qt, offset))
        align = self.fields.get("general.alignment")
        align = int(align.value) if align is not None else 32
        if align <= 0 or align & (align - 1):
            raise ValueError(f"general.alignment {align} is not a power of two")
        start = -(-self._o // align) * align
        size = len(self._mm)
        for name, dims, qt, offset in infos:
            n = 1
            for d in dims:
                n *= d
            if n >= MAX_ELEMENTS:
                raise ValueError(f"tensor {name!r} declares {n} elements (limit {MAX_ELEMENTS})")
            qk, bb = self._gguf.GGML_QUANT_SIZES[qt]
            if not dims or dims[0] % qk:
                raise ValueError(f"tensor {name!r}: rows of {dims[:1]} are not whole {qt.name} blocks")
            nbytes = n // qk * bb
            at = start + offset
            if at + nbytes > size:
                raise ValueError(f"tensor {name!r} (offset {offset}, {nbytes} bytes) runs past the end "
                                 f"of the file ({size} bytes); truncated?")
            data = self._view(at, nbytes, dims, qt, qk, bb)
            self.tensors.append(Tensor(name, np.array(dims, np.uint64), qt, n, nbytes, at, data))

    def _view(self, at, nbytes, dims, qt, qk, bb) -> np.ndarray:
        Q = self._gguf.GGMLQuantizationType
        # as gguf's reader: float types as their numpy type, the rest as bytes
        # [.., row bytes], rows reversed to numpy order
        rev = list(reversed(dims))
        raw = self.data[at : at + nbytes]
        if qt == Q.F32:
            return raw.view(np.float32).reshape(rev)
        if qt == Q.F16:
            return raw.view(np.float16).reshape(rev)
        if qt in (Q.I8, Q.I16, Q.I32,
                  Q.I64, Q.F64):
            dt = {Q.I8: np.int8, Q.I16: np.int16,
                  Q.I32: np.int32, Q.I64: np.int64,
                  Q.F64: np.float64}[qt]
            return raw.view(dt).reshape(rev)
        return raw.reshape(*rev[:-1], dims[0] // qk * bb)
