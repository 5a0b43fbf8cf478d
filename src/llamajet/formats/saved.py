"""llamajet's own saved format: its reader and its writer, together.

A folder (written by ``llamajet quantize``, quant/quantize.py):

    llamajet.json        magic, format version, scheme, ModelConfig, one entry per tensor
    model.safetensors    the tensors, every one a view of the mapped file when loaded
    tokenizer.json, tokenizer_config.json, generation_config.json   (HF layout)

``model.safetensors`` is a standard safetensors file (the ``safetensors``
package reads it). Packed matrices are stored as U8 tensors of shape
[n_tiles, n_groups, block_bytes], byte for byte the kernels' layout
(formats/packed.py), so loading maps them and builds Weights around the
views: no copy, no re-quantization. Norms and biases are F32; float matrices
kept unquantized keep their dtype (F32 / F16 / BF16). Every tensor starts
64-byte aligned in the file; the gaps are U8 padding tensors named ``__pad*``
(safetensors allows no holes between tensors).

``llamajet.json``::

    {"magic": "llamajet", "format_version": 1, "scheme": "int4_asym_g32",
     "config": {ModelConfig fields; rope_scaling an object or null},
     "tensors": {"blk.0.attn_q": {"scheme": "int4_asym_g32", "shape": [N, K], "rope_interleaved": true,
                                  "kind": "matrix"},
                 "blk.0.attn_norm": {"dtype": "f32", "shape": [D], "rope_interleaved": false,
                                     "kind": "norm"}, ...}}

("kind" is checked against the architecture's tensor spec; files written
before it was recorded load without it.) A block's q/k/v and gate/up are
saved as one fused tensor each where the fusion passes would stack them (see
`fused`: version 2). A version not in READABLE_VERSIONS is refused: the packed layout may have changed, and reading
old bytes with a new layout would give wrong answers silently. NOTE: `write`
writes llamajet.json last, so a folder holding it holds a complete model.
"""

from __future__ import annotations

import dataclasses
import json
import math
import mmap
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

import numpy as np

from llamajet.config import ModelConfig, RopeScaling
from llamajet.errors import LlamajetError, ModelFormatError, UnsupportedModelError
from llamajet.formats import safetensors as st
from llamajet.formats.layout import FLOATS, Format, QuantScheme
from llamajet.formats.schemes import FORMAT_VERSION, READABLE_VERSIONS, get_scheme, schemes
from llamajet.formats.weight import Kind, Weight
from llamajet.ops import TILE

MAGIC = "llamajet"
META_FILE = "llamajet.json"
WEIGHTS_FILE = "model.safetensors"
ALIGN = 64  # every tensor's first byte, in the file: one cache line / AVX-512 vector
PAD_PREFIX = "__pad"


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


# --- reading ------------------------------------------------------------------------------


# llamajet.json: one line per tensor (~200 bytes) and a smoothing's scales; 64 MiB is far above any model's
MAX_META_BYTES = 64 * 1024 * 1024


