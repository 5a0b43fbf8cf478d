"""Run the tests or a fuzz target against another build of the extension.

``LLAMAJET_CORE_SO=/path/_core....so`` (set by tools/sanitize.sh and
tools/fuzz.py) loads that file as ``llamajet._core`` before the package imports
it, so a sanitizer build runs the same Python code as the installed one without
reinstalling anything. Imported first by tests/conftest.py and the fuzz targets.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys


def use_core_from_env() -> str | None:
    path = os.environ.get("LLAMAJET_CORE_SO")
    if not path:
        return None
    if "llamajet._core" in sys.modules:
        loaded = sys.modules["llamajet._core"].__file__
        if os.path.realpath(loaded) != os.path.realpath(path):
            raise RuntimeError(f"llamajet._core already loaded from {loaded}, not {path}")
        return path
    if not os.path.isfile(path):
        raise RuntimeError(f"LLAMAJET_CORE_SO={path}: no such file")
    loader = importlib.machinery.ExtensionFileLoader("llamajet._core", path)
    spec = importlib.util.spec_from_file_location("llamajet._core", path, loader=loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    sys.modules["llamajet._core"] = module
    import llamajet

    llamajet._core = module
    return path
