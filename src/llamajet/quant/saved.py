"""``llamajet quantize``: a checkpoint -> llamajet's saved format (loaders/llamajet.py).

What each tensor becomes, for ``scheme`` = a registered scheme S:
  - norms: F32 (tiny; the rmsnorm kernel reads fp32);
  - a GGUF Q4_0 / Q4_1 / Q8_0 matrix whose lossless twin is S (Q4_0 = int4_sym_g32,
    Q4_1 = int4_asym_g32, Q8_0 = int8_g32): repacked without loss (``repack_gguf``);
  - a matrix already packed in S (a saved model as input): copied as it is;
  - every other matrix (f32/f16/bf16, a GGUF type of another scheme, GGUF K-quants,
    which the loader has dequantized): RTN-quantized to S (``quantize_rtn``), the
    same call ``LLM(path, quantize=S)`` makes at load, so the two run the same bytes.
For ``scheme="keep"``: exactly the weights ``LLM(path)`` runs on the fast path —
Q4_0/Q4_1/Q8_0 matrices repacked without loss (a Q4_1 GGUF with a Q8_0
embedding stays mixed), packed ones as they are, float matrices unquantized in
their own dtype. So a GGUF saved with "keep" gives the logits of the GGUF.

The weights file is written tensor by tensor (sizes are known from scheme x
shape before quantizing), so memory holds one tensor at a time; llamajet.json
is written last, so a folder holding it is complete.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from llamajet.errors import LlamajetError
from llamajet.loaders import LoadedModel, load_model
from llamajet.loaders.llamajet import (ALIGN, FLOAT_DTYPES, MAGIC, META_FILE, PAD_PREFIX, WEIGHTS_FILE,
                                       config_to_json, packed_storage_shape)
from llamajet.quant.pack import PackedWeight, quantize_rtn, repack_gguf
from llamajet.quant.schemes import FORMAT_VERSION, QuantScheme, get_scheme, schemes
from llamajet.tokenizer import Tokenizer, load_tokenizer, tokenizer_from_gguf

KEEP = "keep"
# GGUF block types -> the scheme that holds them without loss (as repack_gguf maps them)
LOSSLESS = {"q4_0": "int4_sym_g32", "q4_1": "int4_asym_g32", "q8_0": "int8_g32"}


def check_scheme(name: str) -> QuantScheme | None:
    """The scheme called ``name`` (None for "keep"), or an error listing every choice."""
    if name == KEEP:
        return None
    try:
        return get_scheme(name)
    except LlamajetError:
        known = ", ".join([KEEP] + sorted(s.name for s in schemes()))
        raise LlamajetError(f"unknown quantization scheme {name!r}; known: {known}") from None


@dataclass
class QuantizeSummary:
    source: str
    out: str
    scheme: str
    counts: dict[str, int] = field(default_factory=dict)  # what happened -> number of tensors
    bytes_in: int = 0   # the source's weight files on disk
    bytes_out: int = 0  # model.safetensors
    seconds: float = 0.0

    @property
    def tensors(self) -> int:
        return sum(self.counts.values())

    def format(self) -> str:
        how = ", ".join(f"{n} {what}" for what, n in sorted(self.counts.items()))
        ratio = self.bytes_out / self.bytes_in if self.bytes_in else float("nan")
        return (f"llamajet quantize: {self.source} -> {self.out} (scheme {self.scheme})\n"
                f"  tensors: {self.tensors} ({how})\n"
                f"  bytes:   {self.bytes_in / 1e6:.1f} MB in -> {self.bytes_out / 1e6:.1f} MB out "
                f"({WEIGHTS_FILE}), {ratio:.2f}x\n"
                f"  time:    {self.seconds:.2f} s")


@dataclass
class _Item:
    """One tensor of the output: its llamajet.json entry, its safetensors entry,
    and how to produce its bytes (called once, while writing)."""
    name: str
    info: dict            # llamajet.json entry
    st_dtype: str         # safetensors dtype
    st_shape: tuple[int, ...]
    nbytes: int
    produce: Callable[[], np.ndarray]
    what: str             # summary bucket


def _plan(name: str, w, sch: QuantScheme | None) -> _Item:
    inter = bool(getattr(w, "rope_interleaved", False))
    shape = tuple(int(v) for v in w.shape)
    base = {"shape": list(shape), "rope_interleaved": inter}

    def packed(s: QuantScheme, produce, what) -> _Item:
        st = packed_storage_shape(s, shape)
        return _Item(name, {"scheme": s.name, **base}, "U8", st, int(np.prod(st)), produce, what)

    def floating(dtype: str, produce, what) -> _Item:
        st_dtype, np_dtype = FLOAT_DTYPES[dtype]
        nbytes = int(np.prod(shape)) * np.dtype(np_dtype).itemsize
        return _Item(name, {"dtype": dtype, **base}, st_dtype, shape, nbytes, produce, what)

    if name.endswith("_norm"):  # NOTE: the same rule as quant/convert.py's _is_matrix
        return floating("f32", w.to_f32, "norms (f32)")
    if isinstance(w, PackedWeight):
        if sch is None or w.scheme == sch:
            return packed(w.scheme, lambda: w.data, f"copied packed ({w.scheme.name})")
        return packed(sch, lambda: quantize_rtn(name, w.to_f32(), sch).data,
                      f"re-quantized {w.scheme.name}->{sch.name}")
    if w.dtype in LOSSLESS and (sch is None or sch.name == LOSSLESS[w.dtype]):
        s = get_scheme(LOSSLESS[w.dtype])
        return packed(s, lambda: repack_gguf(name, w.data, w.dtype, shape, inter).data,
                      f"repacked losslessly ({w.dtype}->{s.name})")
    if sch is None:  # keep: a float matrix stays float, in its own dtype (bf16 as raw bits)
        return floating(w.dtype, lambda: w.data, f"kept float ({w.dtype})")
    return packed(sch, lambda: quantize_rtn(name, w.to_f32(), sch).data, f"RTN {w.dtype}->{sch.name}")


def _write_safetensors(path: Path, items: list[_Item]) -> int:
    """Streams ``items`` into a safetensors file, each tensor 64-byte aligned
    (padding tensors fill the gaps). Returns the file size."""
    header: dict = {"__metadata__": {"format": MAGIC, "format_version": str(FORMAT_VERSION)}}
    order: list[tuple[_Item | None, int]] = []  # (tensor, or None for a padding of n bytes)
    off = 0
    for it in items:
        pad = -off % ALIGN
        if pad:
            header[f"{PAD_PREFIX}{len(order)}"] = {"dtype": "U8", "shape": [pad], "data_offsets": [off, off + pad]}
            order.append((None, pad))
            off += pad
        header[it.name] = {"dtype": it.st_dtype, "shape": list(it.st_shape), "data_offsets": [off, off + it.nbytes]}
        order.append((it, it.nbytes))
        off += it.nbytes
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * (-(8 + len(text)) % ALIGN)  # the spec pads the header with spaces; data starts aligned
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


# --- tokenizer ----------------------------------------------------------------------


def _source_tokenizer(model: LoadedModel, src: Path) -> Tokenizer:
    return tokenizer_from_gguf(model.gguf_reader) if model.gguf_reader is not None else load_tokenizer(src)


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    return data if isinstance(data, dict) else {}


def _write_tokenizer(tok: Tokenizer, src: Path, out: Path, max_len: int) -> None:
    """tokenizer.json (copied from an HF source, else the backend built from the
    GGUF vocabulary), and configs that state every fact load_tokenizer needs
    explicitly: bos/eos, add_bos, chat template, stop ids."""
    src_dir = src if src.is_dir() else None
    if src_dir is not None and (src_dir / "tokenizer.json").is_file():
        shutil.copyfile(src_dir / "tokenizer.json", out / "tokenizer.json")
        tcfg = _read_json(src_dir / "tokenizer_config.json")
        gcfg = _read_json(src_dir / "generation_config.json")
    else:
        tok.backend.save(str(out / "tokenizer.json"))
        tcfg = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_len}
        gcfg = {}

    def name(i: int | None) -> str | None:
        # a token named by its text only when the text leads back to that id
        t = tok.backend.id_to_token(i) if i is not None else None
        return t if t is not None and tok.backend.token_to_id(t) == i else None

    for key, i in (("bos_token", tok.bos_id), ("eos_token", tok.eos_id)):
        tcfg.pop(key, None)
        if name(i) is not None:
            tcfg[key] = name(i)
    tcfg["add_bos_token"] = tok.add_bos
    tcfg.pop("chat_template", None)
    if tok.chat_template:
        tcfg["chat_template"] = tok.chat_template
    # NOTE: every stop id goes into generation_config's eos list (primary EOS first):
    # the saved folder has no config.json, whose eos ids the source's tokenizer may have used.
    stops = ([tok.eos_id] if tok.eos_id is not None else []) + sorted(tok.stop_ids - {tok.eos_id})
    gcfg["eos_token_id"] = stops
    gcfg.pop("bos_token_id", None)
    if tok.bos_id is not None:
        gcfg["bos_token_id"] = tok.bos_id
    (out / "tokenizer_config.json").write_text(json.dumps(tcfg, indent=2, ensure_ascii=False) + "\n",
                                               encoding="utf-8")
    (out / "generation_config.json").write_text(json.dumps(gcfg, indent=2) + "\n", encoding="utf-8")
    (out / "chat_template.jinja").unlink(missing_ok=True)  # a stale one (--force) would win over tcfg's


def _check_tokenizer(tok: Tokenizer, out: Path) -> None:
    """The saved tokenizer must behave as the source's: same ids, BOS/EOS, stops, template."""
    new = load_tokenizer(out)
    specials = "".join(new.backend.id_to_token(i) or "" for i in sorted(new.special_ids)[:8])
    probe = f"Hello world!  It's 2024: ünïcödé ✓ 漢字\n\n\tcode();{specials} end"
    facts = ("bos_id", "add_bos", "stop_ids", "chat_template")
    diff = [f for f in facts if getattr(new, f) != getattr(tok, f)]
    if tok.eos_id is not None and new.eos_id != tok.eos_id:
        diff.append("eos_id")
    for special in (True, False):
        if new.encode(probe, add_special_tokens=special) != tok.encode(probe, add_special_tokens=special):
            diff.append(f"encode(add_special_tokens={special})")
    if diff:
        raise LlamajetError(f"{out}: the saved tokenizer differs from the source's in {', '.join(diff)}")


