"""The README's `llamajet serve` curl examples, run as written (on a free port)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from serverlib import free_port

ROOT = Path(__file__).resolve().parents[1]


def test_readme_curl_examples_work_as_written(smollm2_gguf):
    if shutil.which("curl") is None:
        pytest.skip("curl is not installed")
    text = (ROOT / "README.md").read_text()
    section = text.split("## Serve (OpenAI and Anthropic APIs)", 1)[1]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    port = str(free_port())
    script = "set -e\n" + block.replace("8000", port)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    r = subprocess.run(["bash", "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    out = r.stdout
    dec, objs = json.JSONDecoder(), []
    for m in re.finditer(r'\{"id"', out):  # the responses (curl adds no newline after a body)
        try:
            objs.append(dec.raw_decode(out, m.start())[0])
        except ValueError:
            pass
    chat = [o for o in objs if o.get("object") == "chat.completion"]
    assert len(chat) == 2 and all(c["choices"][0]["message"]["content"] for c in chat)
    person = json.loads(chat[1]["choices"][0]["message"]["content"])
    assert isinstance(person["name"], str) and isinstance(person["age"], int)
    assert "data: [DONE]" in out and out.count("data: {") >= 2  # the streamed completion
    assert re.search(r"llamajet:num_requests_running\{.*\} 0\.0$", out, re.M)
