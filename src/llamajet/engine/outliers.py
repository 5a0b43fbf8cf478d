"""Which input channels of the W*A8 matmuls are kept in float (RuntimeConfig.act_outliers).

At load, the fused step graph runs once over a fixed calibration text
(PROBE_TEXT, ours, in the package: nothing is read from outside) in a probe
executor of its own (its own arena and a KV pool of that one sequence; the
weights are the graph's, shared). The probe keeps every int8 input that
graph/passes/outliers.py can rewrite as an output, and reads it back after
the step: per channel, max |x| over the text's tokens (from the int8 codes
times their group scales: the channels that matter are the large ones, which
int8 holds to 1/254 of their size). Each input's k channels of largest max
|x| are the list, sorted. The lists depend on the weights and the text only:
the same for every step and batch, so a sequence's ids stay independent of
what it is batched with.

Why max |x| and not a model of the error: on SmolLM2-135M (2 WikiText-2
windows, KL vs float activations), the top 8 by max |x| gave 1.18e-3 against
1.27e-3 for a greedy choice by the modelled rounding error of each group
(amax² times the weights' column norms); the outliers set the group scale
whichever tokens they appear on, and max |x| finds exactly those.
"""

from __future__ import annotations

import copy
import hashlib
import math
import threading
from collections import OrderedDict

import numpy as np

from llamajet import _core, ops
from llamajet.graph.ir import Graph
from llamajet.graph.lower import KVLayout, lower
from llamajet.graph.passes.outliers import quantized_inputs
from llamajet.graph.planner import plan_memory

# Tokens of PROBE_TEXT the probe runs: a prefill of them at load, so fewer on big models. On
# SmolLM2-135M (20 WikiText-2 windows, benchmarks/default_path.py) 128 tokens gave KL 9.99e-4, 9.2e-4
# on decode steps, 16 of 20 chat replies equal to float activations'; 32 tokens 9.93e-4, 1.09e-3, 15.
# The probe of an 8B took 3.5 s at 128 tokens (its load 3.4 s without it): 32 there. A 1B's
# (0.8 GB Q4_K_M) took 0.48 s of a 1.6 s load at 128 tokens: 64 there, between the two counts
# SmolLM2 measured as equal.
PROBE_TOKENS = 128
PROBE_TOKENS_MEDIUM = 64
PROBE_TOKENS_LARGE = 32
MEDIUM_MODEL_BYTES = 512 << 20  # weights' bytes from which a model is "medium" here
LARGE_MODEL_BYTES = 2 << 30  # ... and "large"

# Our own text, mixed in register (narrative, technical, dialogue, lists, numbers, code): the
# channels it lights up are the model's, not the text's, but a varied text finds more of them.
PROBE_TEXT = """The morning train left the valley at seven, and by the time it reached the coast the fog had
lifted. Maria counted the stations on her fingers: four more, then the long tunnel, then home.
"Did you bring the tickets?" her brother asked. "Of course," she said, and held them up.
To configure the server, set the port to 8080, enable TLS, and restart the service with
`systemctl restart web.service`. The log file is written to /var/log/web/access.log.
Ingredients: 2 cups of flour, 1 teaspoon of salt, 3 eggs, 250 ml of milk. Whisk until smooth.
In 1969, the first crewed landing on the Moon took place; the mission lasted eight days.
def mean(xs):
    return sum(xs) / len(xs) if xs else 0.0
The committee's report found that revenue grew 12% year over year, while costs fell by 3%.
Q: What is the boiling point of water at sea level? A: 100 degrees Celsius, or 212 Fahrenheit.
Photosynthesis converts light energy into chemical energy stored in glucose molecules.
She laughed, closed the book, and walked out into the rain without an umbrella."""


def probe_ids(tokenizer, n: int = PROBE_TOKENS) -> list[int]:
    """The first n tokens of PROBE_TEXT as the model reads it."""
    ids = tokenizer.encode(PROBE_TEXT)
    return ids[:n]


def probe_tokens(model) -> int:
    """How many probe tokens `model` runs: PROBE_TOKENS, PROBE_TOKENS_MEDIUM from
    MEDIUM_MODEL_BYTES of weights, PROBE_TOKENS_LARGE from LARGE_MODEL_BYTES."""
    size = sum(w.data.nbytes for w in model.weights.values())
    if size >= LARGE_MODEL_BYTES:
        return PROBE_TOKENS_LARGE
    return PROBE_TOKENS_MEDIUM if size >= MEDIUM_MODEL_BYTES else PROBE_TOKENS


