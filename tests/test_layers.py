"""The layering contracts (pyproject.toml [tool.importlinter]): imports run one
way (cli -> eval -> api | quant -> engine -> loaders -> model -> graph ->
formats -> ops), and config / tokenizer / errors import only errors and the
GGUF metadata reader. Checked by import-linter on the source, and shown able
to fail on a copy of the package with a backward import added."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT

LINT = Path(sys.executable).parent / "lint-imports"


def _lint(src: Path, config: Path) -> subprocess.CompletedProcess:
    if not LINT.is_file():
        pytest.skip("import-linter is not installed (a test dependency)")
    env = dict(os.environ, PYTHONPATH=str(src))
    return subprocess.run([str(LINT), str(config), "--no-cache"], capture_output=True, text=True, env=env,
                          cwd=str(src), timeout=300)


def test_layering_contracts_are_kept():
    r = _lint(ROOT / "src", ROOT / "pyproject.toml")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert "Contracts: 2 kept, 0 broken." in r.stdout


@pytest.mark.parametrize("module, line, contract", [
    ("ops/ref.py", "import llamajet.engine.runner", "layers run one way"),      # ops reaching up to the engine
    ("formats/stack.py", "from llamajet.graph import ir", "layers run one way"),
    ("tokenizer/core.py", "import llamajet.ops", "leaves import only"),         # the tokenizer loading the core
])
def test_a_backward_import_breaks_the_contract(tmp_path, module, line, contract):
    # A copy of the package under another name (the editable install would
    # shadow a copy named llamajet), with the same contracts, one violation added.
    name = "ljcopy"
    pkg = tmp_path / "src" / name
    shutil.copytree(ROOT / "src" / "llamajet", pkg, ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    for py in pkg.rglob("*.py"):
        py.write_text(py.read_text(encoding="utf-8").replace("llamajet.", f"{name}.")
                      .replace("from llamajet import", f"from {name} import"), encoding="utf-8")
    with open(pkg / module, "a", encoding="utf-8") as f:
        f.write(f"\n{line.replace('llamajet', name)}  # a violation\n")
    config = tmp_path / "pyproject.toml"
    text = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    config.write_text(text.replace("llamajet.", f"{name}.").replace('root_package = "llamajet"',
                                                                     f'root_package = "{name}"'), encoding="utf-8")
    clean = _lint(tmp_path / "src", config)
    assert "Analyzed" in clean.stdout and "1 broken" in clean.stdout, clean.stdout[-2000:]
    broken = [ln for ln in clean.stdout.splitlines() if ln.rstrip().endswith("BROKEN")]
    assert len(broken) == 1 and broken[0].startswith(contract), broken