# --- the command ----------------------------------------------------------------------


def _bytes_in(src: Path) -> int:
    if src.is_file():
        return src.stat().st_size
    return sum(p.stat().st_size for p in src.glob("*.safetensors"))


def _check_out(src: Path, out: Path, force: bool) -> None:
    """Refuse an output that would clobber something; writes nothing."""
    if out.exists() and not out.is_dir():
        raise LlamajetError(f"{out}: exists and is not a folder")
    if out.is_dir() and any(out.iterdir()):
        if not force:
            raise LlamajetError(f"{out}: folder exists and is not empty; pass --force to overwrite "
                                f"{META_FILE}, {WEIGHTS_FILE} and the tokenizer files in it")
        if out.resolve() == (src if src.is_dir() else src.parent).resolve():
            raise LlamajetError(f"{out}: is where the source lives; write the output elsewhere")


def _meta_text(meta: dict) -> str:
    """llamajet.json, indented, one line per tensor (a diff or a grep reads it)."""
    head = json.dumps({k: v for k, v in meta.items() if k != "tensors"}, indent=1)
    rows = ",\n".join(f"  {json.dumps(n)}: {json.dumps(i)}" for n, i in meta["tensors"].items())
    return head[:-2] + ',\n "tensors": {\n' + rows + "\n }\n}\n"


