"""Resource bounds on files and templates from strangers (docs/limits.md).

Each bad input is built in tmp_path, mostly by corrupting the real stories260K
model, and must be refused with a LlamajetError naming the file and the
problem, before any large allocation or long loop: every refusal runs under
tracemalloc and must peak below PEAK_LIMIT bytes of Python allocation (a
count, not a clock: no test here measures time)."""

from __future__ import annotations

import json
import pickle
import shutil
import struct
import tracemalloc
from contextlib import contextmanager
from pathlib import Path

import pytest

from llamajet.errors import LlamajetError, ModelFormatError, TokenizerError, UnsupportedModelError
from llamajet.formats import safetensors as st
from llamajet.gguf_meta import MAX_ARRAY_LEN, MAX_STRING_BYTES
from llamajet.loaders import load_hf, load_model
from llamajet.tokenizer import chat, gguf_vocab, load_tokenizer
from llamajet.tokenizer.chat import MAX_OUTPUT_CHARS, MAX_STEPS, render

PEAK_LIMIT = 64 << 20


@contextmanager
def refused(err: type[LlamajetError], *fragments: str):
    """Expects `err` with every fragment in its message, raised while Python's
    allocations peaked under PEAK_LIMIT."""
    tracemalloc.start()
    try:
        with pytest.raises(err) as info:
            yield info
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    for f in fragments:
        assert f in str(info.value), (f, str(info.value))
    assert peak < PEAK_LIMIT, f"peak Python allocation {peak} bytes while refusing"


# ---------------------------------------------------------------- GGUF headers

_U32, _U64, _STR, _ARR = 4, 10, 8, 9  # GGUF metadata value types


def _s(text: str | bytes) -> bytes:
    b = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(b)) + b


def gguf_file(path: Path, kvs: list[bytes] = (), tensors: list[bytes] = (), data: bytes = b"",
              n_tensors: int | None = None, n_kv: int | None = None) -> Path:
    """A GGUF v3 file from raw key-value and tensor-info records (so a record
    may lie), its data section 32-byte aligned."""
    head = b"GGUF" + struct.pack("<IQQ", 3, len(tensors) if n_tensors is None else n_tensors,
                                 len(kvs) if n_kv is None else n_kv)
    head += b"".join(kvs) + b"".join(tensors)
    head += bytes(-len(head) % 32)
    path.write_bytes(head + data)
    return path


def kv_str(key: str, value: str) -> bytes:
    return _s(key) + struct.pack("<I", _STR) + _s(value)


def tensor_info(name: str | bytes, dims: list[int], offset: int = 0, ggml_type: int = 0) -> bytes:
    return _s(name) + struct.pack("<I", len(dims)) + struct.pack(f"<{len(dims)}Q", *dims) \
        + struct.pack("<IQ", ggml_type, offset)


ARCH = kv_str("general.architecture", "llama")


@pytest.mark.parametrize("what, fields, fragment", [
    ("2^40 elements", dict(tensors=[tensor_info("token_embd.weight", [1 << 20, 1 << 20])]), "elements"),
    ("one huge dim", dict(tensors=[tensor_info("token_embd.weight", [0, 1 << 62])]), "dimensions"),
    ("tensor count", dict(n_tensors=1 << 50), "tensors"),
    ("kv count", dict(n_kv=1 << 40), "metadata keys"),
    ("kv count beyond the file", dict(kvs=[ARCH], n_kv=60_000), "past the end of the file"),
    ("string length", dict(kvs=[_s("general.architecture") + struct.pack("<IQ", _STR, 1 << 60)]), "a string of"),
    ("string beyond the file", dict(kvs=[_s("general.name") + struct.pack("<IQ", _STR, 1 << 20)]),
     "past the end of the file"),
    ("array length", dict(kvs=[_s("x") + struct.pack("<IIQ", _ARR, _U32, 1 << 40)]), "an array of"),
    ("string array beyond the file", dict(kvs=[_s("x") + struct.pack("<IIQ", _ARR, _STR, MAX_ARRAY_LEN)]),
     "past the end of the file"),
    ("dims count", dict(tensors=[_s("t") + struct.pack("<I", 1 << 30)]), "dimensions"),
    ("tensor name", dict(tensors=[tensor_info("t" * 1000, [32])]), "a string of 1000 bytes"),
    ("offset past the end", dict(tensors=[tensor_info("output_norm.weight", [32], offset=1 << 40)]),
     "runs past the end of the file"),
    ("offset + size past the end", dict(tensors=[tensor_info("output_norm.weight", [64])], data=bytes(128)),
     "runs past the end of the file"),
])
def test_gguf_header_bounds(tmp_path, what, fields, fragment):
    path = gguf_file(tmp_path / "bad.gguf", **fields)
    with refused(ModelFormatError, str(path), fragment):
        load_model(path)


