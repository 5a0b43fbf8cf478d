"""Tokenizer: a vocabulary (an HF ``tokenizers.Tokenizer``) with the model
facts generation needs."""

from __future__ import annotations

from functools import lru_cache
from typing import Any, Iterable

import tokenizers

from llamajet.errors import TokenizerError, tokenizer_panics
from llamajet.tokenizer.chat import render
from llamajet.tokenizer.stream import StreamDecoder

# Tokens that end a turn or a text in the vocabularies we know. They count as
# stop ids only when the vocabulary marks them special: a byte-level vocab may
# hold "</s>" as ordinary text (an HTML tag), and stopping there would be wrong.
_STOP_TOKEN_NAMES = (
    "<|eot_id|>", "<|end_of_text|>", "<|eom_id|>",  # Llama-3
    "<|im_end|>", "<|endoftext|>",  # ChatML / GPT-2 family (SmolLM2, Qwen)
    "</s>",  # SentencePiece Llama-1/2, TinyLlama, stories
    "<end_of_turn>", "<|end|>",  # Gemma, Phi-3
)


class Tokenizer:
    """A vocabulary with the model facts generation needs.

    Wraps a ``tokenizers.Tokenizer`` (``backend``). Encoding never runs the
    backend's post-processor: BOS is added here, once, from ``add_bos``, so an
    HF folder and a GGUF of the same model behave alike.

    Attributes:
        vocab_size: number of token ids, added tokens included.
        bos_id, eos_id: beginning/end of sequence ids (``None`` if unknown);
            ``eos_id`` is the primary EOS.
        stop_ids: every id that ends generation (EOS, end-of-turn tokens, the
            EOS ids of ``generation_config.json`` / GGUF eot/eom keys).
        add_bos: whether ``encode`` prepends BOS by default.
        chat_template: the jinja2 chat template, or ``None``.
    """

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        bos_id: int | None,
        eos_id: int | None,
        add_bos: bool,
        chat_template: str | None = None,
        extra_stop_ids: Iterable[int] = (),
        vocab_size: int | None = None,
        source: str = "",
    ) -> None:
        self.backend = backend
        if vocab_size is None:
            # one past the largest id, not the number of tokens: a tokenizer.json
            # may leave holes (ids 0..511 and an added token at 886), and
            # encode() returns ids up to the largest (found by fuzzing)
            ids = backend.get_vocab(with_added_tokens=True).values()
            vocab_size = max(ids, default=-1) + 1
        self.vocab_size = int(vocab_size)
        self.bos_id = bos_id
        self.eos_id = eos_id
        self.add_bos = bool(add_bos and bos_id is not None)
        self.chat_template = chat_template
        self.source = source
        added = backend.get_added_tokens_decoder()
        special = {i for i, tok in added.items() if tok.special}
        self.special_ids = frozenset(special)
        self.added_ids = frozenset(added)  # added tokens, special or not
        stops = {i for i in extra_stop_ids if i is not None and 0 <= i < self.vocab_size}
        if eos_id is not None:
            stops.add(eos_id)
        for name in _STOP_TOKEN_NAMES:
            i = backend.token_to_id(name)
            if i is not None and i in special:
                stops.add(i)
        self.stop_ids = frozenset(stops)
        self._byte_level: bool | None = None  # decoder kind, for token_bytes (looked up once)

    def __repr__(self) -> str:
        return (f"Tokenizer(source={self.source!r}, vocab_size={self.vocab_size}, bos_id={self.bos_id}, "
                f"eos_id={self.eos_id}, stop_ids={sorted(self.stop_ids)}, add_bos={self.add_bos})")

    # -- ids <-> text ------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; special tokens written in it are parsed as such.

        BOS is prepended when ``add_special_tokens`` and ``add_bos`` are set,
        unless the text already starts with BOS (a template that writes it).
        """
        if not isinstance(text, str):
            raise TypeError(f"encode() takes a str, got {type(text).__name__}")
        with tokenizer_panics(f"tokenizer from {self.source or 'memory'} failed to encode this text"):
            ids = self.backend.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos and (not ids or ids[0] != self.bos_id):
            ids.insert(0, self.bos_id)
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """The text of ``ids``; special tokens are left out unless asked for."""
        ids = [int(i) for i in ids]
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise TokenizerError(f"token ids out of range [0, {self.vocab_size}): {bad[:5]}")
        with tokenizer_panics(f"tokenizer from {self.source or 'memory'} failed to decode {len(ids)} ids"):
            return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_to_id(self, s: str) -> int | None:
        return self.backend.token_to_id(s)

    def id_to_token(self, i: int) -> str | None:
        return self.backend.id_to_token(int(i)) if 0 <= int(i) < self.vocab_size else None

    def token_bytes(self, i: int) -> bytes:
        """The bytes token `i` stands for on its own (OpenAI logprobs'
        `bytes`): byte-level BPE pieces mapped back through GPT-2's byte
        alphabet, SentencePiece "<0xNN>" byte pieces as that byte and its
        "▁" as a space; a special token as its text."""
        piece = self.id_to_token(i)
        if piece is None:
            return b""
        if i in self.special_ids:
            return piece.encode()
        if self._byte_level is None:
            self._byte_level = type(self.backend.decoder).__name__ == "ByteLevel"
        if self._byte_level:
            table = _byte_decoder()
            if all(c in table for c in piece):
                return bytes(table[c] for c in piece)
            return piece.encode()
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            try:
                return bytes([int(piece[3:5], 16)])
            except ValueError:
                pass
        return piece.replace("\u2581", " ").encode()

    def stream_decoder(self) -> StreamDecoder:
        """A fresh incremental decoder for one generated sequence."""
        return StreamDecoder(self)

    # -- chat ----------------------------------------------------------------

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            **kwargs: Any) -> str:
        """Render ``messages`` with the model's chat template, as transformers does.

        Extra keyword arguments (``tools``, ``date_string``, ...) become template
        variables. ``bos_token``/``eos_token`` are set from this vocabulary.
        """
        if not self.chat_template:
            raise TokenizerError(
                f"tokenizer from {self.source or 'memory'} has no chat template; "
                "format the prompt yourself or use a model that ships one")
        variables = {
            "bos_token": self._token_text(self.bos_id),
            "eos_token": self._token_text(self.eos_id),
            "add_generation_prompt": add_generation_prompt,
            "tools": None, "documents": None,
        }
        variables.update(kwargs)
        return render(self.chat_template, messages, **variables)

    def _token_text(self, i: int | None) -> str:
        return (self.backend.id_to_token(i) or "") if i is not None else ""


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's printable alphabet for bytes (byte-level BPE), inverted."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars
