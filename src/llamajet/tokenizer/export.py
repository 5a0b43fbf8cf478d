"""A Tokenizer written as Hugging Face files (tokenizer.json and its configs)
that load_tokenizer reads back as the same tokenizer: what a saved llamajet
model (``llamajet quantize``, the repacked-weights cache) carries."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from llamajet.errors import TokenizerError
from llamajet.tokenizer.core import Tokenizer


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    return data if isinstance(data, dict) else {}


def write_tokenizer_files(tok: Tokenizer, src: Path, out: Path, max_len: int) -> None:
    """tokenizer.json (copied from an HF source, else the backend built from the
    GGUF vocabulary), and configs that state every fact load_tokenizer needs
    explicitly: bos/eos, add_bos, chat template, stop ids."""
    src_dir = src if src.is_dir() else None
    if src_dir is not None and (src_dir / "tokenizer.json").is_file():
        shutil.copyfile(src_dir / "tokenizer.json", out / "tokenizer.json")
        tcfg = _read_json(src_dir / "tokenizer_config.json")
        gcfg = _read_json(src_dir / "generation_config.json")
    else:
        tok.backend.save(str(out / "tokenizer.json"))
        tcfg = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_len}
        gcfg = {}

    def name(i: int | None) -> str | None:
        # a token named by its text only when the text leads back to that id
        t = tok.backend.id_to_token(i) if i is not None else None
        return t if t is not None and tok.backend.token_to_id(t) == i else None

    for key, i in (("bos_token", tok.bos_id), ("eos_token", tok.eos_id)):
        tcfg.pop(key, None)
        if name(i) is not None:
            tcfg[key] = name(i)
    tcfg["add_bos_token"] = tok.add_bos
    tcfg.pop("chat_template", None)
    if tok.chat_template:
        tcfg["chat_template"] = tok.chat_template
    # NOTE: every stop id goes into generation_config's eos list (primary EOS first):
    # the saved folder has no config.json, whose eos ids the source's tokenizer may have used.
    stops = ([tok.eos_id] if tok.eos_id is not None else []) + sorted(tok.stop_ids - {tok.eos_id})
    gcfg["eos_token_id"] = stops
    gcfg.pop("bos_token_id", None)
    if tok.bos_id is not None:
        gcfg["bos_token_id"] = tok.bos_id
    (out / "tokenizer_config.json").write_text(json.dumps(tcfg, indent=2, ensure_ascii=False) + "\n",
                                               encoding="utf-8")
    (out / "generation_config.json").write_text(json.dumps(gcfg, indent=2) + "\n", encoding="utf-8")
    (out / "chat_template.jinja").unlink(missing_ok=True)  # a stale one (--force) would win over tcfg's


def check_written(tok: Tokenizer, out: Path) -> None:
    """The saved tokenizer must behave as the source's: same ids, BOS/EOS, stops, template."""
    from llamajet.tokenizer import load_tokenizer

    new = load_tokenizer(out)
    specials = "".join(new.backend.id_to_token(i) or "" for i in sorted(new.special_ids)[:8])
    probe = f"Hello world!  It's 2024: ünïcödé ✓ 漢字\n\n\tcode();{specials} end"
    facts = ("bos_id", "add_bos", "stop_ids", "chat_template")
    diff = [f for f in facts if getattr(new, f) != getattr(tok, f)]
    if tok.eos_id is not None and new.eos_id != tok.eos_id:
        diff.append("eos_id")
    for special in (True, False):
        if new.encode(probe, add_special_tokens=special) != tok.encode(probe, add_special_tokens=special):
            diff.append(f"encode(add_special_tokens={special})")
    if diff:
        raise TokenizerError(f"{out}: the saved tokenizer differs from the source's in {', '.join(diff)}")