def test_gguf_string_limit_is_below_file_size_check(tmp_path):
    # the limit applies even when the file would hold the string
    path = gguf_file(tmp_path / "long.gguf", kvs=[kv_str("general.name", "x" * (MAX_STRING_BYTES + 1))])
    with refused(ModelFormatError, str(path), f"limit {MAX_STRING_BYTES}"):
        load_model(path)


def test_gguf_tensor_past_end_of_real_file(tmp_path, stories_gguf):
    # The real stories file with its last bytes cut: the last tensor's data is gone.
    raw = stories_gguf.read_bytes()
    path = tmp_path / "cut.gguf"
    path.write_bytes(raw[:-64])
    with refused(ModelFormatError, str(path), "runs past the end of the file"):
        load_model(path)


# ---------------------------------------------------------------- vocabularies

def test_gguf_vocabulary_of_a_billion_tokens(tmp_path):
    kvs = [kv_str("tokenizer.ggml.model", "llama"),
           _s("tokenizer.ggml.tokens") + struct.pack("<IIQ", _ARR, _STR, 10 ** 9)]
    path = gguf_file(tmp_path / "vocab.gguf", kvs=kvs)
    with refused(ModelFormatError, str(path), "an array of 1000000000 elements"):
        load_tokenizer(path)


def test_gguf_vocabulary_limit(stories_gguf, monkeypatch):
    monkeypatch.setattr(gguf_vocab, "MAX_VOCAB", 100)
    with refused(ModelFormatError, str(stories_gguf), "tokens (limit 100)"):
        load_tokenizer(stories_gguf)


def test_sentencepiece_merge_work_is_bounded(stories_gguf, monkeypatch):
    # deriving merges slices every split of every piece: quadratic in a piece's length
    monkeypatch.setattr(gguf_vocab, "MAX_MERGE_WORK", 1000)
    with refused(ModelFormatError, str(stories_gguf), "limit 1000"):
        load_tokenizer(stories_gguf)


def test_huge_tokenizer_json_is_not_read(tmp_path):
    path = tmp_path / "tokenizer.json"
    with open(path, "wb") as f:  # sparse: no disk used, nothing to parse
        f.truncate(200 << 20)
    with refused(ModelFormatError, str(path), "above the limit"):
        load_tokenizer(path)


@pytest.mark.parametrize("name", ["tokenizer_config.json", "generation_config.json"])
def test_tokenizer_config_nesting_bomb(tmp_path, stories_hf, name):
    folder = tmp_path / "tok"
    folder.mkdir()
    shutil.copyfile(stories_hf / "tokenizer.json", folder / "tokenizer.json")
    (folder / name).write_text("[" * 200_000 + "]" * 200_000)
    with refused(ModelFormatError, name, "nested too deeply"):
        load_tokenizer(folder)


def test_tokenizer_json_nesting_bomb(tmp_path):
    path = tmp_path / "tokenizer.json"
    path.write_text('{"model": ' + "[" * 200_000 + "]" * 200_000 + "}")
    with refused(ModelFormatError, str(path)):
        load_tokenizer(path)


# ---------------------------------------------------------------- chat templates

MSGS = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]

