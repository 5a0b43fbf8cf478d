"""Per-layer quantization reports: which matrices a choice hurts.

    llamajet quantize IN OUT --scheme S --method M --calib FILE --report DIR
    llamajet eval --text FILE --scheme a,b --saved DIR --report DIR

For every decoder matrix: weight error (MSE, SQNR = 10 log10 ||W||² / ||W - Ŵ||²,
dB) and output error on calibration inputs (SQNR of W Xᵀ against (W - Ŵ) Xᵀ,
from the Gram of the inputs: calibrate.output_error). The quantize report
sets the method beside RTN of the same matrices on the same inputs; the eval
report sets every configuration beside the others (on the evaluation
windows' inputs, through the float model). Each writes report.json,
report.md (the sensitive matrices named first) and PNG plots (matplotlib,
the `quant` extra) of SQNR by layer, one panel per kind of matrix.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path

import numpy as np

from llamajet.errors import LlamajetError
from llamajet.quant.calibrate import Method, _sqnr, output_error

KINDS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def _kind(name: str) -> str:
    return name.split(".")[2]


def _plot(path: Path, series: dict[str, list[dict]], key: str, title: str) -> None:
    """One panel per kind of matrix: `key` (dB) by layer, one line per series."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise LlamajetError("the report's plots need matplotlib: pip install 'llamajet[quant]'") from None
    fig, axes = plt.subplots(2, 4, figsize=(16, 7), sharex=True)
    for ax, kind in zip(axes.flat, KINDS):
        for label, rows in series.items():
            pts = sorted((r["layer"], r[key]) for r in rows if _kind(r["name"]) == kind and np.isfinite(r[key]))
            if pts:
                ax.plot(*zip(*pts), marker=".", label=label)
        ax.set_title(kind)
        ax.set_xlabel("layer")
        ax.set_ylabel("SQNR (dB)")
        ax.grid(alpha=0.3)
    axes.flat[-1].axis("off")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    axes.flat[-1].legend(handles, labels, loc="center")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def _table(rows: list[dict], cols: list[tuple[str, str, str]]) -> list[str]:
    out = ["| " + " | ".join(h for h, _, _ in cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        out.append("| " + " | ".join(format(r[k], f) if f else str(r[k]) for _, k, f in cols) + " |")
    return out


def write_quantize_report(folder: Path, summary, records, method: str, scheme, worst: int = 10) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    rows = [r.as_dict() for r in records]
    data = {"source": summary.source, "out": summary.out, "scheme": scheme.name, "method": method,
            "bytes_out": summary.bytes_out, "bytes_in": summary.bytes_in, "seconds": summary.seconds,
            "layers": rows}
    (folder / "report.json").write_text(json.dumps(data, indent=1))
    md = [f"# {method} {scheme.name}: {summary.source}", "",
          f"{summary.bytes_out / 1e6:.1f} MB ({summary.bytes_in / 1e6:.1f} MB in), {summary.seconds:.1f} s.", ""]
    if rows:
        _plot(folder / "output_sqnr.png", {method: [dict(r, v=r["output_sqnr_db"]) for r in rows],
                                           "rtn": [dict(r, v=r["rtn_output_sqnr_db"]) for r in rows]},
              "v", f"output SQNR on calibration inputs: {method} vs rtn, {scheme.name}")
        _plot(folder / "weight_sqnr.png", {method: rows}, "weight_sqnr_db", f"weight SQNR, {method} {scheme.name}")
        gain = [r["output_sqnr_db"] - r["rtn_output_sqnr_db"] for r in rows]
        med = np.median([r["output_sqnr_db"] for r in rows])
        med_rtn = np.median([r["rtn_output_sqnr_db"] for r in rows])
        md += [f"Output SQNR over the {len(rows)} matrices: {method} median {med:.2f} dB, rtn {med_rtn:.2f} dB "
               f"(median gain {np.median(gain):+.2f} dB).",
               "", f"## The {worst} most sensitive matrices (lowest output SQNR)", "",
               "![output SQNR](output_sqnr.png)", ""]
        cols = [("matrix", "name", ""), ("shape", "shape", ""), ("output SQNR dB", "output_sqnr_db", ".2f"),
                ("rtn output SQNR dB", "rtn_output_sqnr_db", ".2f"), ("weight SQNR dB", "weight_sqnr_db", ".2f"),
                ("weight MSE", "weight_mse", ".3e")]
        md += _table(sorted(rows, key=lambda r: r["output_sqnr_db"])[:worst], cols)
        md += ["", "## Every matrix", "", "![weight SQNR](weight_sqnr.png)", ""] + _table(rows, cols)
    (folder / "report.md").write_text("\n".join(md) + "\n")


class _Measure(Method):
    """A calibrate.Method that quantizes nothing (the forward stays float)
    and scores every configuration's matrices on each group's inputs."""

    def __init__(self, configs: dict[str, dict]):
        self.configs, self.rows = configs, {c: [] for c in configs}

    def quantize(self, names, ws, inputs):

        for name, w in zip(names, ws):
            w64 = np.asarray(w, np.float64)
            sig_w, sig_o = float((w64 ** 2).sum()), output_error(w64, inputs.gram)
            for c, mats in self.configs.items():
                dw = w64 - mats[name]
                nw = float((dw ** 2).sum())
                self.rows[c].append({"name": name, "layer": int(name.split(".")[1]), "weight_mse": nw / dw.size,
                                     "weight_sqnr_db": _sqnr(sig_w, nw),
                                     "output_sqnr_db": _sqnr(sig_o, output_error(dw, inputs.gram))})
        return ws, {}


def smoothing_meta(cal) -> dict:
    """The smoothings of a Calibrated (float32, base64) for llamajet.json: the saved matrices are
    diag(1/rows) W diag(cols); the report undoes that to compare them with the source's."""
    def enc(d):
        return {n: base64.b64encode(np.asarray(v, "<f4").tobytes()).decode() for n, v in d.items()}
    return {"cols": enc(cal.cols), "rows": enc(cal.rows)}


def _smoothing(folder: Path) -> tuple[dict, dict]:
    meta = json.loads((folder / "llamajet.json").read_text(encoding="utf-8")).get("smoothing") or {}

    def dec(d):
        return {n: np.frombuffer(base64.b64decode(v), "<f4").astype(np.float64) for n, v in d.items()}
    return dec(meta.get("cols", {})), dec(meta.get("rows", {}))


def config_matrices(source_model, path, scheme) -> dict[str, np.ndarray]:
    """float64 values of every decoder matrix a configuration runs, in the
    source's space: a saved folder's (dequantized, its smoothing undone), or
    RTN at load (`scheme`) of the source's."""
    from llamajet.formats.packed import dequantize, rtn_dequant
    from llamajet.loaders import load_model

    model = source_model if path is None else load_model(path)
    cols, rows = ({}, {}) if path is None or not Path(path).is_dir() else _smoothing(Path(path))
    out = {}
    for name, w in model.weights.items():
        if name.startswith("blk.") and _kind(name) in KINDS and not name.endswith(".bias"):
            if scheme is not None:
                out[name] = rtn_dequant(w.to_f32().astype(np.float32), scheme)
            else:
                out[name] = dequantize(w) if w.packed else w.to_f32().astype(np.float64)
            if name in cols:
                out[name] = out[name] / cols[name]
            if name in rows:
                out[name] = out[name] * rows[name][:, None]
    return out


def write_eval_report(folder: Path, source_path, configs: dict[str, tuple], windows: list[list[int]],
                      scores: list[dict], worst: int = 10) -> None:
    """configs: {name: (saved path or None, scheme or None)} — the weights each evaluated
    configuration runs; inputs: the evaluation windows through the float model."""
    from llamajet.loaders import load_model
    from llamajet.quant.calibrate import sequential

    folder.mkdir(parents=True, exist_ok=True)
    src = load_model(source_path)
    measure = _Measure({c: config_matrices(src, p, s) for c, (p, s) in configs.items()})
    sequential(src, windows, measure)
    (folder / "report.json").write_text(json.dumps({"scores": scores, "layers": measure.rows}, indent=1))
    _plot(folder / "output_sqnr.png", measure.rows, "output_sqnr_db", "output SQNR on the evaluation windows")
    _plot(folder / "weight_sqnr.png", measure.rows, "weight_sqnr_db", "weight SQNR")
    md = [f"# llamajet eval report: {Path(source_path).name}", "",
          "| config | PPL | KL vs float | top-1 | median output SQNR dB | weakest matrix |", "|---|---|---|---|---|---|"]
    by = {s["config"]: s for s in scores}
    for c, rows in measure.rows.items():
        w = min(rows, key=lambda r: r["output_sqnr_db"])
        s = by.get(c, {})
        md.append(f"| {c} | {s.get('ppl', float('nan')):.3f} | {s.get('kl', float('nan')):.3e} | "
                  f"{100 * s.get('top1', float('nan')):.1f}% | {np.median([r['output_sqnr_db'] for r in rows]):.2f} | "
                  f"{w['name']} ({w['output_sqnr_db']:.1f} dB) |")
    md += ["", "![output SQNR](output_sqnr.png)", "", "![weight SQNR](weight_sqnr.png)", ""]
    for c, rows in measure.rows.items():
        md += [f"## {c}: the {worst} most sensitive matrices", ""]
        md += _table(sorted(rows, key=lambda r: r["output_sqnr_db"])[:worst],
                     [("matrix", "name", ""), ("output SQNR dB", "output_sqnr_db", ".2f"),
                      ("weight SQNR dB", "weight_sqnr_db", ".2f"), ("weight MSE", "weight_mse", ".3e")]) + [""]
    (folder / "report.md").write_text("\n".join(md) + "\n")


__all__ = ["write_quantize_report", "write_eval_report", "config_matrices"]
