"""Tokenizers rebuilt from a GGUF's embedded vocabulary (``tokenizer.ggml.*``),
in code, the way llama.cpp and transformers read them: byte-level BPE
(``gpt2`` models, with the pre-tokenizer ``tokenizer.ggml.pre`` names) and
SentencePiece BPE with byte fallback (``llama`` models). The result is one
``tokenizers.Tokenizer``, so encoding is done by the same Rust code the
references use."""

from __future__ import annotations

import warnings
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers

from llamajet.errors import ModelFormatError, TokenizerError
from llamajet.gguf_meta import GGUFMeta
from llamajet.tokenizer.core import Tokenizer

if TYPE_CHECKING:  # gguf is only needed when a GGUF is read
    import gguf

# llama.cpp's token types (tokenizer.ggml.token_type)
_TT_NORMAL, _TT_UNKNOWN, _TT_CONTROL, _TT_USER_DEFINED, _TT_UNUSED, _TT_BYTE = 1, 2, 3, 4, 5, 6

# Pre-tokenizer split patterns of byte-level vocabularies, by tokenizer.ggml.pre.
# Llama-3's (tiktoken cl100k-style) regex, as in Meta's tokenizer.json:
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PRE_LLAMA3 = frozenset({"llama-bpe", "llama3", "llama-v3"})
# smollm: every digit on its own, then GPT-2's regex (llama.cpp's regex list for
# "smollm"; SmolLM2's own tokenizer.json has Digits(individual) + ByteLevel).
_PRE_SMOLLM = frozenset({"smollm"})
_PRE_GPT2 = frozenset({"gpt2"})
# Qwen2 / Qwen2.5: Llama-3's regex with one digit per pre-token (\p{N}, not
# \p{N}{1,3}), after NFC normalization, as Qwen's own tokenizer.json does
# (llama.cpp's "qwen2" regex is the same; it does not normalize).
_QWEN2_SPLIT = _LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")
_PRE_QWEN2 = frozenset({"qwen2"})
SUPPORTED_GGUF_PRE = tuple(sorted(_PRE_LLAMA3 | _PRE_SMOLLM | _PRE_GPT2 | _PRE_QWEN2))

_SPM_SPACE = "\u2581"  # SentencePiece's visible space, "▁"

# Bounds on an embedded vocabulary (docs/limits.md). The reader already caps
# every metadata array (gguf_meta.MAX_ARRAY_LEN); the largest real
# vocabularies have 262k tokens.
MAX_VOCAB = 1 << 22
# Deriving SentencePiece merges tries every split of every piece, slicing
# each: sum(len(piece)**2) characters. Real vocabularies (pieces of at most
# 16 characters but for a few added tokens) cost ~1e7; a few long pieces
# would cost ~1e14, a hang.
MAX_MERGE_WORK = 1 << 28