def read_meta(folder: Path) -> dict:
    """llamajet.json, with its magic and format version checked."""
    path = folder / META_FILE
    try:
        size = path.stat().st_size
        if size > MAX_META_BYTES:
            raise ModelFormatError(f"{path}: {size} bytes, above the limit of {MAX_META_BYTES} for {META_FILE}")
        meta = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ModelFormatError(f"{path}: no such file") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelFormatError(f"{path}: not valid JSON ({e})") from e
    except RecursionError:  # [[[[...]]]] past Python's parser's depth
        raise ModelFormatError(f"{path}: JSON nested too deeply") from None
    if not isinstance(meta, dict) or meta.get("magic") != MAGIC:
        got = meta.get("magic") if isinstance(meta, dict) else type(meta).__name__
        raise ModelFormatError(f"{path}: not a llamajet saved model (magic {got!r}, expected {MAGIC!r})")
    version = meta.get("format_version")
    if isinstance(version, bool) or version not in READABLE_VERSIONS:
        newer = isinstance(version, int) and not isinstance(version, bool) and version > FORMAT_VERSION
        raise ModelFormatError(
            f"{path}: format_version {version!r}, but this llamajet reads versions "
            f"{', '.join(map(str, READABLE_VERSIONS))} only "
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


def _tensor(name: str, info, entry: st.Entry, buf: mmap.mmap, kind: Kind, source: str) -> Weight:
    """A Weight viewing ``entry``'s bytes in ``buf``, after checking that the
    bytes are exactly what the entry's scheme/dtype x shape needs."""
    if not isinstance(info, dict) or not isinstance(info.get("shape"), list) or \
            not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in info["shape"]):
        raise ModelFormatError(f"{source}: tensor {name!r} has a malformed entry {info!r}")
    shape = tuple(info["shape"])
    if "kind" in info and info["kind"] != kind.value:
        raise ModelFormatError(f"{source}: tensor {name!r} is saved as a {info['kind']!r}, but the "
                               f"architecture says it is a {kind.value!r}")
    inter = bool(info.get("rope_interleaved", False))
    if "scheme" in info:
        fmt: Format = _scheme_of(name, info["scheme"], source)
        if len(shape) != 2:
            raise ModelFormatError(f"{source}: packed tensor {name!r} must be a matrix, has shape {list(shape)}")
        st_dtype = "U8"
    else:
        dtype = info.get("dtype")
        if dtype not in FLOATS:
            raise ModelFormatError(f"{source}: tensor {name!r} has neither a scheme nor a float dtype "
                                   f"({', '.join(FLOATS)}): {info!r}")
        fmt, st_dtype = FLOATS[dtype], st.FLOAT_DTYPES[dtype]
    want = tuple(fmt.storage_shape(shape))
    if entry.dtype != st_dtype or entry.shape != want:
        raise ModelFormatError(
            f"{source}: tensor {name!r} is {entry.dtype} {list(entry.shape)} ({entry.nbytes} bytes) in "
            f"{WEIGHTS_FILE}, but {fmt.name} of shape {list(shape)} needs {st_dtype} {list(want)} "
            f"({math.prod(want) * np.dtype(fmt.np_dtype).itemsize} bytes)")
    return Weight(name, kind, fmt, shape, st.view(entry, buf, fmt.np_dtype, want), inter)


# --- fused tensors -----------------------------------------------------------------------
#
# A block's q, k and v projections, and its gate and up projections, are saved
# as the one tensor the fusion passes make of them at load (graph/passes/qkv.py,
# gate_up.py), so a load maps them as they run: "rows" is [Wq; Wk; Wv] along N
# (q and k rows in interleaved RoPE order), "tiles" is gate and up alternating
# in 16-row tiles. The entry lists its parts ("parts": [[name, rows], ...]) and
# the reader gives each part as a view of the whole (formats/stack.py then takes
# the whole back: no copy; a graph that does not fuse reads the views). Only
# packed matrices without biases that the passes would fuse are saved so.

LAYOUTS = ("rows", "tiles")


