"""Text <-> token ids: Hugging Face ``tokenizers`` plus the facts a model needs.

A checkpoint brings its vocabulary either as a ``tokenizer.json`` (HF folder)
or embedded in GGUF metadata (``tokenizer.ggml.*``). Both end up as one
``tokenizers.Tokenizer``, so encoding is always done by the same Rust code the
references use; a GGUF vocabulary is rebuilt in code from its keys, the way
llama.cpp and transformers read them.

Around it, :class:`Tokenizer` keeps what generation needs and a tokenizer file
alone does not say plainly: BOS/EOS ids, every stop id, whether BOS is
prepended, and the chat template (rendered with a sandboxed jinja2 set up like
transformers'). :class:`StreamDecoder` turns ids into text one token at a time
without ever emitting half a character.

This module imports nothing of llamajet but its errors.
"""

from __future__ import annotations

import json
import warnings
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers

from llamajet.errors import ModelFormatError, TokenizerError

if TYPE_CHECKING:  # gguf is only needed when a GGUF is read
    import gguf

__all__ = ["Tokenizer", "StreamDecoder", "load_tokenizer", "tokenizer_from_gguf"]

# Tokens that end a turn or a text in the vocabularies we know. They count as
# stop ids only when the vocabulary marks them special: a byte-level vocab may
# hold "</s>" as ordinary text (an HTML tag), and stopping there would be wrong.
_STOP_TOKEN_NAMES = (
    "<|eot_id|>", "<|end_of_text|>", "<|eom_id|>",  # Llama-3
    "<|im_end|>", "<|endoftext|>",  # ChatML / GPT-2 family (SmolLM2, Qwen)
    "</s>",  # SentencePiece Llama-1/2, TinyLlama, stories
    "<end_of_turn>", "<|end|>",  # Gemma, Phi-3
)

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
SUPPORTED_GGUF_PRE = tuple(sorted(_PRE_LLAMA3 | _PRE_SMOLLM | _PRE_GPT2))

_SPM_SPACE = "\u2581"  # SentencePiece's visible space, "▁"


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
        self.vocab_size = int(vocab_size if vocab_size is not None
                              else backend.get_vocab_size(with_added_tokens=True))
        self.bos_id = bos_id
        self.eos_id = eos_id
        self.add_bos = bool(add_bos and bos_id is not None)
        self.chat_template = chat_template
        self.source = source
        special = {i for i, tok in backend.get_added_tokens_decoder().items() if tok.special}
        self.special_ids = frozenset(special)
        stops = {i for i in extra_stop_ids if i is not None and 0 <= i < self.vocab_size}
        if eos_id is not None:
            stops.add(eos_id)
        for name in _STOP_TOKEN_NAMES:
            i = backend.token_to_id(name)
            if i is not None and i in special:
                stops.add(i)
        self.stop_ids = frozenset(stops)

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
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_to_id(self, s: str) -> int | None:
        return self.backend.token_to_id(s)

    def id_to_token(self, i: int) -> str | None:
        return self.backend.id_to_token(int(i)) if 0 <= int(i) < self.vocab_size else None

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
        template = _compile_template(self.chat_template)
        # Like transformers: drop None-valued keys (OpenAI clients send content=None).
        msgs = [{k: v for k, v in dict(m).items() if v is not None} for m in messages]
        variables = {
            "bos_token": self._token_text(self.bos_id),
            "eos_token": self._token_text(self.eos_id),
            "add_generation_prompt": add_generation_prompt,
            "tools": None, "documents": None,
        }
        variables.update(kwargs)
        try:
            return template.render(messages=msgs, **variables)
        except Exception as e:  # jinja2 TemplateError, or the template's raise_exception
            raise TokenizerError(f"chat template failed: {e}") from e

    def _token_text(self, i: int | None) -> str:
        return (self.backend.id_to_token(i) or "") if i is not None else ""