BAD_TEMPLATES = {
    "a gigabyte loop": ("{% for i in range(10**9) %}x{% endfor %}", "Range too big"),
    "repetition": ("{{ 'x' * 10**9 }}", "repeated value"),
    "list repetition": ("{{ [0] * 10**9 }}", "repeated value"),
    "repeated big strings": ("{% set a = 'x' * 4000000 %}{{ ([a] * 1000)|join }}", "repeated value"),
    "power": ("{{ 10 ** (10 ** 10) }}", "number of digits"),
    "nested loops": ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
                     "loop iterations and calls"),
    "a gigabyte of output": (("{% for i in range(100000) %}{% for j in range(100000) %}{{ 'x' * 1000 }}"
                              "{% endfor %}{% endfor %}"), f"output exceeds {MAX_OUTPUT_CHARS}"),
    "exponential macro": ("{% macro f(n) %}{% if n %}{{ f(n-1) }}{{ f(n-1) }}{% endif %}{% endmacro %}{{ f(60) }}",
                          "loop iterations and calls"),
    "doubling namespace": (("{% set ns = namespace(s='x') %}{% for i in range(100) %}"
                            "{% set ns.s = ns.s ~ ns.s %}{% endfor %}"), "a string of size"),
    "doubling by +": (("{% set ns = namespace(s='x') %}{% for i in range(100) %}"
                       "{% set ns.s = ns.s + ns.s %}{% endfor %}"), "a sum of size"),
    "center filter": ("{{ 'x'|center(10**9) }}", "filter center"),
    "indent filter": ("{{ 'x\\n'|indent(10**9) }}", "filter indent"),
    "tojson indent": ("{{ [1, 2]|tojson(indent=10**9) }}", "filter tojson"),
    "str method": ("{{ 'x'.ljust(10**9) }}", "str.ljust"),
    "str.format width": ("{{ '{:>1000000000}'.format(1) }}", "str.format pads"),
    "% width": ("{{ '%1000000000d' % 1 }}", "%-format pads"),
    "format filter": ("{{ '%1000000000d'|format(1) }}", "format filter pads"),
    "join filter": ("{% set a = 'x' * 4000000 %}{{ [a, a, a]|join }}", "joined string"),
    "str.join": ("{% set a = 'x' * 4000000 %}{{ ''.join([a, a, a]) }}", "joined string"),
    "replace filter": ("{% set a = 'x' * 4000000 %}{{ a|replace('x', 'yyyy') }}", "replaced string"),
    "str.replace": ("{% set a = 'x' * 4000000 %}{{ a.replace('x', 'yyyy') }}", "replaced string"),
    "concatenation": ("{% set a = 'x' * 4000000 %}{{ a ~ a ~ a }}", "a string of size"),
    "infinite recursion": ("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "recursion"),
}


@pytest.mark.parametrize("name", list(BAD_TEMPLATES))
def test_template_bounds(name, monkeypatch):
    # The step bound's value is not what is tested: a smaller one keeps the
    # loops short (tracemalloc slows each step).
    monkeypatch.setattr(chat, "MAX_STEPS", 20_000)
    monkeypatch.setattr(chat, "MAX_RENDER_SECONDS", 1e9)  # the bound each case names, not the clock, on a busy machine
    source, fragment = BAD_TEMPLATES[name]
    with refused(TokenizerError, "chat template", fragment):
        render(source, MSGS)


def test_step_bound_value(monkeypatch):
    """The real bound: 200,000 steps, beyond what real templates take (~2 per message)."""
    monkeypatch.setattr(chat, "MAX_RENDER_SECONDS", 1e9)
    with pytest.raises(TokenizerError, match=f"more than {MAX_STEPS} loop iterations"):
        render("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", MSGS)


def test_render_time_bound(monkeypatch):
    """Past MAX_RENDER_SECONDS a render stops, in a loop (checked every TIME_CHECK_EVERY steps) and
    between output chunks; a deadline already passed (0 s) makes both deterministic."""
    monkeypatch.setattr(chat, "MAX_RENDER_SECONDS", 0.0)
    with pytest.raises(TokenizerError, match="rendered for more than 0.0 s"):
        render("{% for i in range(1000) %}{% endfor %}", MSGS)
    with pytest.raises(TokenizerError, match="rendered for more than 0.0 s"):
        render("plain text, one chunk", MSGS)
    monkeypatch.setattr(chat, "MAX_RENDER_SECONDS", 1e9)
    assert render("{% for i in range(1000) %}{% endfor %}ok", MSGS) == "ok"


def test_template_nesting_bound(qwen25_tokenizer_dir):
    """Deeply nested expressions are refused after parsing, before jinja2's quadratic constant folding
    (200 chained operators: 1.9 s, then a SyntaxError from Python's compiler, before this bound)."""
    import jinja2

    with pytest.raises(TokenizerError, match="nests"):
        render("{{ a " + "+" * 200 + " b }}", MSGS)
    with pytest.raises(TokenizerError, match="nests too deeply"):
        render("{{ " + "[" * 3000 + " }}", MSGS)  # the parser's own recursion
    from llamajet.tokenizer import load_tokenizer

    real = load_tokenizer(qwen25_tokenizer_dir).chat_template
    assert chat._ast_depth(jinja2.Environment().parse(real)) < chat.MAX_NESTING // 2


def test_template_source_size():
    with refused(TokenizerError, "above the limit"):
        render("x" * (chat.MAX_TEMPLATE_CHARS + 1), MSGS)


