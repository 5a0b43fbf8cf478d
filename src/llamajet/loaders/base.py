"""What every loader returns, and the check every loaded model passes."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np

from llamajet.config import ModelConfig
from llamajet.errors import ModelFormatError
from llamajet.formats.weight import Weight
from llamajet.model.spec import ArchSpec


@dataclass
class LoadedModel:
    config: ModelConfig
    weights: dict[str, Weight]  # canonical name -> tensor
    source: str  # the path loaded
    gguf_reader: object | None  # the open gguf.GGUFReader (the tokenizer reuses it); None otherwise
    keepalive: list = field(default_factory=list)  # mmaps/readers the views in `weights` point into

    @property
    def lm_head(self) -> Weight:
        """The [vocab, hidden] output projection: ``output``, or ``token_embd`` when tied."""
        output = self.weights.get("output")
        return output if output is not None else self.weights["token_embd"]


def check_weights(config: ModelConfig, spec: ArchSpec, weights: dict[str, Weight], source: str,
                  which: str) -> ModelConfig:
    """Every tensor the spec implies for ``config`` is present with its shape,
    none beyond. ``which`` ("hf", "gguf" or "canonical") names tensors in errors
    as the file does.

    Returns ``config``, with ``tie_word_embeddings=False`` if a separate
    ``output`` is present: it is used even when the config says tied, as
    transformers 5 does when the two differ."""
    def native(name: str) -> str:
        return name if which == "canonical" else spec.native_name(name, which)

    if "output" in weights and config.tie_word_embeddings:
        config = dataclasses.replace(config, tie_word_embeddings=False)
    if "output" not in weights and not config.tie_word_embeddings:
        raise ModelFormatError(f"{source}: missing tensor {native('output')!r} "
                               "(the config says the embeddings are not tied)")
    expected = set()
    for name, rule in spec.expected(config):
        expected.add(name)
        if name not in weights:
            raise ModelFormatError(f"{source}: missing tensor {native(name)!r}")
        shape = rule.shape(config)
        if weights[name].shape != shape:
            raise ModelFormatError(f"{source}: tensor {native(name)!r} has shape {weights[name].shape}, "
                                   f"expected {shape} from the config")
        if weights[name].kind != rule.kind:
            raise ModelFormatError(f"{source}: tensor {native(name)!r} is a {weights[name].kind.value}, "
                                   f"expected a {rule.kind.value}")
    extra = sorted(set(weights) - expected)
    if extra:
        raise ModelFormatError(f"{source}: tensors {[native(n) for n in extra][:5]} do not fit the config "
                               f"({config.num_layers} layers, attention_bias={config.attention_bias}, "
                               f"mlp_bias={config.mlp_bias})")
    return config


def page_releaser(model: LoadedModel):
    """A function that drops one source weight's file pages from the resident
    set once the weight was converted (repacked, quantized: formats/pending.py,
    formats/convert.py), so a load never holds the whole file beside what it
    made of it. Works for any weight that is a view of a read-only map (GGUF,
    safetensors); others are left alone. The maps are read-only: a page read
    again later simply faults back in."""
    import mmap

    bases: dict[int, tuple[object, int, int]] = {}

    def mapping(a):
        b = a
        while b is not None:
            mm = getattr(b, "_mmap", None) if not isinstance(b, mmap.mmap) else b
            if isinstance(mm, mmap.mmap):
                return mm
            b = b.obj if isinstance(b, memoryview) else getattr(b, "base", None)
        return None

    def release(w) -> None:
        a = w if isinstance(w, np.ndarray) else getattr(w, "data", None)
        if not isinstance(a, np.ndarray):
            return
        mm = mapping(a)
        if mm is None or not hasattr(mm, "madvise"):
            return
        if id(mm) not in bases:
            bases[id(mm)] = (mm, np.frombuffer(mm, np.uint8).ctypes.data, len(mm))
        _, base, size = bases[id(mm)]
        start = a.ctypes.data - base
        if not 0 <= start < size:
            return
        page = mmap.PAGESIZE
        lo, hi = start // page * page, min(size, -(-(start + a.nbytes) // page) * page)
        try:
            mm.madvise(mmap.MADV_DONTNEED, lo, hi - lo)
        except (OSError, ValueError):  # nothing lost: the pages stay resident
            pass

    return release
