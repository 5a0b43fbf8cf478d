"""Streaming decode: ids in, finished text out, one token at a time."""

from __future__ import annotations

from typing import Any

from llamajet.errors import TokenizerError, tokenizer_panics


class StreamDecoder:
    """Incremental detokenizer: ids in, finished text out.

    Keeps a window of ids and emits ``decode(window) - decode(window prefix)``,
    so a SentencePiece leading "▁" turns into a space exactly as the full
    decode would. Text whose tail is an incomplete UTF-8 sequence (it decodes
    to U+FFFD, e.g. half an emoji in byte tokens) is held back until the next
    tokens complete it; ``flush`` hands over whatever is left.
    """

    def __init__(self, tokenizer: Any) -> None:  # a Tokenizer (core.py)
        backend_decode = tokenizer.backend.decode

        def decode(ids: list[int], skip_special_tokens: bool) -> str:
            with tokenizer_panics("streaming decode failed"):
                return backend_decode(ids, skip_special_tokens=skip_special_tokens)

        self._decode = decode
        self._vocab_size = tokenizer.vocab_size
        self._ids: list[int] = []  # the window: left context + ids not yet emitted
        self._read = 0  # ids before it have been emitted (they are the left context)

    def push(self, token_id: int) -> str:
        """Add one id; return the text it completes (maybe ``""``).

        An id past the vocabulary is a row the model has and the tokenizer
        does not (Qwen2.5: 151,936 embedding rows, 151,669 tokens): it has no
        text, as transformers decodes it, and generation goes on."""
        token_id = int(token_id)
        if token_id < 0:
            raise TokenizerError(f"token id {token_id} is negative")
        if token_id >= self._vocab_size:
            return ""
        self._ids.append(token_id)
        return self._advance(final=False)

    def flush(self) -> str:
        """The rest of the text, even an incomplete character (as U+FFFD)."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        done = self._decode(self._ids[:self._read], skip_special_tokens=True)
        text = self._decode(self._ids, skip_special_tokens=True)
        # Not yet: nothing new (special token), or the tail is an unfinished character.
        if len(text) <= len(done) or (text.endswith("\ufffd") and not final):
            return ""
        # Keep the ids just emitted as left context: the next decode needs to see
        # them to know whether a leading "▁" is a space or a stripped start.
        # Older ids are dropped, so a long generation costs O(1) per token.
        del self._ids[:self._read]
        self._read = len(self._ids)
        return text[len(done):]
