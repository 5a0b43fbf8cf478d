"""Model architectures: one graph builder and tensor spec per architecture,
registered by name (registry.py)."""

from llamajet.model import llama, qwen2  # noqa: F401  (each registers itself)
