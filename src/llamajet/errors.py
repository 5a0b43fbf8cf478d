"""The exceptions llamajet raises on bad input.

Every user-facing failure (a missing file, a malformed checkpoint, an
unsupported architecture, a prompt that cannot be served) is one of these, so
callers can catch ``LlamajetError`` and nothing else. Messages name the file,
field or value at fault.
"""

from contextlib import contextmanager


class LlamajetError(Exception):
    """Base class of every error llamajet raises on purpose."""


class ModelFormatError(LlamajetError, ValueError):
    """A checkpoint file is missing, truncated, malformed or inconsistent."""


class UnsupportedModelError(LlamajetError, ValueError):
    """The checkpoint is well formed but asks for something llamajet cannot honour."""


class TokenizerError(LlamajetError, ValueError):
    """No usable tokenizer could be built from the given path."""


class RequestError(LlamajetError, ValueError):
    """A generation request that cannot be served (empty prompt, too long, bad params)."""


class ConcurrencyError(LlamajetError, RuntimeError):
    """An object used across threads or event loops in a way its contract
    refuses (an AsyncEngine from a second event loop: docs/limits.md)."""


@contextmanager
def tokenizer_panics(what: str):
    """Turn a panic inside HF tokenizers' Rust code into a TokenizerError. pyo3's
    PanicException derives from BaseException, so `except Exception` misses it;
    a tokenizer.json can be made to panic, e.g. a post-processor template naming
    a special token its own map lacks (found by fuzzing)."""
    try:
        yield
    except BaseException as e:
        if type(e).__name__ == "PanicException":
            raise TokenizerError(f"{what}: the tokenizers library panicked ({e})") from None
        raise
