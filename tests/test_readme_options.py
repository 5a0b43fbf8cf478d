"""The README's first screen and its options table stay true to the code (issue 45)."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from llamajet.config import RuntimeConfig
from llamajet.options import runtime_flags

README = Path(__file__).resolve().parents[1] / "README.md"


def _options_table() -> dict[str, list[str]]:
    text = README.read_text(encoding="utf-8")
    section = text[text.index("### Options"):]
    section = section[: section.index("\n\n", section.index("| option |"))]
    rows = {}
    for line in section.splitlines():
        m = re.match(r"\| `(\w+)` \| ([^|]*) \|", line)
        if m:
            assert m.group(1) not in rows, f"{m.group(1)} twice in the table"
            rows[m.group(1)] = re.findall(r"`(-[-\w]+)", m.group(2))
    return rows


def test_the_options_table_lists_every_option_with_its_flags():
    rows = _options_table()
    fields = {f.name for f in dataclasses.fields(RuntimeConfig)}
    assert set(rows) == fields, (set(rows) ^ fields)
    for name, flags in rows.items():
        assert flags == list(runtime_flags(name)), (name, flags)


def test_the_first_screen_says_what_it_is_and_how_to_run_a_model():
    first = README.read_text(encoding="utf-8")[:4000]
    assert first.index("make run") < first.index("make test")
    for needed in ("GGUF", "Hugging Face", "--model", "[Options](#options)", "--help"):
        assert needed in first, needed
