"""The safetensors container: header parsing on a memory map, and writing.

A safetensors file is an 8-byte little-endian header length, a JSON header
``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}``
and the tensor bytes, offsets relative to the end of the header. We parse the
header ourselves and make numpy views on a read-only ``mmap`` of the file: no
tensor byte is copied (the ``safetensors`` package's ``get_tensor`` copies).
Used by HF folders (loaders/safetensors.py) and llamajet's saved format
(formats/saved.py), which writes with every tensor 64-byte aligned.
"""

from __future__ import annotations

import json
import math
import mmap
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

import numpy as np

from llamajet.errors import ModelFormatError

# Item sizes of every dtype the format defines, to validate entries we do not use.
ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1,
            "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}
# llamajet float format names <-> safetensors dtypes (bf16 held as raw uint16 bits)
FLOAT_DTYPES = {"f32": "F32", "f16": "F16", "bf16": "BF16"}
FROM_FLOAT = {v: k for k, v in FLOAT_DTYPES.items()}
# A header is a few hundred bytes per tensor; the safetensors package refuses
# headers above 100 MB too (its HeaderTooLarge), so no file it wrote is refused.
MAX_HEADER_BYTES = 100_000_000


@dataclass(frozen=True)
class Entry:
    """One tensor in a safetensors file: where its bytes lie in the mmap."""
    file: Path
    dtype: str  # safetensors spelling, e.g. "BF16"
    shape: tuple[int, ...]
    offset: int  # absolute byte offset in the file
    nbytes: int


def map_read_only(path: Path) -> mmap.mmap:
    try:
        with open(path, "rb") as f:
            return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)  # the map outlives the descriptor
    except (OSError, ValueError) as e:  # ValueError: an empty file cannot be mapped
        raise ModelFormatError(f"{path}: cannot be memory-mapped ({e})") from e


def read_header(path: Path, buf: mmap.mmap) -> dict[str, Entry]:
    """Parse and validate a safetensors header; every tensor's bytes lie within
    the file and match dtype x shape."""
    size = len(buf)
    if size < 8:
        raise ModelFormatError(f"{path}: {size} bytes is too short for a safetensors header")
    header_len = int.from_bytes(buf[:8], "little")
    if header_len > MAX_HEADER_BYTES:
        raise ModelFormatError(f"{path}: header length {header_len} is above the limit of "
                               f"{MAX_HEADER_BYTES} bytes; not a safetensors file, or corrupt")
    if header_len > size - 8:
        raise ModelFormatError(f"{path}: header length {header_len} exceeds the file ({size} bytes); truncated?")
    try:
        header = json.loads(bytes(buf[8:8 + header_len]).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelFormatError(f"{path}: safetensors header is not valid JSON ({e})") from e
    except RecursionError:  # [[[[...]]]]: Python's parser gives up at its recursion limit
        raise ModelFormatError(f"{path}: safetensors header nests JSON too deeply") from None
    if not isinstance(header, dict):
        raise ModelFormatError(f"{path}: safetensors header is not a JSON object")
    data_start, data_len = 8 + header_len, size - 8 - header_len
    entries: dict[str, Entry] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = info["dtype"], tuple(info["shape"]), info["data_offsets"]
        except (TypeError, KeyError, ValueError) as e:
            raise ModelFormatError(f"{path}: tensor {name!r} has a malformed header entry {info!r}") from e
        ints = (*shape, begin, end)
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in ints):
            raise ModelFormatError(f"{path}: tensor {name!r}: shape and offsets must be non-negative integers")
        if not (begin <= end <= data_len):
            raise ModelFormatError(f"{path}: tensor {name!r} data_offsets [{begin}, {end}] fall outside the "
                                   f"{data_len} data bytes; truncated or corrupt file")
        itemsize = ITEMSIZE.get(dtype)
        if itemsize is not None and end - begin != math.prod(shape) * itemsize:
            raise ModelFormatError(f"{path}: tensor {name!r} spans {end - begin} bytes, but {dtype} "
                                   f"{list(shape)} needs {math.prod(shape) * itemsize}")
        entries[name] = Entry(path, dtype, shape, data_start + begin, end - begin)
    return entries


def view(entry: Entry, buf: mmap.mmap, np_dtype, shape: tuple[int, ...]) -> np.ndarray:
    """The entry's bytes as a read-only numpy array of `shape` (no copy)."""
    return np.frombuffer(buf, dtype=np_dtype, count=math.prod(shape), offset=entry.offset).reshape(shape)


@dataclass
class Item:
    """A tensor to write: its safetensors dtype and shape, and how to make its
    bytes (called once, while writing, so memory holds one tensor at a time)."""
    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    produce: Callable[[], np.ndarray]


def write(path: Path, items: Iterable[Item], metadata: dict[str, str], align: int = 64,
          pad_prefix: str = "__pad") -> int:
    """Streams `items` into a safetensors file, each tensor `align`-byte aligned
    (U8 padding tensors named pad_prefix* fill the gaps: the format allows no
    holes between tensors). Returns the file size."""
    header: dict = {"__metadata__": dict(metadata)}
    order: list[tuple[Item | None, int]] = []  # (tensor, or None for a padding of n bytes)
    off = 0
    for it in items:
        pad = -off % align
        if pad:
            header[f"{pad_prefix}{len(order)}"] = {"dtype": "U8", "shape": [pad], "data_offsets": [off, off + pad]}
            order.append((None, pad))
            off += pad
        header[it.name] = {"dtype": it.dtype, "shape": list(it.shape), "data_offsets": [off, off + it.nbytes]}
        order.append((it, it.nbytes))
        off += it.nbytes
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * (-(8 + len(text)) % align)  # the spec pads the header with spaces; data starts aligned
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little"))
        f.write(text)
        for it, n in order:
            if it is None:
                f.write(bytes(n))
                continue
            data = np.ascontiguousarray(it.produce())
            if data.nbytes != it.nbytes:  # a layout bug, never a user error
                raise AssertionError(f"{it.name}: produced {data.nbytes} bytes, planned {it.nbytes}")
            f.write(data.view(np.uint8).reshape(-1).data)
        size = f.tell()
    if size != 8 + len(text) + off:
        raise AssertionError(f"{path}: wrote {size} bytes, planned {8 + len(text) + off}")
    return size