class StreamDecoder:
    """Incremental detokenizer: ids in, finished text out.

    Keeps a window of ids and emits ``decode(window) - decode(window prefix)``,
    so a SentencePiece leading "▁" turns into a space exactly as the full
    decode would. Text whose tail is an incomplete UTF-8 sequence (it decodes
    to U+FFFD, e.g. half an emoji in byte tokens) is held back until the next
    tokens complete it; ``flush`` hands over whatever is left.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._decode = tokenizer.backend.decode
        self._vocab_size = tokenizer.vocab_size
        self._ids: list[int] = []  # the window: left context + ids not yet emitted
        self._read = 0  # ids before it have been emitted (they are the left context)

    def push(self, token_id: int) -> str:
        """Add one id; return the text it completes (maybe ``""``)."""
        token_id = int(token_id)
        if not 0 <= token_id < self._vocab_size:
            raise TokenizerError(f"token id {token_id} out of range [0, {self._vocab_size})")
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


# -- loading -----------------------------------------------------------------

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
            return _from_hf_files(tj)
        ggufs = sorted(p.glob("*.gguf"))
        if len(ggufs) == 1:
            return _from_gguf_path(ggufs[0])
        hint = " (tokenizer.model alone, a SentencePiece file, is not supported)" \
            if (p / "tokenizer.model").exists() else ""
        raise TokenizerError(
            f"no tokenizer in folder {str(p)!r}: expected tokenizer.json or a single .gguf file, "
            f"found {len(ggufs)} .gguf files{hint}")
    if p.suffix.lower() == ".gguf" or _is_gguf(p):
        return _from_gguf_path(p)
    return _from_hf_files(p)


def tokenizer_from_gguf(reader: "gguf.GGUFReader") -> Tokenizer:
    """Build the tokenizer embedded in an open GGUF (``tokenizer.ggml.*`` keys)."""
    meta = _GGUFMeta(reader)
    kind = meta.get("tokenizer.ggml.model")
    if kind is None:
        raise TokenizerError(f"{meta.name}: GGUF has no embedded tokenizer (no tokenizer.ggml.model key)")
    tokens = meta.require("tokenizer.ggml.tokens")
    n = len(tokens)
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
        add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", default_add_bos)),
        chat_template=meta.get("tokenizer.chat_template"),
        extra_stop_ids=[i for i in extra if i is not None],
        vocab_size=n, source=meta.name,
    )


# -- HF folder / tokenizer.json ---------------------------------------------------

def _from_hf_files(tokenizer_json: Path) -> Tokenizer:
    try:
        backend = tokenizers.Tokenizer.from_file(str(tokenizer_json))
    except Exception as e:
        raise _explain_bad_tokenizer_json(tokenizer_json, e) from e
    folder = tokenizer_json.parent
    tcfg = _read_json_if_exists(folder / "tokenizer_config.json")
    gcfg = _read_json_if_exists(folder / "generation_config.json")
    mcfg = _read_json_if_exists(folder / "config.json")

    def special_id(name: str, *cfgs: dict) -> int | None:
        # tokenizer_config names the token; the model configs give ids.
        tok = tcfg.get(name)
        if isinstance(tok, dict):  # serialized AddedToken
            tok = tok.get("content")
        if isinstance(tok, str) and backend.token_to_id(tok) is not None:
            return backend.token_to_id(tok)
        for cfg in cfgs:
            ids = _as_id_list(cfg.get(f"{name}_id"))
            if ids:
                return ids[0]
        return None

    bos_id = special_id("bos_token", gcfg, mcfg)
    eos_id = special_id("eos_token", gcfg, mcfg)
    # What the file's own post-processor does tells whether BOS is expected.
    with_specials = backend.encode("a", add_special_tokens=True).ids
    plain = backend.encode("a", add_special_tokens=False).ids
    prepends = with_specials[0] if with_specials[1:1 + len(plain)] == plain else None
    if bos_id is None and prepends is not None:
        bos_id = prepends
    add_bos = tcfg.get("add_bos_token")
    if not isinstance(add_bos, bool):
        add_bos = prepends is not None and prepends == bos_id

    return Tokenizer(
        backend, bos_id=bos_id, eos_id=eos_id, add_bos=add_bos,
        chat_template=_hf_chat_template(folder, tcfg),
        extra_stop_ids=_as_id_list(gcfg.get("eos_token_id")) + _as_id_list(mcfg.get("eos_token_id")),
        source=str(tokenizer_json),
    )


def _explain_bad_tokenizer_json(path: Path, err: Exception) -> Exception:
    # tokenizers' own message is terse ("expected value at line 1"); say what the file is.
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        return ModelFormatError(f"{path}: not a tokenizer.json (not valid JSON: {e})")
    except OSError as e:
        return TokenizerError(f"{path}: cannot read ({e})")
    if not isinstance(data, dict) or "model" not in data:
        keys = sorted(data)[:6] if isinstance(data, dict) else type(data).__name__
        return TokenizerError(f"{path}: not a Hugging Face tokenizer.json (no 'model' section; has {keys})")
    return ModelFormatError(f"{path}: malformed tokenizer.json ({err})")


def _hf_chat_template(folder: Path, tcfg: dict) -> str | None:
    jinja = folder / "chat_template.jinja"  # transformers >= 4.50 saves it on its own
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    tmpl = tcfg.get("chat_template")
    if isinstance(tmpl, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in tmpl if isinstance(t, dict)}
        tmpl = named.get("default") or next(iter(named.values()), None)
    return tmpl if isinstance(tmpl, str) and tmpl else None


def _read_json_if_exists(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelFormatError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(data, dict):
        raise ModelFormatError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _as_id_list(v: Any) -> list[int]:
    if isinstance(v, bool) or v is None:
        return []
    if isinstance(v, int):
        return [v]
    if isinstance(v, list):
        return [i for i in v if isinstance(i, int) and not isinstance(i, bool)]
    return []


# -- GGUF ----------------------------------------------------------------------------

def _is_gguf(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError as e:
        raise TokenizerError(f"cannot read {path}: {e}") from e


def _from_gguf_path(path: Path) -> Tokenizer:
    import gguf  # only GGUF users pay for importing it

    if not _is_gguf(path):
        raise ModelFormatError(f"{path}: not a GGUF file (does not start with the GGUF magic)")
    try:
        reader = gguf.GGUFReader(str(path), "r")
    except Exception as e:  # numpy/struct/value errors from a short or damaged file
        raise ModelFormatError(
            f"{path}: truncated or corrupt GGUF, its header/metadata cannot be parsed "
            f"({type(e).__name__}: {e})") from e
    return tokenizer_from_gguf(reader)


class _GGUFMeta:
    """Python values of GGUF metadata fields, with errors that name the file."""

    def __init__(self, reader: Any) -> None:
        self.fields = reader.fields
        self.name = str(getattr(getattr(reader, "data", None), "filename", None) or "<gguf>")

    def get(self, key: str, default: Any = None) -> Any:
        field = self.fields.get(key)
        if field is None:
            return default
        try:
            if hasattr(field, "contents"):  # gguf >= 0.11
                return field.contents()
            return _field_value_fallback(field)
        except (UnicodeDecodeError, IndexError, ValueError) as e:
            raise ModelFormatError(f"{self.name}: cannot read GGUF key {key}: {e}") from e

    def require(self, key: str) -> Any:
        v = self.get(key)
        if v is None:
            raise ModelFormatError(f"{self.name}: GGUF key {key} is missing")
        return v


def _field_value_fallback(field: Any) -> Any:
    # Older gguf packages lack ReaderField.contents(): decode parts by hand.
    import gguf

    types = field.types
    if not types:
        return None
    if types[0] == gguf.GGUFValueType.ARRAY:
        if types[-1] == gguf.GGUFValueType.STRING:
            return [bytes(field.parts[i]).decode("utf-8") for i in field.data]
        return [v for i in field.data for v in field.parts[i].tolist()]
    if types[0] == gguf.GGUFValueType.STRING:
        return bytes(field.parts[-1]).decode("utf-8")
    return field.parts[-1].tolist()[0]


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


def _parse_merges(meta: _GGUFMeta, merges: list[str] | None) -> list[tuple[str, str]]:
    if merges is None:
        return []
    pairs = [tuple(m.split(" ")) for m in merges]
    for k, pair in enumerate(pairs):
        if len(pair) != 2:
            raise ModelFormatError(f"{meta.name}: tokenizer.ggml.merges[{k}] = {merges[k]!r} is not 'left right'")
    return pairs  # type: ignore[return-value]


def _bpe(meta: _GGUFMeta, **kwargs: Any) -> models.BPE:
    try:
        return models.BPE(**kwargs)
    except Exception as e:  # e.g. a merge naming a token that is not in the vocabulary
        raise ModelFormatError(f"{meta.name}: inconsistent BPE vocabulary/merges ({e})") from e


def _build_byte_level_bpe(meta: _GGUFMeta, tokens: list[str], types: list[int],
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

    vocab = _vocab_dict(tokens, (key(t, tt) for t, tt in zip(tokens, types)), meta.name)
    merges = _parse_merges(meta, meta.get("tokenizer.ggml.merges"))
    if not merges:
        raise ModelFormatError(f"{meta.name}: byte-level BPE vocabulary without tokenizer.ggml.merges")
    # Llama-3 emits a pre-token whole when it is in the vocabulary (Meta's
    # tokenizer.json has "ignore_merges": true; llama.cpp does the same).
    model = _bpe(meta, vocab=vocab, merges=merges, ignore_merges=pre in _PRE_LLAMA3,
                 fuse_unk=False, byte_fallback=False)
    backend = tokenizers.Tokenizer(model)
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


def _build_sentencepiece_bpe(meta: _GGUFMeta, tokens: list[str], types: list[int]) -> tokenizers.Tokenizer:
    """SentencePiece BPE with byte fallback (tokenizer.ggml.model == "llama")."""
    n = len(tokens)
    scores = meta.get("tokenizer.ggml.scores")
    if scores is None:
        scores = [0.0] * n  # no scores: merges then follow token order only
    if len(scores) != n:
        raise ModelFormatError(f"{meta.name}: tokenizer.ggml.scores has {len(scores)} entries for {n} tokens")
    merges = _parse_merges(meta, meta.get("tokenizer.ggml.merges")) or _sentencepiece_merges(tokens, scores)
    vocab = _vocab_dict(tokens, tokens, meta.name)
    byte_fallback = any(tt == _TT_BYTE for tt in types) or "<0x41>" in vocab
    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[unk_id] if isinstance(unk_id, int) and 0 <= unk_id < n else None
    model = _bpe(meta, vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True, byte_fallback=byte_fallback)
    # llama.cpp prepends a space to the text unless add_space_prefix is false.
    prefix_space = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    backend = tokenizers.Tokenizer(model)
    backend.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement=_SPM_SPACE, prepend_scheme="first" if prefix_space else "never", split=False)
    steps = [decoders.Replace(_SPM_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix_space:  # drop the space the encoder added in front
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    backend.decoder = decoders.Sequence(steps)
    _finish(backend, tokens, types, meta.name)
    return backend


# -- chat templates --------------------------------------------------------------

@lru_cache(maxsize=16)
def _compile_template(source: str) -> Any:
    """Compile a chat template in a jinja2 sandbox configured like transformers'."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class _Generation(jinja2.ext.Extension):
        # {% generation %}...{% endgeneration %} marks assistant text for training
        # masks in transformers; for rendering it is just its body.
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return caller()

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        # jinja's own tojson escapes HTML characters; templates expect plain JSON.
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise TokenizerError(f"chat template does not compile: {e}") from e
