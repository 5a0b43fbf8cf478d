"""Structured output: token masks from llguidance, as engine Constraints.

One `LLTokenizer` per model (built once, lazily: about a second for a
128k vocabulary), one `LLMatcher` per sequence. Before each draw the engine
asks the sequence's constraint for its allowed tokens; llguidance computes
the bitmask (its slicer makes that well under a millisecond on JSON
grammars), numpy unpacks it into the bool mask the sampler applies. The
model's stop tokens are llguidance's EOS: they are allowed exactly when the
grammar is complete.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from llamajet.errors import RequestError


class GrammarConstraint:
    """An engine Constraint (engine/sampling.py) over one LLMatcher."""

    def __init__(self, matcher) -> None:
        self.m = matcher
        self._words = None

    def allowed(self, vocab_size: int) -> np.ndarray:
        from llguidance.numpy import fill_next_token_bitmask

        words = (vocab_size + 31) // 32
        if self._words is None or self._words.shape[1] != words:
            self._words = np.empty((1, words), dtype=np.int32)
        fill_next_token_bitmask(self.m, self._words)
        bits = np.unpackbits(self._words.view(np.uint8), bitorder="little")[:vocab_size]
        mask = bits.astype(bool)
        if not mask.any():  # the grammar failed (an error state): let the stop tokens end it
            raise RequestError(f"structured output failed: {self.m.get_error() or 'no token is allowed'}")
        return mask

    def consume(self, token_id: int) -> None:
        self.m.consume_token(int(token_id))

    def is_done(self) -> bool:
        return self.m.is_stopped()

    def copy(self) -> "GrammarConstraint":
        return GrammarConstraint(self.m.deep_copy())


class Grammars:
    """Builds constraints for one model's vocabulary."""

    def __init__(self, tokenizer, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = max(int(vocab_size), tokenizer.vocab_size)
        self._ll = None
        self._lock = threading.Lock()

    def ll_tokenizer(self):
        with self._lock:
            if self._ll is None:
                try:
                    import llguidance
                except ImportError as e:  # pragma: no cover - the server extra installs it
                    raise RequestError("structured output needs llguidance: pip install 'llamajet[server]'") from e
                self._ll = llguidance.LLTokenizer(self.tokenizer.backend.to_str(), n_vocab=self.vocab_size,
                                                  eos_token=sorted(self.tokenizer.stop_ids))
            return self._ll

    @staticmethod
    def from_json_schema(schema: dict[str, Any] | None) -> str:
        """A grammar for JSON that follows `schema` (None: any JSON object)."""
        from llguidance import LLMatcher

        try:
            return LLMatcher.grammar_from_json_schema(schema if schema is not None else {"type": "object"},
                                                      defaults={"whitespace_flexible": False})
        except (ValueError, TypeError) as e:
            raise RequestError(f"json_schema: {e}") from e

    @staticmethod
    def from_lark(lark: str) -> str:
        from llguidance import LLMatcher

        return LLMatcher.grammar_from_lark(lark)

    def constraint(self, grammar: str, param: str = "response_format") -> GrammarConstraint:
        """A fresh constraint; a grammar llguidance refuses is a RequestError
        naming `param`."""
        from llguidance import LLMatcher

        m = LLMatcher(self.ll_tokenizer(), grammar, log_level=0)
        if m.is_error():
            raise RequestError(f"{param}: {m.get_error()}")
        return GrammarConstraint(m)

