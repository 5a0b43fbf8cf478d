"""Sequence: one request's tokens, KV blocks and state."""

from __future__ import annotations

from dataclasses import dataclass, field

from llamajet.engine.sampling import SamplingParams


@dataclass
class Sequence:
    prompt_ids: list[int]
    params: SamplingParams
    output_ids: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)  # KV blocks, in position order
    num_computed: int = 0      # tokens whose K/V are in the cache
    finish_reason: str | None = None  # "stop" | "length" once finished

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
