"""llamajet's own saved format (written by ``llamajet quantize``, quant/saved.py).

A folder:

    llamajet.json        magic, format version, scheme, ModelConfig, one entry per tensor
    model.safetensors    the tensors, every one a view of the mapped file when loaded
    tokenizer.json, tokenizer_config.json, generation_config.json   (HF layout)

``model.safetensors`` is a standard safetensors file (the ``safetensors``
package reads it). Packed matrices are stored as U8 tensors of shape
[n_tiles, n_groups, block_bytes], byte for byte the kernels' layout
(quant/pack.py), so loading maps them and builds ``PackedWeight``s around
the views: no copy, no re-quantization. Norms are F32; float matrices kept
unquantized keep their dtype (F32 / F16 / BF16). Every tensor starts 64-byte
aligned in the file; the gaps are U8 padding tensors named ``__pad*``
(safetensors allows no holes between tensors).

``llamajet.json``::

    {"magic": "llamajet", "format_version": 1, "scheme": "int4_asym_g32",
     "config": {ModelConfig fields; rope_scaling an object or null},
     "tensors": {"blk.0.attn_q": {"scheme": "int4_asym_g32", "shape": [N, K], "rope_interleaved": true},
                 "blk.0.attn_norm": {"dtype": "f32", "shape": [D], "rope_interleaved": false}, ...}}

A format version other than ``quant.schemes.FORMAT_VERSION`` is refused: the
packed layout may have changed, and reading old bytes with a new layout would
give wrong answers silently. NOTE: quant/saved.py writes llamajet.json last,
so a folder holding it holds a complete model.
"""

from __future__ import annotations

import dataclasses
import json
import math
import mmap
from pathlib import Path

import numpy as np

from llamajet.config import ModelConfig, RopeScaling
from llamajet.errors import LlamajetError, ModelFormatError, UnsupportedModelError
from llamajet.loaders import LoadedModel, WeightTensor, check_weights
from llamajet.loaders.safetensors import _map_read_only, read_header
from llamajet.quant.pack import PackedWeight, block_bytes
from llamajet.quant.schemes import FORMAT_VERSION, TILE_ROWS, QuantScheme, get_scheme, schemes

MAGIC = "llamajet"
META_FILE = "llamajet.json"
WEIGHTS_FILE = "model.safetensors"
ALIGN = 64  # every tensor's first byte, in the file: one cache line / AVX-512 vector
PAD_PREFIX = "__pad"

# float storage dtype (WeightTensor.dtype) <-> safetensors dtype, numpy view dtype
FLOAT_DTYPES = {"f32": ("F32", np.float32), "f16": ("F16", np.float16), "bf16": ("BF16", np.uint16)}


def is_saved_model(path: Path) -> bool:
    return path.is_dir() and (path / META_FILE).is_file()


