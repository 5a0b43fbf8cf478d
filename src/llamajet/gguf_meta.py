"""GGUF metadata, read once for everyone: typed access to a ``gguf.GGUFReader``'s
key-value fields with errors that name the key (and file). Shared by the
model config (hyper-parameters, config.py) and the tokenizer (vocabulary,
tokenizer/gguf_vocab.py); imports nothing of llamajet but its errors.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from llamajet.errors import ModelFormatError, UnsupportedModelError


def typed(value, key: str, kind):
    """``value`` as ``kind`` (int or float; anything else passes through), or a
    ModelFormatError naming ``key``. Accepts numpy scalars (GGUF metadata) and
    JSON numbers (HF configs)."""
    if kind not in (int, float):
        return value
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise ModelFormatError(f"{key} must be {'an integer' if kind is int else 'a number'}, got {value!r}")
    if kind is float:
        return float(value)
    if not math.isfinite(value) or value != int(value):
        raise ModelFormatError(f"{key} must be an integer, got {value!r}")
    return int(value)


def f32_to_decimal(x: float) -> float:
    """GGUF stores floats as float32 (1e-5 becomes 9.99999974e-06). The writer
    meant the shortest decimal that rounds to that float32, so recover it: an
    HF and a GGUF copy of one model then agree exactly."""
    return float(str(np.float32(x)))


class GGUFMeta:
    """The metadata of an open GGUF reader."""

    def __init__(self, reader: Any) -> None:
        self.fields = reader.fields
        self.name = str(getattr(getattr(reader, "data", None), "filename", None) or "<gguf>")

    def has(self, key: str) -> bool:
        return key in self.fields

    def raw(self, key: str, default: Any = None) -> Any:
        """The field's Python value (a scalar, str or list), or `default`."""
        field = self.fields.get(key)
        if field is None:
            return default
        try:
            if hasattr(field, "contents"):  # gguf >= 0.11
                return field.contents()
            return _field_value_fallback(field)
        except Exception as e:  # a malformed field: surface as a format error
            raise ModelFormatError(f"GGUF metadata {key!r} is unreadable ({e})") from e

    def get(self, key: str, kind=None, default=None):
        """The field as `kind` (str, int, float; None: as stored), or `default`.
        Floats stored as float32 come back as the decimal their writer meant."""
        value = self.raw(key)
        if value is None:
            return default
        if kind is None:
            return value
        if kind is str:
            if not isinstance(value, str):
                raise ModelFormatError(f"GGUF metadata {key!r} must be a string, got {value!r}")
            return value
        if isinstance(value, list):
            raise UnsupportedModelError(f"GGUF metadata {key!r} is a per-layer array {value!r}; not supported")
        value = typed(value, f"GGUF metadata {key!r}", kind)
        if kind is float and [t.name for t in self.fields[key].types] == ["FLOAT32"]:
            value = f32_to_decimal(value)
        return value

    def require(self, key: str, kind=None):
        value = self.get(key, kind)
        if value is None:
            raise ModelFormatError(f"GGUF metadata is missing required key {key!r}")
        return value

    def array_len(self, key: str) -> int | None:
        field = self.fields.get(key)
        return None if field is None else len(field.data)  # no need to decode the strings


def _field_value_fallback(field: Any) -> Any:
    # Older gguf packages lack ReaderField.contents(): decode parts by hand.
    import gguf

    types = field.types
    if not types:
        return None
    if types[0] == gguf.GGUFValueType.ARRAY:
        if types[-1] == gguf.GGUFValueType.STRING:
            return [bytes(field.parts[i]).decode("utf-8") for i in field.data]
        return [v for i in field.data for v in field.parts[i].tolist()]
    if types[0] == gguf.GGUFValueType.STRING:
        return bytes(field.parts[-1]).decode("utf-8")
    return field.parts[-1].tolist()[0]
