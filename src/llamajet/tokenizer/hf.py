"""Tokenizers of Hugging Face folders: tokenizer.json plus the configs beside
it (tokenizer_config.json, generation_config.json, config.json,
chat_template.jinja) for BOS/EOS, stop ids, add_bos and the chat template."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import tokenizers

from llamajet.errors import ModelFormatError, TokenizerError, tokenizer_panics
from llamajet.tokenizer.chat import MAX_TEMPLATE_CHARS
from llamajet.tokenizer.core import Tokenizer

# File sizes read at most, checked before anything is parsed (docs/limits.md).
# Llama-3's tokenizer.json is 9 MB, Gemma-3's (262k tokens) 33 MB; the
# configs beside it are kilobytes (a few MB with a long added-token table).
MAX_TOKENIZER_JSON_BYTES = 128 * 1024 * 1024
MAX_CONFIG_JSON_BYTES = 64 * 1024 * 1024


def _check_file_size(path: Path, limit: int, what: str) -> None:
    size = path.stat().st_size
    if size > limit:
        raise ModelFormatError(f"{path}: {size} bytes, above the limit of {limit} for {what}")


def from_hf_files(tokenizer_json: Path) -> Tokenizer:
    try:
        _check_file_size(tokenizer_json, MAX_TOKENIZER_JSON_BYTES, "a tokenizer.json")
    except OSError as e:
        raise TokenizerError(f"{tokenizer_json}: cannot read ({e})") from e
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
    with tokenizer_panics(f"{tokenizer_json}: not a usable tokenizer.json"):  # its post-processor can panic
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
    except RecursionError:  # [[[[...]]]] past Python's parser's depth
        return ModelFormatError(f"{path}: not a tokenizer.json (JSON nested too deeply)")
    except OSError as e:
        return TokenizerError(f"{path}: cannot read ({e})")
    if not isinstance(data, dict) or "model" not in data:
        keys = sorted(data)[:6] if isinstance(data, dict) else type(data).__name__
        return TokenizerError(f"{path}: not a Hugging Face tokenizer.json (no 'model' section; has {keys})")
    return ModelFormatError(f"{path}: malformed tokenizer.json ({err})")


def _hf_chat_template(folder: Path, tcfg: dict) -> str | None:
    jinja = folder / "chat_template.jinja"  # transformers >= 4.50 saves it on its own
    if jinja.is_file():
        _check_file_size(jinja, MAX_TEMPLATE_CHARS, "a chat template")
        return jinja.read_text(encoding="utf-8")
    tmpl = tcfg.get("chat_template")
    if isinstance(tmpl, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in tmpl if isinstance(t, dict)}
        tmpl = named.get("default") or next(iter(named.values()), None)
    return tmpl if isinstance(tmpl, str) and tmpl else None


def _read_json_if_exists(path: Path) -> dict:
    if not path.is_file():
        return {}
    _check_file_size(path, MAX_CONFIG_JSON_BYTES, "a configuration file")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelFormatError(f"{path}: not valid JSON ({e})") from e
    except RecursionError:  # [[[[...]]]] past Python's parser's depth
        raise ModelFormatError(f"{path}: JSON nested too deeply") from None
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