def _parts(name: str, info: dict, entry: st.Entry, buf: mmap.mmap, kind_of, config: ModelConfig,
           source: str) -> list[Weight]:
    parts, layout = info.get("parts"), info.get("layout")
    if layout not in LAYOUTS or not isinstance(parts, list) or len(parts) < 2 or not all(
            isinstance(p, list) and len(p) == 2 and isinstance(p[0], str) and isinstance(p[1], int)
            and not isinstance(p[1], bool) and p[1] > 0 for p in parts):
        raise ModelFormatError(f"{source}: fused tensor {name!r} has malformed parts {parts!r} / layout {layout!r}")
    kind = kind_of(config, parts[0][0])
    for pname, _ in parts[1:]:
        if kind_of(config, pname) != kind:
            raise ModelFormatError(f"{source}: fused tensor {name!r} mixes kinds of tensors")
    whole = _tensor(name, {k: v for k, v in info.items() if k not in ("parts", "layout")}, entry, buf, kind, source)
    rows = [n for _, n in parts]
    if not whole.packed or any(n % TILE for n in rows) or sum(rows) != whole.shape[0] or (
            layout == "tiles" and (len(parts) != 2 or rows[0] != rows[1])):
        raise ModelFormatError(f"{source}: fused tensor {name!r} ({whole.format.name} {list(whole.shape)}) "
                               f"cannot hold parts {parts!r} as {layout!r}")
    out, t0 = [], 0
    for i, (pname, n) in enumerate(parts):
        data = whole.data[t0: t0 + n // TILE] if layout == "rows" else whole.data[i::2]
        t0 += n // TILE
        inter = whole.rope_interleaved and layout == "rows" and i < 2  # q, k (v has no RoPE)
        out.append(Weight(pname, kind, whole.format, (n, whole.shape[1]), data, inter,
                          stacked=(whole.data, layout, i, len(parts))))
    return out


def fused(config: ModelConfig, plans: list[SavedTensor]) -> list[SavedTensor]:
    """`plans` with each block's q/k/v and gate/up merged into the tensor the
    fusion passes would stack (see above), where the passes' rules allow."""
    from llamajet.formats.stack import same_kind

    by = {t.name: t for t in plans}
    H, KVH, hd = config.num_heads, config.num_kv_heads, config.head_dim
    wholes: dict[str, SavedTensor] = {}  # first part's name -> the whole
    absorbed: set[str] = set()           # the other parts' names
    for t in plans:
        if t.name.endswith(".attn_q"):
            p, layout, suffixes = t.name[: -len(".attn_q")], "rows", ("attn_q", "attn_k", "attn_v")
            fname = f"{p}.attn_qkv"
        elif t.name.endswith(".ffn_gate"):
            p, layout, suffixes = t.name[: -len(".ffn_gate")], "tiles", ("ffn_gate", "ffn_up")
            fname = f"{p}.ffn_gate_up"
        else:
            continue
        parts = [by.get(f"{p}.{x}") for x in suffixes]
        if any(q is None for q in parts) or fname in by:
            continue
        if (not parts[0].format.packed or not same_kind(parts)
                or any(q.kind != parts[0].kind or q.shape[0] % TILE or f"{q.name}.bias" in by for q in parts)):
            continue
        if layout == "rows":
            nq, nk, nv = (q.shape[0] for q in parts)
            if nq != H * hd or nk != KVH * hd or nv != nk:
                continue
        elif parts[0].shape != parts[1].shape:
            continue
        wholes[parts[0].name] = _whole(fname, layout, parts, (H, KVH), hd)
        absorbed.update(q.name for q in parts[1:])
    return [wholes.get(t.name, t) for t in plans if t.name not in absorbed]


def _whole(name: str, layout: str, parts: list[SavedTensor], heads: tuple[int, int], hd: int) -> SavedTensor:
    """The fused tensor of `parts`; "rows": q and k rows (heads[0], heads[1] heads) put in
    interleaved RoPE order first, as the QKV pass would."""
    from llamajet.formats.stack import rope_interleave_rows

    def produce():
        datas = []
        for i, q in enumerate(parts):
            data = np.asarray(q.produce())
            if layout == "rows" and i < 2 and not q.rope_interleaved:
                w = Weight(q.name, q.kind, q.format, q.shape, np.ascontiguousarray(data), False)
                data = rope_interleave_rows(w, heads[i], hd).data
            datas.append(data)
        if layout == "rows":
            return np.concatenate(datas, axis=0)
        return np.stack(datas, axis=1).reshape(-1, *datas[0].shape[1:])

    p0 = parts[0]
    return SavedTensor(name, p0.kind, p0.format, (sum(q.shape[0] for q in parts), p0.shape[1]), layout == "rows",
                       produce, parts=tuple((q.name, q.shape[0]) for q in parts), layout=layout)


def read(folder: str | Path, kind_of: Callable[[ModelConfig, str], Kind]
         ) -> tuple[ModelConfig, dict[str, Weight], mmap.mmap]:
    """(config, weights, the file's map) of a saved folder; each weight a view of
    the map, its kind from `kind_of(config, name)` (the architecture's tensor spec)."""
    folder = Path(folder)
    meta = read_meta(folder)
    source = str(folder)
    config = config_from_json(meta.get("config"), source)
    path = folder / WEIGHTS_FILE
    if not path.is_file():
        raise ModelFormatError(f"{path}: no such file ({META_FILE} needs it)")
    buf = st.map_read_only(path)
    entries = st.read_header(path, buf)  # offsets within the file, bytes == dtype x shape
    weights = {}
    for name, info in meta["tensors"].items():
        if name not in entries:
            raise ModelFormatError(f"{path}: tensor {name!r} listed in {META_FILE} is missing")
        if isinstance(info, dict) and "parts" in info:
            for w in _parts(name, info, entries[name], buf, kind_of, config, source):
                if w.name in weights or w.name in meta["tensors"]:
                    raise ModelFormatError(f"{source}: tensor {w.name!r} is saved twice (in {name!r})")
                weights[w.name] = w
            continue
        weights[name] = _tensor(name, info, entries[name], buf, kind_of(config, name), source)
    extra = sorted(n for n in entries if n not in meta["tensors"] and not n.startswith(PAD_PREFIX))
    if extra:
        raise ModelFormatError(f"{path}: tensors {extra[:5]} are not listed in {META_FILE}")
    return config, weights, buf


# --- writing ------------------------------------------------------------------------------


@dataclass
class SavedTensor:
    """One tensor to save: what it is and how to make its storage bytes
    (called once, while writing: memory holds one tensor at a time)."""
    name: str
    kind: Kind
    format: Format  # a float format or a packed scheme (GGUF blocks are repacked first)
    shape: tuple[int, ...]
    rope_interleaved: bool
    produce: Callable[[], np.ndarray]
    parts: tuple = ()  # a fused tensor: ((name, rows), ...) of the tensors it holds (see `fused`)
    layout: str = ""   # a fused tensor: "rows" or "tiles"

    def entry(self) -> dict:
        which = {"scheme": self.format.name} if self.format.packed else {"dtype": self.format.name}
        e = {**which, "shape": list(self.shape), "rope_interleaved": self.rope_interleaved, "kind": self.kind.value}
        if self.parts:
            e.update(parts=[list(p) for p in self.parts], layout=self.layout)
        return e

    def item(self) -> st.Item:
        shape = tuple(self.format.storage_shape(self.shape))
        dtype = "U8" if self.format.packed else st.FLOAT_DTYPES[self.format.name]
        return st.Item(self.name, dtype, shape, math.prod(shape) * np.dtype(self.format.np_dtype).itemsize,
                       self.produce)


def kept(w: Weight, release: Callable[[Weight], None] | None = None) -> tuple[SavedTensor, str]:
    """What `w` becomes in a saved model that keeps the checkpoint's weights
    as ``LLM(path)`` runs them (``quantize --scheme keep``, the repacked-weights
    cache), and the summary bucket it counts in: norms and biases f32; packed
    weights as they are; GGUF blocks with a lossless twin repacked (then
    `release`d: the writer drops their file pages); float matrices in their
    own dtype."""
    from llamajet.formats.gguf_blocks import LOSSLESS, repack_gguf

    shape, inter = tuple(w.shape), w.rope_interleaved
    if not w.kind.quantizable:  # norms, biases: f32 (the kernels read fp32)
        return SavedTensor(w.name, w.kind, FLOATS["f32"], shape, inter, w.to_f32), f"{w.kind.value}s (f32)"
    if w.packed:
        return SavedTensor(w.name, w.kind, w.scheme, shape, inter, lambda: w.data), f"copied packed ({w.scheme.name})"
    if w.dtype in LOSSLESS:
        s = get_scheme(LOSSLESS[w.dtype])

        def produce():
            data = repack_gguf(w).data
            if release is not None:
                release(w)
            return data
        return SavedTensor(w.name, w.kind, s, shape, inter, produce), f"repacked losslessly ({w.dtype}->{s.name})"
    return SavedTensor(w.name, w.kind, w.format, shape, inter, lambda: w.data), f"kept float ({w.dtype})"


def _meta_text(meta: dict) -> str:
    """llamajet.json, indented, one line per tensor (a diff or a grep reads it)."""
    head = json.dumps({k: v for k, v in meta.items() if k != "tensors"}, indent=1)
    rows = ",\n".join(f"  {json.dumps(n)}: {json.dumps(i)}" for n, i in meta["tensors"].items())
    return head[:-2] + ',\n "tensors": {\n' + rows + "\n }\n}\n"


def write_weights(folder: Path, tensors: Iterable[SavedTensor]) -> tuple[int, dict]:
    """model.safetensors (via a temporary file, then renamed), after removing a
    stale llamajet.json so an interrupted write leaves no folder that looks
    complete. Returns (file size, the tensors' llamajet.json entries)."""
    tensors = list(tensors)
    (folder / META_FILE).unlink(missing_ok=True)
    tmp = folder / (WEIGHTS_FILE + ".tmp")
    try:
        size = st.write(tmp, [t.item() for t in tensors],
                        {"format": MAGIC, "format_version": str(FORMAT_VERSION)}, ALIGN, PAD_PREFIX)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, folder / WEIGHTS_FILE)
    return size, {t.name: t.entry() for t in tensors}


def write_meta(folder: Path, config: ModelConfig, entries: dict, **extra) -> None:
    """llamajet.json, last: the folder then holds a complete model."""
    meta = {"magic": MAGIC, "format_version": FORMAT_VERSION, **extra, "config": config_to_json(config),
            "tensors": entries}
    tmp = folder / (META_FILE + ".tmp")
    tmp.write_text(_meta_text(meta), encoding="utf-8")
    os.replace(tmp, folder / META_FILE)
