"""Per-choice output: a request's StreamEvents turned into text, token ids,
logprobs and finish reasons, once, for every consumer.

A server route streams deltas and answers non-streamed requests from the
same builder (it feeds each event in and reads either the event's delta or
the choice's totals at the end), and the Python API builds its results the
same way, so a field computed for one cannot drift from the other.

Invariants: a choice's `text` is the concatenation of its events' texts in
order; `tokens` holds one entry per generated token (a stop token ends a
choice and is not part of it: its event has token_id None); `finish_reason`
is set once, by the event that ends the choice.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from llamajet.engine.sequence import StreamEvent


def token_piece(tokenizer, token_id: int) -> tuple[str, list[int]]:
    """One token's text as it reads in a stream (invalid UTF-8 replaced: a byte-level token may hold
    part of a character) and its bytes. From the token's bytes, not decode([id]): a SentencePiece
    decode drops the leading space of a text's first piece, which a logprob's token must keep. The
    server's logprobs and the Python API's Logprob.decoded_token both read it."""
    b = tokenizer.token_bytes(token_id)
    return b.decode("utf-8", errors="replace"), list(b)


@dataclass(frozen=True)
class TokenOut:
    """One generated token: its id, logprob and top alternatives (when the
    request asked for logprobs), and where its text starts in the choice."""

    id: int
    logprob: float | None
    top: tuple[tuple[int, float], ...]
    offset: int  # characters of the choice's text before this token's text


@dataclass
class ChoiceOutput:
    index: int
    parts: list[str] = field(default_factory=list)
    tokens: list[TokenOut] = field(default_factory=list)
    finish_reason: str | None = None
    _chars: int = 0

    @property
    def text(self) -> str:
        return "".join(self.parts)

    @property
    def token_ids(self) -> list[int]:
        return [t.id for t in self.tokens]

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def add(self, ev: StreamEvent) -> TokenOut | None:
        """Takes the choice's next event; returns its token's entry (None for
        the final event of a stop token, which carries text only)."""
        tok = None
        if ev.token_id is not None:
            tok = TokenOut(ev.token_id, ev.logprob, ev.top_logprobs, self._chars)
            self.tokens.append(tok)
        if ev.text:
            self.parts.append(ev.text)
            self._chars += len(ev.text)
        if ev.finish_reason is not None and self.finish_reason is None:
            self.finish_reason = ev.finish_reason
        return tok


class RequestOutputs:
    """Every choice of a request (`n_choices` = prompts x n, numbered as the
    caller numbers its events)."""

    def __init__(self, n_choices: int) -> None:
        self.choices = [ChoiceOutput(i) for i in range(n_choices)]

    def add(self, index: int, ev: StreamEvent) -> tuple[ChoiceOutput, TokenOut | None]:
        c = self.choices[index]
        return c, c.add(ev)

    @property
    def num_generated(self) -> int:
        return sum(len(c.tokens) for c in self.choices)
