"""``llamajet quantize``: a checkpoint -> llamajet's saved format (formats/saved.py).

What each tensor becomes, for ``scheme`` = a registered scheme S:
  - norms and biases: F32 (tiny; the kernels read fp32);
  - a GGUF Q4_0 / Q4_1 / Q8_0 matrix whose lossless twin is S (Q4_0 = int4_sym_g32,
    Q4_1 = int4_asym_g32, Q8_0 = int8_g32): repacked without loss (``repack_gguf``);
  - a matrix already packed in S (a saved model as input): copied as it is;
  - every other matrix or embedding (f32/f16/bf16, a GGUF type of another scheme,
    GGUF K-quants, which the loader has dequantized): RTN-quantized to S (the C++
    quantizer, bit for bit ``formats.packed.quantize_rtn``), the same call
    ``LLM(path, quantize=S)`` makes at load, so the two run the same bytes.
For ``scheme="keep"``: exactly the weights ``LLM(path)`` runs on the fast path —
Q4_0/Q4_1/Q8_0 matrices repacked without loss (a Q4_1 GGUF with a Q8_0
embedding stays mixed), packed ones as they are, float matrices unquantized in
their own dtype. So a GGUF saved with "keep" gives the logits of the GGUF.

The weights file is written tensor by tensor (sizes are known from scheme x
shape before quantizing), so memory holds one tensor at a time; llamajet.json
is written last, so a folder holding it is complete.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from llamajet import ops
from llamajet.errors import LlamajetError
from llamajet.formats import saved
from llamajet.formats.convert import head_scheme, is_head, lossless_to
from llamajet.formats.gguf_blocks import LOSSLESS
from llamajet.formats.layout import FLOATS
from llamajet.formats.saved import META_FILE, WEIGHTS_FILE, SavedTensor
from llamajet.formats.schemes import QuantScheme, get_scheme, rtn_scheme, schemes
from llamajet.formats.weight import Kind, Weight
from llamajet.loaders import LoadedModel, load_model
from llamajet.tokenizer import Tokenizer, load_tokenizer, tokenizer_from_gguf
from llamajet.tokenizer.export import check_written, write_tokenizer_files

KEEP = "keep"


def check_scheme(name: str) -> QuantScheme | None:
    """The scheme called ``name`` (None for "keep"), or an error listing every choice."""
    if name == KEEP:
        return None
    if name in {s.name for s in schemes()}:
        return rtn_scheme(name)
    try:
        return get_scheme(name)
    except LlamajetError:
        known = ", ".join([KEEP] + sorted(s.name for s in schemes() if s.rtn))
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


def _plan(w: Weight, sch: QuantScheme | None) -> tuple[SavedTensor, str]:
    """What `w` becomes in the saved model, and the summary bucket it counts in."""
    shape, inter = tuple(w.shape), w.rope_interleaved

    def requant(s: QuantScheme):  # the C++ quantizer LLM(path, quantize=S) uses at load
        return SavedTensor(w.name, w.kind, s, shape, inter,
                           lambda: ops.quantize_packed(s.code, s.group_for(shape[1]), w.to_f32()))

    if not w.kind.quantizable or lossless_to(w, sch):  # keep (saved.kept), norms / biases, twins
        return saved.kept(w)
    if w.packed:
        return requant(sch), f"re-quantized {w.scheme.name}->{sch.name}"
    return requant(sch), f"RTN {w.dtype}->{sch.name}"


# --- re-quantization ---------------------------------------------------------------------

FLOAT_TYPES = ("f32", "f16", "bf16")


def source_types(model: LoadedModel) -> dict[str, str]:
    """name -> the type each weight has in the source file: the GGUF tensor type (the block
    types without a packed twin -- Q2_K, Q3_K, IQ* -- are f32 in memory, dequantized at load,
    but their values are still a quantizer's output), else the dtype as loaded."""
    types = {name: w.dtype for name, w in model.weights.items()}
    reader = model.gguf_reader
    if reader is not None:
        from llamajet.model import registry

        spec = registry.get(model.config.architecture)
        for t in reader.tensors:
            mapped = spec.from_gguf(t.name)
            if mapped is not None and mapped[0] in types:
                types[mapped[0]] = t.tensor_type.name.lower()
    return types


def check_requantize(model: LoadedModel, src: Path, targets: dict[str, QuantScheme | None], scheme: str) -> None:
    """Refuse to round again weights that a quantizer already rounded (as llama-quantize does
    without --allow-requantize): the second rounding adds its error to the first's, and what the
    first lost cannot come back (SmolLM2's Q4_1 re-quantized to int4_sym_g64: perplexity +58.6%).
    `targets`: name -> the scheme each quantizable weight would be written in."""
    types = source_types(model)
    lossy = {n: types[n] for n, t in targets.items()
             if types[n] not in FLOAT_TYPES and not lossless_to(model.weights[n], t)}
    if not lossy:
        return
    kinds = sorted(set(lossy.values()))
    twins = sorted({LOSSLESS[k] for k in kinds if k in LOSSLESS})
    names = ", ".join(list(lossy)[:3]) + (", ..." if len(lossy) > 3 else "")
    raise LlamajetError(
        f"{src}: {len(lossy)} of its {len(targets)} matrices are already quantized ({', '.join(kinds)}: {names}); "
        f"re-quantizing them to {scheme} rounds values that were rounded once already: the two errors add up "
        f"and what the first rounding lost cannot come back (perplexity grows far more than from the float "
        f"weights). Quantize the float checkpoint instead (an HF folder, or an F32/F16/BF16 GGUF), "
        f"or keep these weights as they are: --scheme keep"
        + (f" (or {' / '.join(twins)}, their lossless twin{'s' if len(twins) > 1 else ''})" if twins else "")
        + "; --allow-requantize does it anyway")


# --- tokenizer ----------------------------------------------------------------------


def _source_tokenizer(model: LoadedModel, src: Path) -> Tokenizer:
    return tokenizer_from_gguf(model.gguf_reader) if model.gguf_reader is not None else load_tokenizer(src)


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


METHODS = ("rtn", "gptq", "awq", "awq-gptq", "smoothquant", "qat")
CALIBRATED = ("gptq", "awq", "awq-gptq", "smoothquant", "qat")  # the methods that need --calib


def _method(method: str, sch: QuantScheme, model: LoadedModel, act_order: bool, scale_search: bool):
    if method == "gptq":
        from llamajet.quant.gptq import GPTQ
        return GPTQ(sch, model.weights, act_order=act_order, search=scale_search)
    if method == "awq":
        from llamajet.quant.awq import AWQ
        return AWQ(sch, model.weights)
    if method == "awq-gptq":  # GPTQ's act-order is its default here: it is what the pair was measured with
        from llamajet.quant.awq import AWQGPTQ
        return AWQGPTQ(sch, model.weights, act_order=True, search=scale_search)
    if method == "smoothquant":
        from llamajet.quant.smoothquant import SmoothQuant
        return SmoothQuant(sch, model.weights)
    from llamajet.quant.rtn import RTN
    return RTN(sch, model.weights)


def _qat(model, windows, sch, emb_sch, steps, lr, qat_len, progress):
    """QAT's trained weights as a Calibrated: the linears packed by RTN, the norms as trained."""
    try:
        from llamajet.quant.qat import qat_train
    except ImportError:
        raise LlamajetError("method qat needs PyTorch: pip install 'llamajet[qat]'") from None
    from llamajet.formats.packed import quantize_rtn
    from llamajet.quant.calibrate import Calibrated

    emb = model.weights["token_embd"]
    res = qat_train(model, windows, sch, steps=steps, lr=lr, seq_len=qat_len, embed_scheme=emb_sch,
                    progress=progress, keep_head=lossless_to(emb, emb_sch))
    cal = Calibrated()
    for name, v in res.weights.items():
        w = model.weights[name]
        if w.kind.quantizable:
            cal.packed[name] = quantize_rtn(name, v, sch, w.kind, w.rope_interleaved)
        else:
            cal.floats[name] = np.asarray(v, np.float32)
    return cal


def _bias_config(model: LoadedModel):
    """The config under which every decoder projection has a bias (bias correction adds one to each)."""
    if model.config.architecture != "llama":
        raise LlamajetError(f"bias correction adds a bias to every projection, which only the llama "
                            f"architecture's config can state (attention_bias, mlp_bias); this model is "
                            f"{model.config.architecture!r}")
    return dataclasses.replace(model.config, attention_bias=True, mlp_bias=True)


def write_outlier_plan(folder: str | Path, model: LoadedModel | None = None) -> Path | None:
    """Probes the saved model in `folder` once, as the default runtime's load would, and keeps its
    outlier channels and columns there (engine/outliers.py), so `LLM(folder)` maps them and skips
    the probe; any older plan files there are removed first (they belong to the weights that were
    in the folder before). Returns the plan's path, or None when the default runtime runs this model
    with no outlier channels (float activations, or a scheme with no int8 path). `model`: the folder
    already loaded (mapped), if the caller has it."""
    from llamajet.config import RuntimeConfig
    from llamajet.engine import outliers
    from llamajet.engine.runner import compile_graph

    folder = Path(folder)
    for old in folder.glob("outliers-k*-p*-v*.npz"):
        old.unlink()
    model = model if model is not None else load_model(folder)
    cfg = RuntimeConfig().for_model(model.config)
    ids = outliers.load_probe(load_tokenizer(folder), model, cfg)
    if ids is None:
        return None
    path = outliers.plan_file(folder, cfg.act_outliers, len(ids))
    outliers.save_plan(compile_graph(model, cfg, probe_ids=ids).graph, path)
    return path if path.is_file() else None


def quantize_model(src: str | Path, out: str | Path, scheme: str, force: bool = False, method: str = "rtn",
                   calib: str | Path | None = None, calib_seqs: int = 128, calib_len: int = 512,
                   act_order: bool = True, embed_scheme: str | None = None, scale_search: bool = True,
                   bias_correction: bool = False, report: str | Path | None = None,
                   qat_steps: int = 120, qat_lr: float = 1e-4, qat_len: int = 256,
                   allow_requantize: bool = False, calib_seed: int = 0,
                   progress=None) -> QuantizeSummary:
    """Convert the checkpoint ``src`` (HF folder, GGUF, or a saved model) into a
    saved llamajet model in folder ``out`` (see the module docstring).
    The calibrated methods (gptq, awq, smoothquant; quant/*.py) quantize the
    decoder matrices against calibration inputs from the text file `calib`
    (calib_seqs windows of calib_len tokens), layer after layer
    (quant/calibrate.py); embeddings and the other tensors go as with RTN.
    Without `calib` they calibrate on text the model writes itself
    (quant/selfcalib.py, seeded by calib_seed: the same folder every time).
    embed_scheme: the token embedding's and output head's scheme; None keeps
    them at 8 bits or their source type under a scheme of fewer bits
    (formats/convert.head_scheme). Weights a quantizer already rounded are
    not rounded again unless allow_requantize (check_requantize).
    act_order: GPTQ's column order by decreasing salience (default on: the
    better setting on every measured row).
    bias_correction (any method; needs calib) gives each decoder matrix the
    bias that cancels its mean output shift on the calibration inputs.
    report: a folder for the per-layer report (quant/report.py).
    method "qat" (quant/qat.py, PyTorch: the `qat` extra) fine-tunes the float
    weights through their fake quantization for qat_steps steps of one
    window of qat_len tokens, distilled from the float model, then packs RTN
    of the trained weights (exactly the values it trained with)."""
    t0 = time.perf_counter()
    src, out = Path(src), Path(out)
    sch = check_scheme(scheme)
    if method not in METHODS:
        raise LlamajetError(f"unknown method {method!r}; known: {', '.join(METHODS)}")
    calibrated_run = method in CALIBRATED or bias_correction or (report is not None and calib is not None)
    if calibrated_run:
        what = f"method {method}" if method in CALIBRATED else ("bias correction" if bias_correction else "--report")
        if sch is None:
            raise LlamajetError(f"{what} needs a scheme to quantize to, not {KEEP!r}")
        if calib is not None and not Path(calib).is_file():
            raise LlamajetError(f"--calib {calib}: no such file (a text file to calibrate on; without "
                                f"--calib, {what} calibrates on text the model writes itself)")
        if calib_seqs < 1 or calib_len < 16:
            raise LlamajetError("calibration needs at least 1 window of at least 16 tokens")
    if method == "qat" and (bias_correction or report is not None):
        raise LlamajetError("--bias-correction and --report are for the calibrated PTQ methods, not qat")
    if method == "qat" and qat_steps < 1:
        raise LlamajetError("QAT needs at least 1 step")
    _check_out(src, out, force)
    model = load_model(src)  # before touching out: a bad input leaves nothing behind
    if calibrated_run and calib_len > model.config.max_position_embeddings:
        raise LlamajetError(f"--calib-len {calib_len} is longer than the model's context "
                            f"({model.config.max_position_embeddings} tokens)")
    # The token embedding and the output head (tied or not) take their own scheme: by default at
    # least 8 bits (formats/convert.head_scheme, the rule LLM(path, quantize=S) follows at load):
    # a lookup gains nothing from calibration, and the head's error reaches every logit.
    emb_fixed = check_scheme(embed_scheme) if embed_scheme is not None else None

    def emb_sch(w: Weight) -> QuantScheme | None:
        if embed_scheme is not None:
            return emb_fixed
        return None if sch is None else head_scheme(w, sch)

    def target(w: Weight) -> QuantScheme | None:
        return emb_sch(w) if is_head(w) else sch

    if not allow_requantize:  # before any calibration: refused in seconds, not after minutes
        check_requantize(model, src, {n: target(w) for n, w in model.weights.items() if w.kind.quantizable}, scheme)
    tok = _source_tokenizer(model, src)
    config = _bias_config(model) if bias_correction else model.config
    from llamajet.quant.calibrate import Calibrated
    from llamajet.quant.report import smoothing_meta
    cal = Calibrated()
    windows = None
    if calibrated_run or method == "qat":
        from llamajet.quant.calibrate import calibration_windows

        if calib is not None:
            windows = calibration_windows(tok, Path(calib).read_text(encoding="utf-8"), calib_seqs, calib_len)
        else:
            from llamajet.quant.selfcalib import self_generated_windows

            windows = self_generated_windows(src, tok, calib_seqs, calib_len, seed=calib_seed, progress=progress,
                                             max_context=model.config.max_position_embeddings)
    if method == "qat":
        cal = _qat(model, windows, sch, emb_sch(model.weights["token_embd"]), qat_steps, qat_lr, qat_len, progress)
    elif calibrated_run:
        from llamajet.quant.calibrate import sequential

        cal = sequential(model, windows, _method(method, sch, model, act_order, scale_search), progress,
                         bias_correction=bias_correction, report_scheme=sch if report is not None else None)
    label = method + ("+bc" if bias_correction else "")

    def plan(w: Weight):
        if w.name in cal.packed:
            pw = cal.packed[w.name]
            return SavedTensor(w.name, w.kind, sch, tuple(w.shape), w.rope_interleaved, lambda: pw.data), \
                f"{label} {w.dtype}->{sch.name}"
        if w.name in cal.floats:  # an RMSNorm weight that absorbed a smoothing (or QAT trained), a corrected bias
            v = cal.floats[w.name]
            return SavedTensor(w.name, w.kind, FLOATS["f32"], tuple(w.shape), w.rope_interleaved, lambda: v), \
                f"{w.kind.value}s {'corrected' if w.kind is Kind.BIAS else 'trained' if method == 'qat' else 'smoothed'} (f32)"
        return _plan(w, target(w))

    plans = [plan(w) for w in model.weights.values()]
    for name, v in cal.floats.items():  # biases the correction added
        if name not in model.weights:
            mat = model.weights[name[: -len(".bias")]]
            plans.append((SavedTensor(name, Kind.BIAS, FLOATS["f32"], v.shape, mat.rope_interleaved,
                                      lambda v=v: v), "bias corrections added (f32)"))

    out.mkdir(parents=True, exist_ok=True)
    # q/k/v and gate/up saved as the fused tensors the passes run (LLM(out) maps them: no copy at load)
    size, entries = saved.write_weights(out, saved.fused(model.config, [t for t, _ in plans]))
    write_tokenizer_files(tok, src, out, model.config.max_position_embeddings)
    check_written(tok, out)
    extra = {"smoothing": smoothing_meta(cal)} if cal.cols else {}
    saved.write_meta(out, config, entries, scheme=scheme if label == "rtn" else f"{scheme}+{label}",
                     source=src.name, **extra)
    # the folder must load (headers, sizes, config: maps, reads no weight bytes), and that load probes
    write_outlier_plan(out, load_model(out))

    counts: dict[str, int] = {}
    for _, what in plans:
        counts[what] = counts.get(what, 0) + 1
    summary = QuantizeSummary(str(src), str(out), scheme, counts, _bytes_in(src), size, time.perf_counter() - t0)
    if report is not None:
        from llamajet.quant.report import write_quantize_report
        write_quantize_report(Path(report), summary, cal.records, method=label, scheme=sch)
    return summary


__all__ = ["quantize_model", "write_outlier_plan", "check_scheme", "QuantizeSummary", "KEEP", "LOSSLESS", "METHODS"]
