"""Work no thread owns (issue 40): every op of a step is cut into chunks that
threads claim (csrc/runtime/executor.cpp), so a thread the OS takes off its
core stalls nothing; the bits of every row stay those of one thread, whatever
the thread count, the batch, or who ran which chunk; thread counts above the
usable cores are lowered with a warning.

Counts and bits only: speed under load is measured in
benchmarks/contention.py."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from llamajet import LLM, SamplingParams
from llamajet.ops import OpKind, ThreadsClampedWarning, resolve_threads, usable_cores

GREEDY = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
ALL_KINDS = (1 << len(OpKind.__members__)) - 1
PROMPTS = [f"Story {i}: once upon a time a {w} found" for i, w in
           enumerate("cat dog fox owl bee ant cow pig hen elk yak emu gnu ram kid bat".split())]


def record(llm) -> dict:
    """Every logits row the engine's steps compute, keyed by (prompt, tokens
    before it): what a row's bits may not depend on is everything else."""
    rows, runner = {}, llm.engine.runner
    orig = runner.run

    def run(scheduled, copies=()):
        logits = orig(scheduled, copies)
        r = 0
        for s in scheduled:
            if s.logits:
                rows[(tuple(s.seq.token_ids[: s.seq.num_prompt]), s.start + s.num_tokens)] = logits[r].copy()
                r += 1
        return logits

    runner.run = run
    return rows


@pytest.fixture(scope="module")
def by_threads(smollm2_gguf):
    """For n_threads 1, 2, 3 and 5 (more than this machine's cores: kept by
    oversubscribe) and batches of 1, 3 and 16 prompts (the first prompt in
    each; prefix caching then also changes the first prompt's chunking):
    every logits row."""
    out = {}
    for nth in (1, 2, 3, 5):
        llm = LLM(smollm2_gguf, max_model_len=128, n_threads=nth, oversubscribe=True)
        assert llm.n_threads == nth
        rows = record(llm)
        for b in (1, 3, 16):
            llm.generate(PROMPTS[:b], GREEDY)
        out[nth] = rows
    return out


def test_rows_are_the_same_bits_for_every_thread_count_and_batch(by_threads):
    ref = by_threads[1]
    assert len(ref) == 16 * 4  # 16 prompts x (prefill + 3 decode steps): the rows compared
    for nth, rows in by_threads.items():
        assert rows.keys() == ref.keys()
        for k, v in rows.items():
            np.testing.assert_array_equal(v, ref[k], err_msg=f"n_threads={nth} row {k[1]} of {k[0][:4]}...")


def test_the_first_prompt_is_the_same_bits_alone_and_in_a_batch(smollm2_gguf):
    """The same row computed in steps of 1, 3 and 16 sequences (prefix
    caching off: each batch computes it afresh), 2 threads."""
    llm = LLM(smollm2_gguf, max_model_len=128, n_threads=2, oversubscribe=True, enable_prefix_caching=False)
    seen = []
    for b in (1, 3, 16):
        rows = record(llm)
        llm.generate(PROMPTS[:b], GREEDY)
        first = {k: v for k, v in rows.items() if k[0] == next(iter(rows))[0]}
        assert len(first) == 4
        seen.append(first)
    for other in seen[1:]:
        for k, v in other.items():
            np.testing.assert_array_equal(v, seen[0][k])


@pytest.fixture(scope="module")
def two(smollm2_gguf):
    return LLM(smollm2_gguf, max_model_len=128, n_threads=2, oversubscribe=True)