def load_probe(tokenizer, model, cfg) -> list[int] | None:
    """The probe ids a load under runtime `cfg` runs: None when it runs no outlier channels
    (act_outliers 0, float activations, or unfused: compile_graph's rule), else probe_ids cut to
    one context (compile_graph's limit), so that len() is the count a plan file is named by."""
    if not (cfg.act_outliers and cfg.act_int8 and cfg.fuse):
        return None
    return probe_ids(tokenizer, probe_tokens(model))[:cfg.max_model_len]


def model_probe_ids(model, n: int | None = None) -> list[int]:
    """probe_ids with the model's own tokenizer (from its GGUF vocabulary, or the folder's
    tokenizer files), for a runner built without one (LLM passes the ids of the tokenizer it has).
    A model with no tokenizer (a bare GGUF, a folder of weights only: test fixtures, mostly)
    gets n fixed pseudo-random ids of its vocabulary instead: the channels the probe finds are
    the weights' (the same ones light up whatever the text), so any tokens find most of them."""
    from llamajet.errors import TokenizerError
    from llamajet.tokenizer import load_tokenizer, tokenizer_from_gguf

    try:
        tok = tokenizer_from_gguf(model.gguf_reader) if model.gguf_reader is not None else \
            load_tokenizer(model.source)
    except TokenizerError:
        return np.random.default_rng(0).integers(0, model.config.vocab_size, n or probe_tokens(model)).tolist()
    return probe_ids(tok, n or probe_tokens(model))


def input_absmax(graph: Graph, ids: list[int], *, isa: str, n_threads: int, max_pos: int,
                 block_size: int = 16) -> dict[str, np.ndarray]:
    """max |x| per channel of every int8 input graph/passes/outliers.py can rewrite (by producer
    name), over one prefill step of `ids` in a probe executor."""
    targets = quantized_inputs(graph)
    if not targets:
        return {}
    probe = copy.copy(graph)
    probe.outputs = [t for _, t, _ in targets]  # kept to the end of the step
    # only the nodes the targets need (backwards from them; kv_write stays, as attention reads
    # its state): the LM head's matmul and argmax go, a fifth of the probe's multiply-adds at 1B
    # (T x 128,256 x 2,048): a 1B Q4_K_M load's probe 0.59 -> 0.50 s at 128 tokens
    live, kept = set(probe.outputs), []
    for n in reversed(graph.nodes):
        if any(t in live for t in n.writes()):
            kept.append(n)
            live.update(n.reads())
    probe.nodes = kept[::-1]
    if len(ids) > max_pos:  # the step refuses positions past max_pos: let it say so
        return _probe(probe, targets, ids, isa=isa, n_threads=n_threads, max_pos=max_pos, block_size=block_size)
    key = _probe_key(probe, ids, isa, n_threads, block_size)
    with _MEMO_LOCK:
        hit = _MEMO.get(key)
        if hit is not None:
            _MEMO.move_to_end(key)
            return {name: a.copy() for name, a in hit.items()}
    out = _probe(probe, targets, ids, isa=isa, n_threads=n_threads, max_pos=max_pos, block_size=block_size)
    with _MEMO_LOCK:
        _MEMO[key] = {name: a.copy() for name, a in out.items()}
        while len(_MEMO) > MEMO_ENTRIES:
            _MEMO.popitem(last=False)
    return out


# The probe is a pure function of the probe graph (nodes, tensors, the weights' bytes), the ids and
# the executor's settings (ISA, threads, block size; max_pos: see POSITION_FIELDS): a process that
# loads one model again (a test session loads the default model dozens of times; a server
# restarting a model) gets the maxima of the last identical probe instead of running it again (~1 s
# of SmolLM2-135M's load on a busy 2-core machine). The key digests all of that, weights included byte
# for byte, so a changed weight misses: the graph's description by SHA-1, the bytes of its arrays by
# _core.content_digest (128 bits, threaded, about a read of the weights: SHA-1 of a 1B model's ~1 GB
# was 0.6 s of every load, memo hit or not, ~0.05 s this way).
MEMO_ENTRIES = 8  # a few small dicts: one [width] float32 array per rewritable input
_MEMO: OrderedDict[bytes, dict[str, np.ndarray]] = OrderedDict()
_MEMO_LOCK = threading.Lock()
PROBES_RUN = [0]  # probe steps run in this process (tests count them)
# The RoPE tables (read as `cos` / `sin`) hold a row per position of the context (max_model_len),
# row p being cos / sin(p * inv_freq) whatever the length (ops/ref.py rope_tables), and a step over
# positions 0..T-1 reads rows 0..T-1 only; the executor's max_pos only bounds the positions. So the
# key holds those T rows and not max_pos: loads at any context >= T share a probe (a test session
# loads the default model at contexts 128 to 2048; tests/test_outliers.py checks two contexts'
# maxima are equal when both probe).
POSITION_FIELDS = {"cos", "sin"}


