"""EngineConfig: how much the engine serves at once and how it stores K/V.

Frozen; `LLM(...)` keyword arguments and CLI flags mirror these fields.
"""

from __future__ import annotations

from dataclasses import dataclass

from llamajet.errors import RequestError

KV_CACHE_DTYPES = ("f32", "f16", "bf16", "int8")
# Default pool: at least this many tokens (or one full context if longer).
DEFAULT_KV_CACHE_TOKENS = 8192


@dataclass(frozen=True)
class EngineConfig:
    max_model_len: int                   # context served: prompt + output
    max_num_seqs: int = 64               # sequences computed together in one step
    max_tokens_per_step: int = 256       # token budget of a step (prefill chunks + decode tokens)
    block_size: int = 16                 # token slots per KV block
    kv_cache_tokens: int | None = None   # pool size in tokens (None: max(max_model_len, 8192))
    kv_dtype: str = "f16"                # K/V storage: f32 | f16 | bf16 | int8 (per token-head scale)
    enable_prefix_caching: bool = True   # reuse the K/V of equal prompt prefixes across requests
    # Commit the whole pool's memory at start (written once). The block
    # manager hands out blocks least-recently-freed first (so cached prefixes
    # live longest), which walks the whole pool anyway; committing lazily only
    # moves that cost into steps as page faults (measured: 3.4 of 23 ms per
    # batch-16 decode step of SmolLM2-135M). False: commit page by page.
    kv_prefault: bool = True

    def __post_init__(self) -> None:
        def bad(field: str, why: str):
            raise RequestError(f"{field}={getattr(self, field)!r}: {why}")

        if self.max_model_len < 2:
            bad("max_model_len", "must be >= 2")
        if self.max_num_seqs < 1:
            bad("max_num_seqs", "must be >= 1")
        if self.max_tokens_per_step < 1:
            bad("max_tokens_per_step", "must be >= 1")
        if self.block_size < 1:
            bad("block_size", "must be >= 1")
        if self.kv_cache_tokens is not None and self.kv_cache_tokens < self.block_size:
            bad("kv_cache_tokens", f"must hold at least one block ({self.block_size} tokens)")
        if self.kv_dtype not in KV_CACHE_DTYPES:
            bad("kv_dtype", f"use one of {', '.join(KV_CACHE_DTYPES)}")

    @property
    def num_kv_blocks(self) -> int:
        tokens = self.kv_cache_tokens or max(self.max_model_len, DEFAULT_KV_CACHE_TOKENS)
        return -(-tokens // self.block_size)

    @property
    def step_tokens(self) -> int:
        """The step token budget, never above the context."""
        return min(self.max_tokens_per_step, self.max_model_len)