def quantize_model(src: str | Path, out: str | Path, scheme: str, force: bool = False) -> QuantizeSummary:
    """Convert the checkpoint ``src`` (HF folder, GGUF, or a saved model) into a
    saved llamajet model in folder ``out`` (see the module docstring)."""
    t0 = time.perf_counter()
    src, out = Path(src), Path(out)
    sch = check_scheme(scheme)
    _check_out(src, out, force)
    model = load_model(src)  # before touching out: a bad input leaves nothing behind
    tok = _source_tokenizer(model, src)
    items = [_plan(name, w, sch) for name, w in model.weights.items()]

    out.mkdir(parents=True, exist_ok=True)
    # NOTE: a stale llamajet.json goes first, so an interrupted run leaves no
    # folder that looks complete.
    (out / META_FILE).unlink(missing_ok=True)
    tmp = out / (WEIGHTS_FILE + ".tmp")
    try:
        size = _write_safetensors(tmp, items)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, out / WEIGHTS_FILE)
    _write_tokenizer(tok, src, out, model.config.max_position_embeddings)
    _check_tokenizer(tok, out)
    meta = {
        "magic": MAGIC,
        "format_version": FORMAT_VERSION,
        "scheme": scheme,
        "source": src.name,
        "config": config_to_json(model.config),
        "tensors": {it.name: it.info for it in items},
    }
    tmp = out / (META_FILE + ".tmp")
    tmp.write_text(_meta_text(meta), encoding="utf-8")
    os.replace(tmp, out / META_FILE)
    load_model(out)  # the folder must load: headers, sizes, config (maps, reads no weight bytes)

    counts: dict[str, int] = {}
    for it in items:
        counts[it.what] = counts.get(it.what, 0) + 1
    return QuantizeSummary(str(src), str(out), scheme, counts, _bytes_in(src), size, time.perf_counter() - t0)


__all__ = ["quantize_model", "check_scheme", "QuantizeSummary", "KEEP", "LOSSLESS"]