def packed_storage_shape(scheme: QuantScheme, shape: tuple[int, int]) -> tuple[int, int, int]:
    """[n_tiles, n_groups, block_bytes] of a packed [N, K] matrix (quant/pack.py's layout)."""
    n, k = shape
    g = scheme.group_for(k)
    return -(-n // TILE_ROWS), scheme.k_padded(k) // g, block_bytes(scheme, g)


# --- ModelConfig <-> JSON ---------------------------------------------------------------


def config_to_json(cfg: ModelConfig) -> dict:
    d = dataclasses.asdict(cfg)  # rope_scaling becomes a dict; tuples stay tuples (json writes lists)
    return {k: list(v) if isinstance(v, tuple) else v for k, v in d.items()}


def config_from_json(d, source: str) -> ModelConfig:
    if not isinstance(d, dict):
        raise ModelFormatError(f"{source}: 'config' must be an object")
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    unknown = sorted(set(d) - known)
    if unknown:
        raise ModelFormatError(f"{source}: config has unknown fields {unknown}")
    d = dict(d)
    try:
        if d.get("rope_scaling") is not None:
            d["rope_scaling"] = RopeScaling(**d["rope_scaling"])
        for key in ("eos_token_ids", "rope_freq_factors"):
            if isinstance(d.get(key), list):
                d[key] = tuple(d[key])
        return ModelConfig(**d)
    except (ModelFormatError, UnsupportedModelError) as e:
        raise type(e)(f"{source}: config: {e}") from e
    except TypeError as e:  # a missing field, or rope_scaling with wrong keys
        raise ModelFormatError(f"{source}: config is incomplete or malformed ({e})") from e


# --- loading ------------------------------------------------------------------------------


def read_meta(folder: Path) -> dict:
    """llamajet.json, with its magic and format version checked."""
    path = folder / META_FILE
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ModelFormatError(f"{path}: no such file") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelFormatError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(meta, dict) or meta.get("magic") != MAGIC:
        got = meta.get("magic") if isinstance(meta, dict) else type(meta).__name__
        raise ModelFormatError(f"{path}: not a llamajet saved model (magic {got!r}, expected {MAGIC!r})")
    version = meta.get("format_version")
    if version != FORMAT_VERSION:
        newer = isinstance(version, int) and not isinstance(version, bool) and version > FORMAT_VERSION
        raise ModelFormatError(
            f"{path}: format_version {version!r}, but this llamajet reads version {FORMAT_VERSION} only "
            "(the packed layout differs between versions); "
            + ("it was written by a newer llamajet: upgrade" if newer
               else "re-run `llamajet quantize` on the original checkpoint"))
    if not isinstance(meta.get("tensors"), dict):
        raise ModelFormatError(f"{path}: 'tensors' must be an object")
    return meta


def _scheme_of(name: str, s, source: str) -> QuantScheme:
    try:
        return get_scheme(s)
    except (LlamajetError, TypeError):
        known = ", ".join(sorted(x.name for x in schemes()))
        raise ModelFormatError(f"{source}: tensor {name!r} has unknown scheme {s!r}; known: {known}") from None


def _tensor(name: str, info, entry, buf: mmap.mmap, source: str):
    """A PackedWeight or WeightTensor viewing ``entry``'s bytes in ``buf``, after
    checking that the bytes are exactly what the entry's scheme/dtype x shape needs."""
    if not isinstance(info, dict) or not isinstance(info.get("shape"), list) or \
            not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in info["shape"]):
        raise ModelFormatError(f"{source}: tensor {name!r} has a malformed entry {info!r}")
    shape = tuple(info["shape"])
    inter = bool(info.get("rope_interleaved", False))
    if "scheme" in info:
        sch = _scheme_of(name, info["scheme"], source)
        if len(shape) != 2:
            raise ModelFormatError(f"{source}: packed tensor {name!r} must be a matrix, has shape {list(shape)}")
        want = packed_storage_shape(sch, shape)
        if entry.dtype != "U8" or entry.shape != want:
            raise ModelFormatError(
                f"{source}: tensor {name!r} is {entry.dtype} {list(entry.shape)} ({entry.nbytes} bytes) in "
                f"{WEIGHTS_FILE}, but {sch.name} of shape {list(shape)} needs U8 {list(want)} "
                f"({math.prod(want)} bytes)")
        data = np.frombuffer(buf, np.uint8, count=entry.nbytes, offset=entry.offset).reshape(want)
        return PackedWeight(name, sch, shape, data, FORMAT_VERSION, inter)
    dtype = info.get("dtype")
    if dtype not in FLOAT_DTYPES:
        raise ModelFormatError(f"{source}: tensor {name!r} has neither a scheme nor a float dtype "
                               f"({', '.join(FLOAT_DTYPES)}): {info!r}")
    st_dtype, np_dtype = FLOAT_DTYPES[dtype]
    if entry.dtype != st_dtype or entry.shape != shape:
        raise ModelFormatError(f"{source}: tensor {name!r} is {entry.dtype} {list(entry.shape)} in "
                               f"{WEIGHTS_FILE}, but {META_FILE} says {st_dtype} {list(shape)}")
    data = np.frombuffer(buf, np_dtype, count=math.prod(shape), offset=entry.offset).reshape(shape)
    return WeightTensor(name, dtype, shape, data, rope_interleaved=inter)


def load_llamajet(folder: str | Path) -> LoadedModel:
    """Load a folder written by ``llamajet quantize``; weights are views of the mapped file."""
    folder = Path(folder)
    meta = read_meta(folder)
    source = str(folder)
    config = config_from_json(meta.get("config"), source)
    path = folder / WEIGHTS_FILE
    if not path.is_file():
        raise ModelFormatError(f"{path}: no such file ({META_FILE} needs it)")
    buf = _map_read_only(path)
    entries = read_header(path, buf)  # offsets within the file, bytes == dtype x shape
    weights = {}
    for name, info in meta["tensors"].items():
        if name not in entries:
            raise ModelFormatError(f"{path}: tensor {name!r} listed in {META_FILE} is missing")
        weights[name] = _tensor(name, info, entries[name], buf, source)
    extra = sorted(n for n in entries if n not in weights and not n.startswith(PAD_PREFIX))
    if extra:
        raise ModelFormatError(f"{path}: tensors {extra[:5]} are not listed in {META_FILE}")
    config = check_weights(config, weights, source, lambda n: n)
    return LoadedModel(config=config, weights=weights, source=source, gguf_reader=None, keepalive=[buf])