def decode_steps(llm, n=6) -> dict:
    llm.engine.runner.reset_thread_stats()
    rows = record(llm)
    llm.generate(PROMPTS[7], SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
    llm.engine.runner.run = type(llm.engine.runner).run.__get__(llm.engine.runner)
    return rows


@pytest.mark.parametrize("backups", [0, 2])
def test_a_stalled_worker_leaves_its_chunks_to_the_others(two, backups):
    """Worker 1 sits out the first op of every kind in every step (as if the
    OS had taken its core then): the other thread claims all those ops'
    chunks, worker 1 still claims chunks in the ops after, and every logits
    row is the same bits as unstalled. With backup copies on (2: every step
    of <= 16 tokens runs its matmuls staged) and off."""
    exe = two.engine.runner.exe
    exe.backups = 0
    free = decode_steps(two)
    try:
        exe.backups = backups
        exe.set_test_stall(1, ALL_KINDS)
        stalled = decode_steps(two)
        t = two.engine.runner.thread_stats()
    finally:
        exe.set_test_stall(-1, 0)
        exe.backups = 0
    assert t["staged_steps"] == (6 if backups else 0)
    assert stalled.keys() == free.keys() and len(free) == 6
    for k, v in free.items():
        np.testing.assert_array_equal(stalled[k], v)
    per_op = np.array(t["chunks_per_op"])  # [thread, op], the last (decode) step
    kinds = [int(kd) for kd in exe.op_kinds()]
    first = {kinds.index(kd) for kd in set(kinds)}
    assert len(first) >= 8  # embed, rmsnorm / add_rmsnorm, matmul, attention, ... all sat out once
    for k in first:
        assert per_op[1, k] == 0 and per_op[0, k] >= 1, (k, kinds[k])
    later = [k for k in range(exe.num_ops) if k not in first]
    assert per_op[1, later].sum() > 0 and per_op[0, later].sum() > 0  # both threads claim the rest
    assert t["chunks"][1] > 0 and t["chunks"][0] > t["chunks"][1] / 10


def test_a_chunk_held_mid_way_is_backed_up_and_the_late_copy_dropped(two):
    """Worker 1 claims a chunk of every matmul and runs it only after the
    other thread has finished the op (a thread descheduled mid-chunk, whose
    chunk no other thread could take before: the step would wait for it).
    Staged, thread 0 runs each held chunk again and commits it; worker 1's
    late copy loses its commit and writes nothing, though by then the
    buffers it reads and would write belong to later ops. Every logits row
    is the same bits as a run without staging; without the backups the
    steps could not end."""
    exe = two.engine.runner.exe
    exe.backups = 0
    free = decode_steps(two)
    assert two.engine.runner.thread_stats()["staged_steps"] == 0
    matmul = 1 << int(OpKind.matmul)
    try:
        exe.backups = 2
        exe.set_test_stall(1, matmul, every=True, hold=True)
        held = decode_steps(two)
        t = two.engine.runner.thread_stats()
    finally:
        exe.set_test_stall(-1, 0)
        exe.backups = 0
    assert held.keys() == free.keys() and len(free) == 6
    for k, v in free.items():
        np.testing.assert_array_equal(held[k], v)
    n_matmul = [int(kd) for kd in exe.op_kinds()].count(int(OpKind.matmul))
    assert t["staged_steps"] == 6 and n_matmul >= 100
    # One held chunk per matmul and step (the hook lets worker 1 claim first),
    # each backed up by thread 0 (committed) and its late copy dropped; on a
    # crowded CPU thread 0 may also back up a chunk worker 1 was still running
    # (whichever copy commits first wins). Worker 1 backs up nothing (it
    # holds a chunk of every matmul), so each copy of its that was dropped
    # lost to a backup by thread 0.
    assert t["backups"][1] == 0
    assert t["backups"][0] == t["discarded"][1] >= 6 * n_matmul
    with pytest.raises(ValueError, match="matmuls only"):
        exe.set_test_stall(1, ALL_KINDS, hold=True)
    with pytest.raises(ValueError, match="mode 0, 1 or 2"):
        exe.backups = 3


def test_backups_are_opt_in(two, stories_hf, monkeypatch):
    """A bare executor never runs a chunk twice (0): a late copy reads the
    Program's memory after run() returns, which only an owner that keeps
    it alive until quiesce() may allow. The engine's runner can opt in
    (LLAMAJET_BACKUPS; off by default while backups are experimental) and
    quiesces in its finalizer; a wrong value is refused."""
    from llamajet import ops
    from llamajet.errors import LlamajetError

    bare = ops.Executor(isa="ref", n_threads=2, max_tokens=4, max_out=4, max_seqs=1, max_blocks=1, kv_slots=16,
                        block_size=16, max_pos=16)
    assert bare.backups == 0
    bare.quiesce()
    assert two.engine.runner.exe.backups == 0
    monkeypatch.setenv("LLAMAJET_BACKUPS", "busy")
    assert LLM(stories_hf, max_model_len=64).engine.runner.exe.backups == 1
    monkeypatch.setenv("LLAMAJET_BACKUPS", "always")
    assert LLM(stories_hf, max_model_len=64).engine.runner.exe.backups == 2
    monkeypatch.setenv("LLAMAJET_BACKUPS", "sometimes")
    with pytest.raises(LlamajetError, match="LLAMAJET_BACKUPS='sometimes'"):
        LLM(stories_hf, max_model_len=64)


def test_idle_fraction_rises_when_a_worker_is_stalled(two):
    """thread_idle_fraction = 1 - work / (threads x step time). A worker that
    claims nothing in any op computes nothing, so at least half of two
    threads' time is idle by construction; unstalled, both threads compute."""
    runner = two.engine.runner
    decode_steps(two)
    free = runner.thread_stats()
    assert min(free["chunks"]) > 0 and 0.0 <= free["thread_idle_fraction"] < 1.0
    try:
        runner.exe.set_test_stall(1, ALL_KINDS, every=True)
        decode_steps(two)
        stalled = runner.thread_stats()
    finally:
        runner.exe.set_test_stall(-1, 0)
    assert stalled["chunks"][1] == 0 and stalled["work_cycles"][1] == 0
    assert stalled["thread_idle_fraction"] >= 0.5 > 0.0
    assert stalled["steps"] == free["steps"] > 0


def test_stall_hook_refuses_thread_0_and_unknown_threads(two):
    with pytest.raises(ValueError, match="thread 0"):
        two.engine.runner.exe.set_test_stall(0, ALL_KINDS)
    with pytest.raises(ValueError, match="no such thread"):
        two.engine.runner.exe.set_test_stall(2, ALL_KINDS)


def fake_cgroup(tmp_path, quota_us: int | None):
    """A v2 tree with this process in /pod/app and the quota on /pod."""
    (tmp_path / "pod" / "app").mkdir(parents=True, exist_ok=True)
    (tmp_path / "cpu.max").write_text("max 100000\n")
    (tmp_path / "pod" / "cpu.max").write_text(f"{quota_us if quota_us else 'max'} 100000\n")
    (tmp_path / "pod" / "app" / "cpu.max").write_text("max 100000\n")
    (tmp_path / "self").write_text("0::/pod/app\n")
    return {"root": str(tmp_path), "proc_cgroup": str(tmp_path / "self")}


def test_usable_cores_come_from_the_child_cgroup_quota(tmp_path, monkeypatch):
    from llamajet.ops import dispatch

    # 4 cores in the mask whatever this machine has (make test runs each worker on one core)
    monkeypatch.setattr(dispatch, "physical_cores", lambda: 4)
    n, why = usable_cores(**fake_cgroup(tmp_path, 50000))
    assert n == 1 and "0.5 CPUs caps it at 1" in why and "affinity mask" in why
    n, why = usable_cores(**fake_cgroup(tmp_path, 250000))
    assert n == 3 and "2.5 CPUs caps it at 3" in why
    n, why = usable_cores(**fake_cgroup(tmp_path, None))
    assert n == 4 and "no cgroup CPU quota" in why


def test_threads_above_the_usable_cores_are_lowered_with_one_warning(tmp_path):
    where = fake_cgroup(tmp_path, 100000)  # 1 CPU
    with pytest.warns(ThreadsClampedWarning, match=r"n_threads=4 is more than the 1 usable core .*running 1") as w:
        assert resolve_threads(4, **where) == 1
    assert len(w) == 1 and "\n" not in str(w[0].message)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert resolve_threads(4, oversubscribe=True, **where) == 4
        assert resolve_threads(1, **where) == 1
        assert resolve_threads(None, **where) == 1


def test_llm_lowers_n_threads_to_the_usable_cores(stories_hf):
    usable = usable_cores()[0]
    with pytest.warns(ThreadsClampedWarning):
        llm = LLM(stories_hf, max_model_len=64, n_threads=usable + 3)
    assert llm.n_threads == usable
    assert LLM(stories_hf, max_model_len=64, n_threads=usable + 3, oversubscribe=True).n_threads == usable + 3


def test_oversubscribe_must_be_a_bool(stories_hf):
    from llamajet.errors import LlamajetError

    with pytest.raises(LlamajetError, match="oversubscribe"):
        LLM(stories_hf, max_model_len=64, oversubscribe="yes")


def test_decode_steps_run_kv_write_and_attention_as_one_region(two):
    """Where every sequence's tokens are one attention run (decode), each
    layer's kv_write and attention are one region (no wait between them);
    a prefill of several runs keeps them apart (a run's attention reads the
    K/V rows that other runs' kv_write chunks write)."""
    exe = two.engine.runner.exe
    kinds = [int(k) for k in exe.op_kinds()]
    pairs = sum(1 for a, b in zip(kinds, kinds[1:]) if (a, b) == (int(OpKind.kv_write), int(OpKind.attention)))
    assert pairs == two.config.num_layers
    two.generate(PROMPTS[:3], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    assert exe.last_step_regions == exe.num_ops - pairs  # the last step: 3 sequences decoding
    two.generate([" ".join(PROMPTS[:6])], SamplingParams(max_tokens=1, temperature=0))  # > 16 tokens: several runs
    assert exe.last_step_regions == exe.num_ops