def tokenizer_from_gguf(reader: "gguf.GGUFReader") -> Tokenizer:
    """Build the tokenizer embedded in an open GGUF (``tokenizer.ggml.*`` keys)."""
    meta = GGUFMeta(reader)
    kind = meta.get("tokenizer.ggml.model")
    if kind is None:
        raise TokenizerError(f"{meta.name}: GGUF has no embedded tokenizer (no tokenizer.ggml.model key)")
    tokens = meta.require("tokenizer.ggml.tokens")
    n = len(tokens)
    if n > MAX_VOCAB:  # before any of the tokenizer is built
        raise ModelFormatError(f"{meta.name}: tokenizer.ggml.tokens holds {n} tokens (limit {MAX_VOCAB})")
    types = meta.get("tokenizer.ggml.token_type")
    if types is None:
        types = [_TT_NORMAL] * n
    if len(types) != n:
        raise ModelFormatError(
            f"{meta.name}: tokenizer.ggml.token_type has {len(types)} entries for {n} tokens")

    if kind == "gpt2":
        pre = meta.get("tokenizer.ggml.pre")
        backend = _build_byte_level_bpe(meta, tokens, types, pre)
        # llama.cpp's default: Llama-3 vocabularies want BOS, other byte-level ones do not.
        default_add_bos = pre in _PRE_LLAMA3
    elif kind == "llama":
        backend = _build_sentencepiece_bpe(meta, tokens, types)
        default_add_bos = True  # SentencePiece Llama models are trained with BOS
    else:
        raise TokenizerError(
            f"{meta.name}: unsupported tokenizer.ggml.model {kind!r} (supported: 'gpt2', 'llama')")

    def token_id(key: str) -> int | None:
        i = meta.get(key)
        if i is not None and not 0 <= int(i) < n:
            raise ModelFormatError(f"{meta.name}: {key} = {i} is outside the vocabulary of {n} tokens")
        return None if i is None else int(i)

    bos_id = token_id("tokenizer.ggml.bos_token_id")
    eos_id = token_id("tokenizer.ggml.eos_token_id")
    extra = [token_id(k) for k in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")]
    return Tokenizer(
        backend, bos_id=bos_id, eos_id=eos_id,
        add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", default=default_add_bos)),
        chat_template=meta.get("tokenizer.chat_template"),
        extra_stop_ids=[i for i in extra if i is not None],
        vocab_size=n, source=meta.name,
    )


def is_gguf(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError as e:
        raise TokenizerError(f"cannot read {path}: {e}") from e


def from_gguf_path(path: Path) -> Tokenizer:
    from llamajet.gguf_meta import Reader

    if not is_gguf(path):
        raise ModelFormatError(f"{path}: not a GGUF file (does not start with the GGUF magic)")
    try:
        reader = Reader(path)
    except Exception as e:  # numpy/struct/value errors from a short or damaged file
        raise ModelFormatError(
            f"{path}: truncated or corrupt GGUF, its header/metadata cannot be parsed "
            f"({type(e).__name__}: {e})") from e
    return tokenizer_from_gguf(reader)


@lru_cache(maxsize=1)
def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character table (the byte-level BPE alphabet)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:  # unprintable bytes move to code points 256, 257, ...
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _added_tokens(tokens: list[str], types: list[int]) -> tuple[list[AddedToken], list[AddedToken]]:
    """(special, plain) added tokens: both are matched whole in the input text.

    Control and unknown tokens are special (skipped when decoding); user-defined
    ones (e.g. ``<think>``) are matched whole but decoded like text, as
    llama.cpp and transformers do.
    """
    special, plain = [], []
    for tok, tt in zip(tokens, types):
        if tt in (_TT_CONTROL, _TT_UNKNOWN):
            special.append(AddedToken(tok, special=True, normalized=False))
        elif tt == _TT_USER_DEFINED:
            plain.append(AddedToken(tok, special=False, normalized=False))
    return special, plain


def _finish(backend: tokenizers.Tokenizer, tokens: list[str], types: list[int], name: str) -> None:
    special, plain = _added_tokens(tokens, types)
    if special:
        backend.add_special_tokens(special)
    if plain:
        backend.add_tokens(plain)
    # Added tokens are already in the model vocab, so no id may have been appended.
    if backend.get_vocab_size(with_added_tokens=True) > len(tokens):
        raise ModelFormatError(
            f"{name}: added/control tokens are not all in the vocabulary (duplicate token texts?)")


def _vocab_dict(tokens: list[str], keys: Iterable[str], name: str) -> dict[str, int]:
    vocab: dict[str, int] = {}
    for i, key in enumerate(keys):
        vocab.setdefault(key, i)  # a duplicate keeps its first id, as llama.cpp's lookup does
    if len(vocab) != len(tokens):
        warnings.warn(f"{name}: {len(tokens) - len(vocab)} duplicate token texts; later copies are unreachable",
                      stacklevel=3)
    return vocab


def _parse_merges(meta: GGUFMeta, merges: list[str] | None) -> list[tuple[str, str]]:
    if merges is None:
        return []
    pairs = [tuple(m.split(" ")) for m in merges]
    # every merge is 'left right' (the lengths' set made in C; a per-pair check in Python
    # was 0.04 s of Llama-3's 280,147 merges), then which one is not
    if pairs and set(map(len, pairs)) != {2}:
        k = next(k for k, pair in enumerate(pairs) if len(pair) != 2)
        raise ModelFormatError(f"{meta.name}: tokenizer.ggml.merges[{k}] = {merges[k]!r} is not 'left right'")
    return pairs  # type: ignore[return-value]


def _bpe(meta: GGUFMeta, **kwargs: Any) -> models.BPE:
    try:
        return models.BPE(**kwargs)
    except Exception as e:  # e.g. a merge naming a token that is not in the vocabulary
        raise ModelFormatError(f"{meta.name}: inconsistent BPE vocabulary/merges ({e})") from e


def _build_byte_level_bpe(meta: GGUFMeta, tokens: list[str], types: list[int],
                          pre: str | None) -> tokenizers.Tokenizer:
    """GPT-2-style byte-level BPE (tokenizer.ggml.model == "gpt2")."""
    if pre is None:
        # Files written before llama.cpp stored the pre-tokenizer: GPT-2's regex is
        # what such vocabularies were made with; llama.cpp falls back the same way.
        warnings.warn(f"{meta.name}: no tokenizer.ggml.pre; using the GPT-2 pre-tokenizer", stacklevel=3)
        pre = "gpt2"
    if pre in _PRE_LLAMA3:
        pre_tok = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    elif pre in _PRE_SMOLLM:
        # Digits(individual) splits at every char::is_numeric, i.e. \p{N}.
        pre_tok = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ])
    elif pre in _PRE_QWEN2:
        pre_tok = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_QWEN2_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    elif pre in _PRE_GPT2:
        pre_tok = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        # A wrong split regex gives plausible but different ids, silently hurting
        # the model: refuse rather than guess.
        raise TokenizerError(
            f"{meta.name}: unsupported byte-level pre-tokenizer tokenizer.ggml.pre = {pre!r} "
            f"(supported: {', '.join(SUPPORTED_GGUF_PRE)})")

    alphabet = set(_byte_alphabet().values())
    to_alpha = _byte_alphabet()

    def key(tok: str, tt: int) -> str:
        # Added/control tokens keep their raw text (they are matched in the input
        # as is); a normal token stored as raw text is respelled in the byte
        # alphabet so BPE can reach it (as transformers' GGUF conversion does).
        if tt in (_TT_CONTROL, _TT_USER_DEFINED, _TT_UNKNOWN) or set(tok) <= alphabet:
            return tok
        return "".join(to_alpha[b] for b in tok.encode("utf-8"))

    if set("".join(tokens)) <= alphabet:  # every token already in the byte alphabet (one pass in C)
        vocab = _vocab_dict(tokens, tokens, meta.name)
    else:
        vocab = _vocab_dict(tokens, (key(t, tt) for t, tt in zip(tokens, types)), meta.name)
    merges = _parse_merges(meta, meta.get("tokenizer.ggml.merges"))
    if not merges:
        raise ModelFormatError(f"{meta.name}: byte-level BPE vocabulary without tokenizer.ggml.merges")
    # Llama-3 emits a pre-token whole when it is in the vocabulary (Meta's
    # tokenizer.json has "ignore_merges": true; llama.cpp does the same).
    model = _bpe(meta, vocab=vocab, merges=merges, ignore_merges=pre in _PRE_LLAMA3,
                 fuse_unk=False, byte_fallback=False)
    backend = tokenizers.Tokenizer(model)
    if pre in _PRE_QWEN2:
        backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tok
    backend.decoder = decoders.ByteLevel()
    _finish(backend, tokens, types, meta.name)
    return backend