def _probe_key(probe: Graph, ids, isa: str, n_threads: int, block_size: int) -> bytes:
    T = len(ids)
    h = hashlib.sha1(usedforsecurity=False)

    def data(a: np.ndarray) -> None:
        h.update(_core.content_digest(np.ascontiguousarray(a).reshape(-1).view(np.uint8), n_threads))

    h.update(repr((list(map(int, ids)), isa, n_threads, block_size, probe.outputs)).encode())
    fields: dict[str, set[str]] = {}  # weight -> the operand fields it is read under
    for n in probe.nodes:
        h.update(repr((n.name, n.op, list(n.inputs.items()), list(n.outputs.items()))).encode())
        for a, v in sorted(n.attrs.items()):  # scalars and enums; an array by its bytes (repr elides)
            h.update(repr((a, v.dtype.str, v.shape) if isinstance(v, np.ndarray) else (a, v)).encode())
            if isinstance(v, np.ndarray):
                data(v)
        for f, t in n.inputs.items():
            if t in probe.weights:
                fields.setdefault(t, set()).add(f)
            else:
                h.update(repr(probe.tensors[t]).encode())
        for t in n.writes():
            h.update(repr(probe.tensors[t]).encode())
    for name in sorted(fields):
        w = probe.weights[name]
        arr = w.data
        if fields[name] <= POSITION_FIELDS:  # a RoPE table: the rows of positions 0..T-1
            arr = arr[:T]
            h.update(repr((name, w.dtype, w.shape[1:], w.kind, arr.dtype.str, arr.shape)).encode())
        else:
            h.update(repr((name, w.dtype, w.shape, w.kind, arr.dtype.str, arr.shape)).encode())
        data(arr)
    return h.digest()


