"""Hugging Face folders: config.json + one or many ``*.safetensors``.

A safetensors file is an 8-byte little-endian header length, a JSON header
``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}``
and the tensor bytes, offsets relative to the end of the header. We parse the
header ourselves and make numpy views on a read-only ``mmap`` of the file: no
tensor byte is copied (the ``safetensors`` package's ``get_tensor`` copies).
"""

from __future__ import annotations

import json
import math
import mmap
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from llamajet.config import ModelConfig
from llamajet.errors import ModelFormatError, UnsupportedModelError
from llamajet.loaders import LoadedModel, WeightTensor, check_weights
from llamajet.loaders.names import canonical_to_hf, hf_to_canonical

INDEX_FILE = "model.safetensors.index.json"

# safetensors dtype -> (our storage dtype, numpy view dtype) for the formats we run
_SUPPORTED = {"F32": ("f32", np.float32), "F16": ("f16", np.float16), "BF16": ("bf16", np.uint16)}
# Item sizes of every dtype the format defines, to validate entries we do not use.
_ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1,
             "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


@dataclass(frozen=True)
class _Entry:
    """One tensor in a safetensors file: where its bytes lie in the mmap."""
    file: Path
    dtype: str  # safetensors spelling, e.g. "BF16"
    shape: tuple[int, ...]
    offset: int  # absolute byte offset in the file
    nbytes: int


def read_header(path: Path, buf: mmap.mmap) -> dict[str, _Entry]:
    """Parse and validate a safetensors header; every tensor's bytes lie within
    the file and match dtype x shape."""
    size = len(buf)
    if size < 8:
        raise ModelFormatError(f"{path}: {size} bytes is too short for a safetensors header")
    header_len = int.from_bytes(buf[:8], "little")
    if header_len > size - 8:
        raise ModelFormatError(f"{path}: header length {header_len} exceeds the file ({size} bytes); truncated?")
    try:
        header = json.loads(bytes(buf[8:8 + header_len]).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelFormatError(f"{path}: safetensors header is not valid JSON ({e})") from e
    if not isinstance(header, dict):
        raise ModelFormatError(f"{path}: safetensors header is not a JSON object")
    data_start, data_len = 8 + header_len, size - 8 - header_len
    entries: dict[str, _Entry] = {}
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
        itemsize = _ITEMSIZE.get(dtype)
        if itemsize is not None and end - begin != math.prod(shape) * itemsize:
            raise ModelFormatError(f"{path}: tensor {name!r} spans {end - begin} bytes, but {dtype} "
                                   f"{list(shape)} needs {math.prod(shape) * itemsize}")
        entries[name] = _Entry(path, dtype, shape, data_start + begin, end - begin)
    return entries


def _weight_files(folder: Path) -> tuple[list[Path], dict[str, str] | None]:
    """The safetensors files to read, and the index's name -> file map if any."""
    index_path = folder / INDEX_FILE
    if index_path.is_file():
        try:
            weight_map = json.loads(index_path.read_text(encoding="utf-8"))["weight_map"]
            assert isinstance(weight_map, dict) and all(isinstance(v, str) for v in weight_map.values())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, AssertionError) as e:
            raise ModelFormatError(f"{index_path}: not a valid safetensors index ({e!r})") from e
        files = [folder / f for f in sorted(set(weight_map.values()))]
        for f in files:
            if not f.is_file():
                raise ModelFormatError(f"{index_path} lists {f.name}, which does not exist")
        return files, weight_map
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        others = sorted(p.name for p in folder.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".ckpt"))
        if others:
            raise UnsupportedModelError(f"{folder}: weights in {others[0]} (PyTorch pickle); only safetensors "
                                        "is supported: re-save with save_pretrained(safe_serialization=True)")
        raise ModelFormatError(f"{folder}: no *.safetensors weight files")
    return files, None


def _map_read_only(path: Path) -> mmap.mmap:
    try:
        with open(path, "rb") as f:
            return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)  # the map outlives the descriptor
    except (OSError, ValueError) as e:  # ValueError: an empty file cannot be mapped
        raise ModelFormatError(f"{path}: cannot be memory-mapped ({e})") from e


def _view(entry: _Entry, buf: mmap.mmap, canonical: str) -> WeightTensor:
    if entry.dtype not in _SUPPORTED:
        raise UnsupportedModelError(f"{entry.file}: tensor {canonical_to_hf(canonical)!r} has dtype "
                                    f"{entry.dtype}; supported: {', '.join(_SUPPORTED)}")
    dtype, np_dtype = _SUPPORTED[entry.dtype]
    data = np.frombuffer(buf, dtype=np_dtype, count=math.prod(entry.shape), offset=entry.offset)
    return WeightTensor(canonical, dtype, entry.shape, data.reshape(entry.shape))


def load_hf(folder: str | Path) -> LoadedModel:
    """Load a Hugging Face Llama folder; weights are views of mmapped files."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ModelFormatError(f"{folder}: not a folder")
    try:
        config = ModelConfig.from_hf(folder)
    except (ModelFormatError, UnsupportedModelError) as e:
        if str(folder) in str(e):
            raise
        raise type(e)(f"{folder / 'config.json'}: {e}") from e
    files, weight_map = _weight_files(folder)

    maps: list[mmap.mmap] = []
    entries: dict[str, _Entry] = {}
    buffers: dict[Path, mmap.mmap] = {}
    for path in files:
        buf = _map_read_only(path)
        maps.append(buf)
        buffers[path] = buf
        for name, entry in read_header(path, buf).items():
            if name in entries:
                raise ModelFormatError(f"tensor {name!r} is in both {entries[name].file.name} and {path.name}")
            entries[name] = entry
    if weight_map is not None:
        for name, fname in weight_map.items():
            if name not in entries or entries[name].file.name != fname:
                raise ModelFormatError(f"{folder / INDEX_FILE} puts {name!r} in {fname}, which does not hold it")

    weights: dict[str, WeightTensor] = {}
    for name, entry in entries.items():
        canonical = hf_to_canonical(name)
        if canonical is not None:  # others (e.g. rotary inv_freq buffers) are not ours
            weights[canonical] = _view(entry, buffers[entry.file], canonical)
    config = check_weights(config, weights, str(folder), canonical_to_hf)
    return LoadedModel(config=config, weights=weights, source=str(folder), gguf_reader=None, keepalive=maps)