def test_chat_template_from_gguf_is_bounded(tmp_path, stories_gguf):
    """The whole path: a GGUF's embedded template reaches the sandbox's bounds."""
    tok = load_tokenizer(stories_gguf)
    tok.chat_template = "{{ 'x' * 10**9 }}"
    with refused(TokenizerError, "repeated value"):
        tok.apply_chat_template(MSGS)


def _plain_render(source: str, messages: list[dict], **variables) -> str:
    """The same template rendered by jinja2's sandbox without our bounds."""
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = lambda x, indent=None, **kw: json.dumps(x, ensure_ascii=False, indent=indent)
    env.globals["raise_exception"] = raise_exception
    return env.from_string(source).render(messages=messages, **variables)


def _real_templates() -> dict[str, str]:
    """The chat templates of the real models the other tests use, where installed."""
    from conftest import LLAMA32_TOKENIZER, QWEN25_TOKENIZER_DIR, SMOLLM2_GGUF
    from test_tokenizer import LLAMA3_STYLE_TEMPLATE

    out = {"llama3-style": LLAMA3_STYLE_TEMPLATE}
    if SMOLLM2_GGUF is not None:
        out["smollm2"] = load_tokenizer(SMOLLM2_GGUF).chat_template
    for name, folder in (("llama3.2", LLAMA32_TOKENIZER and LLAMA32_TOKENIZER.parent),
                         ("qwen2.5", QWEN25_TOKENIZER_DIR)):
        cfg = folder / "tokenizer_config.json" if folder is not None else None
        if cfg is not None and cfg.is_file():
            template = json.loads(cfg.read_text(encoding="utf-8")).get("chat_template")
            if isinstance(template, str):
                out[name] = template
    return out


def test_real_templates_render_as_before():
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"a": {"type": "number"}}}}]
    convo = [{"role": "system", "content": "Be brief."}, *MSGS, {"role": "user", "content": "and?"}]
    for name, source in _real_templates().items():
        for variables in ({"add_generation_prompt": True, "date_string": "1 Jan 2025"},
                          {"add_generation_prompt": False, "tools": tools, "date_string": "1 Jan 2025"}):
            variables = {"bos_token": "<s>", "eos_token": "</s>", "tools": None, **variables}
            assert render(source, convo, **variables) == _plain_render(source, convo, **variables), name


# ---------------------------------------------------------------- safetensors

def stories_folder(tmp_path: Path, stories_hf: Path, name: str = "stories") -> Path:
    folder = tmp_path / name
    folder.mkdir(parents=True)
    for f in ("config.json", "model.safetensors"):
        shutil.copyfile(stories_hf / f, folder / f)
    return folder


def _rewrite(path: Path, header_len: int | None = None, header: bytes | None = None) -> None:
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    body = header if header is not None else raw[8:8 + n]
    path.write_bytes(struct.pack("<Q", len(body) if header_len is None else header_len) + body + raw[8 + n:])


def test_safetensors_absurd_header_length(tmp_path, stories_hf):
    folder = stories_folder(tmp_path, stories_hf)
    _rewrite(folder / "model.safetensors", header_len=1 << 60)
    with refused(ModelFormatError, "model.safetensors", f"above the limit of {st.MAX_HEADER_BYTES}"):
        load_hf(folder)


def test_safetensors_header_longer_than_file(tmp_path, stories_hf):
    folder = stories_folder(tmp_path, stories_hf)
    _rewrite(folder / "model.safetensors", header_len=st.MAX_HEADER_BYTES - 1)
    with refused(ModelFormatError, "model.safetensors", "exceeds the file"):
        load_hf(folder)


def test_safetensors_nesting_bomb(tmp_path, stories_hf):
    folder = stories_folder(tmp_path, stories_hf)
    _rewrite(folder / "model.safetensors", header=b"[" * 200_000 + b"]" * 200_000)
    with refused(ModelFormatError, "model.safetensors", "nests JSON too deeply"):
        load_hf(folder)


def test_safetensors_offset_past_end(tmp_path, stories_hf):
    folder = stories_folder(tmp_path, stories_hf)
    path = folder / "model.safetensors"
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    name = next(k for k in header if k != "__metadata__")
    begin, end = header[name]["data_offsets"]
    header[name]["data_offsets"] = [begin + (1 << 40), end + (1 << 40)]
    _rewrite(path, header=json.dumps(header).encode())
    with refused(ModelFormatError, "model.safetensors", name, "fall outside"):
        load_hf(folder)