def _sentencepiece_merges(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """BPE merges implied by a SentencePiece vocabulary and its scores.

    SentencePiece BPE merges the adjacent pair whose result has the best score.
    As in transformers' converter: every split of a piece into two pieces of
    the vocabulary is a merge, ranked by the piece's score (best first), ties
    broken by longer left part, then longer right part, then by the ids.
    """
    vocab: dict[str, int] = {}
    for i, tok in enumerate(tokens):
        vocab.setdefault(tok, i)
    score_of: dict[str, float] = {}
    for tok, s in zip(tokens, scores):
        score_of[tok] = s  # dict semantics of the reference: the last duplicate's score
    merges: list[tuple[str, str, float]] = []
    for piece, score in score_of.items():
        local = [(piece[:k], piece[k:], score) for k in range(1, len(piece))
                 if piece[:k] in vocab and piece[k:] in vocab]
        local.sort(key=lambda m: (vocab[m[0]], vocab[m[1]]))
        merges.extend(local)
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)  # stable
    return [(left, right) for left, right, _ in merges]


def _build_sentencepiece_bpe(meta: GGUFMeta, tokens: list[str], types: list[int]) -> tokenizers.Tokenizer:
    """SentencePiece BPE with byte fallback (tokenizer.ggml.model == "llama")."""
    n = len(tokens)
    scores = meta.get("tokenizer.ggml.scores")
    if scores is None:
        scores = [0.0] * n  # no scores: merges then follow token order only
    if len(scores) != n:
        raise ModelFormatError(f"{meta.name}: tokenizer.ggml.scores has {len(scores)} entries for {n} tokens")
    merges = _parse_merges(meta, meta.get("tokenizer.ggml.merges"))
    if not merges:
        work = sum(len(t) ** 2 for t in tokens)
        if work > MAX_MERGE_WORK:
            raise ModelFormatError(
                f"{meta.name}: deriving merges for this SentencePiece vocabulary would slice {work} "
                f"characters (limit {MAX_MERGE_WORK}; longest token {max(map(len, tokens))} characters)")
        merges = _sentencepiece_merges(tokens, scores)
    vocab = _vocab_dict(tokens, tokens, meta.name)
    byte_fallback = any(tt == _TT_BYTE for tt in types) or "<0x41>" in vocab
    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[unk_id] if isinstance(unk_id, int) and 0 <= unk_id < n else None
    model = _bpe(meta, vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True, byte_fallback=byte_fallback)
    # llama.cpp prepends a space to the text unless add_space_prefix is false.
    prefix_space = bool(meta.get("tokenizer.ggml.add_space_prefix", default=True))
    backend = tokenizers.Tokenizer(model)
    backend.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement=_SPM_SPACE, prepend_scheme="first" if prefix_space else "never", split=False)
    steps = [decoders.Replace(_SPM_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix_space:  # drop the space the encoder added in front
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    backend.decoder = decoders.Sequence(steps)
    _finish(backend, tokens, types, meta.name)
    return backend
