"""llamajet: a LLaMA-3 inference engine for CPUs.

Public API only. Names are resolved lazily so that ``import llamajet.config``
or ``import llamajet.tokenizer`` does not load the C++ core.
"""

from importlib import import_module as _import_module

__version__ = "0.1.0"

# public name -> module that defines it
_EXPORTS = {
    "LLM": "llamajet.api",
    "RequestOutput": "llamajet.api",
    "CompletionOutput": "llamajet.api",
    "Logprob": "llamajet.api",
    "SamplingParams": "llamajet.engine.sampling",
    "ModelConfig": "llamajet.config",
    "RuntimeConfig": "llamajet.config",
    "load_tokenizer": "llamajet.tokenizer",
    "Tokenizer": "llamajet.tokenizer",
    "LlamajetError": "llamajet.errors",
    "ModelFormatError": "llamajet.errors",
    "UnsupportedModelError": "llamajet.errors",
    "TokenizerError": "llamajet.errors",
    "RequestError": "llamajet.errors",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(_import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'llamajet' has no attribute {name!r}")