def _probe(probe: Graph, targets, ids, *, isa: str, n_threads: int, max_pos: int, block_size: int):
    """input_absmax's step: the probe graph run once over `ids` in an executor of its own."""
    PROBES_RUN[0] += 1
    T = len(ids)
    # every row is an output row: the LM head's input (the final norm of the gathered rows) must be
    # seen on every token, not on the last alone
    plan = plan_memory(probe, {"T": T, "O": T})
    blocks = math.ceil(T / block_size)
    exe = ops.Executor(isa=isa, n_threads=n_threads, max_tokens=T, max_out=T, max_seqs=1, max_blocks=blocks,
                       kv_slots=blocks * block_size, block_size=block_size, max_pos=max_pos, scratch_floats=0)
    arena = exe.alloc_buffer(plan.arena_bytes)
    kv_spec = next(n for n in probe.nodes if n.op == "kv_write").attrs
    kv_heads, hd = kv_spec["kv_heads"], kv_spec["head_dim"]
    layers = sum(1 for n in probe.nodes if n.op == "kv_write")
    kvb = exe.alloc_buffer(KVLayout.nbytes(layers, blocks * block_size, kv_heads, hd, "f32"))
    kv = KVLayout(kvb, blocks * block_size, kv_heads, hd, block_size, "f32")
    lower(probe, plan, exe, arena, kv, defaults={"matmul": {"float_act": False}})
    pos = np.arange(T, dtype=np.int32)
    exe.run(np.asarray(ids, np.int32), pos, pos.copy(), np.zeros(T, np.int32),
            np.arange(blocks, dtype=np.int32).reshape(1, blocks), pos.copy())
    buf = exe.buffer(arena)
    out = {}
    for prod, t, _ in targets:
        spec = probe.tensors[t]
        n, g = spec.shape[-1], spec.group
        kpad = -(-n // g) * g
        ng = kpad // g
        off = plan.offsets[t]
        q = buf[off:off + T * kpad].view(np.int8).reshape(T, ng, g)
        doff = off + -(-T * kpad // 64) * 64
        dx = buf[doff:doff + 4 * T * ng].view(np.float32).reshape(T, ng)
        x = np.abs(q.astype(np.float32) * dx[..., None]).reshape(T, kpad)[:, :n]
        out[prod.name] = x.max(axis=0)
    return out


def choose(absmax: dict[str, np.ndarray], k: int) -> dict[str, np.ndarray]:
    """Each input's k channels of largest max |x| (ties: the lower channel), ascending."""
    out = {}
    for name, a in absmax.items():
        kk = min(k, len(a))
        top = np.argsort(-a, kind="stable")[:kk]
        out[name] = np.sort(top).astype(np.int32)
    return out


def kernel_columns(isa: str, n_threads: int):
    """columns(w, cols) -> W[:, cols] [N, k] float32, the weight's dequantized values: for
    packed weights read value by value from their codes and scales (_core.packed_columns, the
    scalar spec of the kernels' dequantization); for the other storage types from the kernels
    themselves, one float-activation matmul of the weight with the k one-hot rows e_c (each
    output is w_c * 1 plus zeros). No float copy of the matrix (a whole-matrix dequantization
    took 0.7-1.8 s of SmolLM2's load, and 8B's matrices are 1000x)."""

    def columns(w, cols) -> np.ndarray:
        cols = np.asarray(cols, np.int64)
        k, (N, K) = len(cols), w.shape
        if w.packed:  # each value read from its own code and scales (0.2 s -> 0.01 s of a 1B's load)
            return _core.packed_columns(w.code, w.group, N, K, np.ascontiguousarray(w.data).reshape(-1), cols)
        ex = ops.Executor(isa=isa, n_threads=n_threads, max_tokens=k, max_out=k, max_seqs=1, max_blocks=1,
                          kv_slots=16, block_size=16, max_pos=1, scratch_floats=0)
        xb, ob = ex.alloc_buffer(4 * k * K), ex.alloc_buffer(4 * k * N)
        x = np.zeros((k, K), np.float32)
        x[np.arange(k), cols] = 1.0
        ex.buffer(xb).view(np.float32)[:] = x.ravel()
        p = ops.OPS["matmul"]()
        p.x = ops.Ref.in_buffer(xb, 0, ops.DType.F32, ops.ROWS_TOKENS, K)
        p.w = ops.Ref.from_array(w.data, w.code, N, K, w.group)
        p.out = ops.Ref.in_buffer(ob, 0, ops.DType.F32, ops.ROWS_TOKENS, N)
        p.float_act = True
        ex.add(p)
        z = np.zeros(k, np.int32)
        ex.run(z, z, z, z, np.zeros((1, 1), np.int32), np.zeros(0, np.int32))
        return np.ascontiguousarray(ex.buffer(ob).view(np.float32).reshape(k, N).T)

    return columns


# ---------------------------------------------------------------- kept with a weight_cache entry

def plan_file(entry, k: int, n_probe: int):
    """Where a weight_cache entry keeps the outlier channels and columns its loads found."""
    from pathlib import Path

    return Path(entry) / f"outliers-k{k}-p{n_probe}-v1.npz"


def saved_plan(path) -> dict | None:
    """The channels (by producer) and tiled columns (by weight) of a plan file, or None when it
    is missing or unreadable (a load then probes again)."""
    try:
        with np.load(path, allow_pickle=False) as z:
            ocols = {n[len("ocols:"):]: z[n] for n in z.files if n.startswith("ocols:")}
            ow = {n[len("ow:"):]: z[n] for n in z.files if n.startswith("ow:")}
    except (OSError, ValueError, KeyError):
        return None
    return {"ocols": ocols, "ow": ow} if ocols else None


def save_plan(graph: Graph, path) -> None:
    """Writes the outlier channels and columns `graph` was given (graph/passes/outliers.py's
    weights), through a temporary file and a rename: a reader never sees half a file."""
    import os

    arrays = {}
    for name, w in graph.weights.items():
        if name.endswith(".ocols"):
            arrays["ocols:" + name[:-len(".ocols")]] = np.asarray(w.data)
        elif name.endswith(".ow"):
            arrays["ow:" + name[:-len(".ow")]] = np.asarray(w.data)
    if not arrays:
        return
    tmp = str(path) + f".tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        np.savez(f, **arrays)
    os.replace(tmp, path)
