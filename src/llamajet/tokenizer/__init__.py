"""Text <-> token ids: Hugging Face ``tokenizers`` plus the facts a model needs.

A checkpoint brings its vocabulary either as a ``tokenizer.json`` (HF folder)
or embedded in GGUF metadata (``tokenizer.ggml.*``). Both end up as one
``tokenizers.Tokenizer``, so encoding is always done by the same Rust code the
references use.

    core.py        Tokenizer: ids <-> text, BOS/EOS, stop ids, add_bos
    hf.py          loading tokenizer.json and its configs
    gguf_vocab.py  rebuilding a GGUF's vocabulary
    chat.py        chat templates (sandboxed jinja2, as transformers renders them)
    stream.py      StreamDecoder: incremental detokenization

This package imports nothing of llamajet but its errors and the GGUF
metadata reader.
"""

from __future__ import annotations

from pathlib import Path

from llamajet.errors import TokenizerError
from llamajet.tokenizer.core import Tokenizer
from llamajet.tokenizer.gguf_vocab import SUPPORTED_GGUF_PRE, from_gguf_path, is_gguf, tokenizer_from_gguf
from llamajet.tokenizer.hf import from_hf_files
from llamajet.tokenizer.stream import StreamDecoder

__all__ = ["SUPPORTED_GGUF_PRE", "StreamDecoder", "Tokenizer", "load_tokenizer", "tokenizer_from_gguf"]


def load_tokenizer(path: str | Path) -> Tokenizer:
    """Load a tokenizer from a model folder, a ``tokenizer.json`` or a ``.gguf``.

    A folder needs ``tokenizer.json`` (or else exactly one ``.gguf``); the
    ``tokenizer_config.json``, ``generation_config.json``, ``config.json`` and
    ``chat_template.jinja`` beside it supply BOS/EOS, stop ids, ``add_bos``
    and the chat template.
    """
    p = Path(path)
    if not p.exists():
        raise TokenizerError(f"tokenizer path {str(p)!r} does not exist")
    if p.is_dir():
        tj = p / "tokenizer.json"
        if tj.is_file():
            return from_hf_files(tj)
        ggufs = sorted(p.glob("*.gguf"))
        if len(ggufs) == 1:
            return from_gguf_path(ggufs[0])
        hint = " (tokenizer.model alone, a SentencePiece file, is not supported)" \
            if (p / "tokenizer.model").exists() else ""
        raise TokenizerError(
            f"no tokenizer in folder {str(p)!r}: expected tokenizer.json or a single .gguf file, "
            f"found {len(ggufs)} .gguf files{hint}")
    if p.suffix.lower() == ".gguf" or is_gguf(p):
        return from_gguf_path(p)
    return from_hf_files(p)