def test_config_json_nesting_bomb(tmp_path, stories_hf):
    folder = stories_folder(tmp_path, stories_hf)
    (folder / "config.json").write_text("[" * 200_000 + "]" * 200_000)
    with refused(ModelFormatError, "config.json"):
        load_hf(folder)


def _index(folder: Path, shard: str) -> None:
    header = st.read_header(folder / "model.safetensors", st.map_read_only(folder / "model.safetensors"))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {k: shard for k in header}}))


@pytest.mark.parametrize("how", ["dotdot", "absolute", "symlink"])
def test_index_shards_stay_in_the_folder(tmp_path, stories_hf, how):
    folder = stories_folder(tmp_path, stories_hf)
    outside = tmp_path / "outside.safetensors"
    shutil.copyfile(stories_hf / "model.safetensors", outside)
    shard = {"dotdot": "../outside.safetensors", "absolute": str(outside), "symlink": "link.safetensors"}[how]
    (folder / "link.safetensors").symlink_to(outside)
    _index(folder, shard)
    with refused(ModelFormatError, "model.safetensors.index.json", shard, "outside the model folder"):
        load_hf(folder)


def test_index_in_the_hub_cache_layout_loads(tmp_path, stories_hf):
    """Hugging Face's cache links snapshots/<rev>/<file> to blobs/<hash>: allowed."""
    blobs = tmp_path / "models--x" / "blobs"
    blobs.mkdir(parents=True)
    shutil.copyfile(stories_hf / "model.safetensors", blobs / "abc123")
    folder = tmp_path / "models--x" / "snapshots" / "rev1"
    folder.mkdir(parents=True)
    shutil.copyfile(stories_hf / "config.json", folder / "config.json")
    (folder / "model-00001-of-00001.safetensors").symlink_to("../../blobs/abc123")
    (folder / "model.safetensors").symlink_to("../../blobs/abc123")
    _index(folder, "model-00001-of-00001.safetensors")
    (folder / "model.safetensors").unlink()
    assert load_hf(folder).weights


# ---------------------------------------------------------------- pickles

class _Trap:
    """Unpickling this writes a marker file: proof a loader unpickled."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.write_text, (self.marker, "unpickled"))


@pytest.mark.parametrize("name", ["pytorch_model.bin", "model.pt", "weights.pth", "last.ckpt",
                                  "pytorch_model-00001-of-00002.bin"])
def test_pickled_checkpoint_is_refused_unopened(tmp_path, stories_hf, name, monkeypatch):
    folder = stories_folder(tmp_path, stories_hf)
    (folder / "model.safetensors").unlink()
    marker = tmp_path / "marker"
    (folder / name).write_bytes(pickle.dumps(_Trap(marker)))
    opened = []
    monkeypatch.setattr(pickle, "load", lambda *a, **k: opened.append(a))
    monkeypatch.setattr(pickle, "loads", lambda *a, **k: opened.append(a))
    with refused(UnsupportedModelError, name, "safetensors or GGUF"):
        load_model(folder)
    assert not marker.exists() and not opened


def test_oversized_config_json_is_not_read(tmp_path, stories_hf, monkeypatch):
    """config.json is read whole: one above config.MAX_CONFIG_BYTES is refused by its size (the limit is
    lowered here so the test writes a small file)."""
    from llamajet import config

    folder = stories_folder(tmp_path, stories_hf)
    monkeypatch.setattr(config, "MAX_CONFIG_BYTES", 1024)
    (folder / "config.json").write_text('{"pad": "' + "x" * 4096 + '"}')
    with refused(ModelFormatError, "config.json", "above the limit"):
        load_hf(folder)


def test_saved_meta_nesting_bomb_and_size(tmp_path, stories_hf, monkeypatch):
    from llamajet.formats import saved
    from llamajet.loaders import load_saved
    from llamajet.quant.quantize import quantize_model

    quantize_model(stories_hf, tmp_path / "q", "int8_g32")
    meta = tmp_path / "q" / "llamajet.json"
    good = meta.read_text()
    meta.write_text("[" * 200_000 + "]" * 200_000)
    with refused(ModelFormatError, "llamajet.json", "nested too deeply"):
        load_saved(tmp_path / "q")
    meta.write_text(good)
    monkeypatch.setattr(saved, "MAX_META_BYTES", 1024)
    with refused(ModelFormatError, "llamajet.json", "above the limit"):
        load_saved(tmp_path / "q")
