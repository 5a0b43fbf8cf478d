"""Write the fuzz targets' fixtures and seed corpora (tests/fuzz/fixtures, tests/fuzz/corpus/<target>/).

    .venv/bin/python tests/fuzz/make_seeds.py

Run once; the outputs are committed (a few hundred KB in all) so the fuzz
runs and tests/test_fuzz_corpus.py need nothing else. Seeds are small on
purpose: libFuzzer mutates faster and reaches deeper on a 30 KB model than on
a 1 MB one. The model is a random-weight Llama of 1 layer (dim 32, 4 heads,
2 kv heads) with the stories260K vocabulary (SentencePiece, 512 tokens) or a
byte-level BPE of 512 tokens trained here on tinyshakespeare. Regression
inputs found by fuzzing are added to the corpus folders by hand, named
``regress-<what>``; this script never deletes them.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import gguf
import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
SHARED = ROOT.parent / "shared" / "data"
STORIES_GGUF = SHARED / "models" / "stories260K-f32.gguf"
STORIES_HF = SHARED / "models" / "stories260K-hf"
SHAKESPEARE = SHARED / "corpora" / "tinyshakespeare.txt"
CORPUS, FIXTURES = HERE / "corpus", HERE / "fixtures"

DIM, HEADS, KV, FFN, LAYERS, CTX = 32, 4, 2, 64, 1, 128
_Q = gguf.GGMLQuantizationType
CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def _put(target: str, name: str, data: bytes) -> None:
    d = CORPUS / target
    d.mkdir(parents=True, exist_ok=True)
    (d / name).write_bytes(data)


def stories_vocab() -> dict:
    r = gguf.GGUFReader(STORIES_GGUF)
    f = r.fields
    tokens = [bytes(f["tokenizer.ggml.tokens"].parts[i]).decode() for i in f["tokenizer.ggml.tokens"].data]
    scores = [float(f["tokenizer.ggml.scores"].parts[i][0]) for i in f["tokenizer.ggml.scores"].data]
    types = [int(f["tokenizer.ggml.token_type"].parts[i][0]) for i in f["tokenizer.ggml.token_type"].data]
    return {"model": "llama", "tokens": tokens, "scores": scores, "types": types, "bos": 1, "eos": 2, "unk": 0}


def trained_bpe():
    """A 512-token byte-level BPE (the Llama-3 family's kind), trained here."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=510, special_tokens=["<|begin_of_text|>", "<|end_of_text|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([SHAKESPEARE.read_text()[:200_000]], trainer)
    return tok


def bpe_vocab(tok) -> dict:
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    types = [3 if t.startswith("<|") else 1 for t in tokens]
    return {"model": "gpt2", "pre": "llama-bpe", "tokens": tokens, "types": types, "merges": merges,
            "bos": 0, "eos": 1}


def add_vocab(w: gguf.GGUFWriter, v: dict) -> None:
    w.add_tokenizer_model(v["model"])
    if "pre" in v:
        w.add_tokenizer_pre(v["pre"])
    w.add_token_list(v["tokens"])
    w.add_token_types(v["types"])
    if "scores" in v:
        w.add_token_scores(v["scores"])
    if "merges" in v:
        w.add_token_merges(v["merges"])
    w.add_bos_token_id(v["bos"])
    w.add_eos_token_id(v["eos"])
    if "unk" in v:
        w.add_unk_token_id(v["unk"])
    w.add_chat_template(CHATML)


def tiny_weights(vocab: int, seed: int = 0) -> dict[str, np.ndarray]:
    """HF-named float32 weights of the tiny model ([out, in] like torch)."""
    rng = np.random.default_rng(seed)
    hd = DIM // HEADS
    w = {"model.embed_tokens.weight": rng.standard_normal((vocab, DIM)), "model.norm.weight": 1 + 0.1 * rng.standard_normal(DIM)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        w |= {p + "input_layernorm.weight": 1 + 0.1 * rng.standard_normal(DIM),
              p + "post_attention_layernorm.weight": 1 + 0.1 * rng.standard_normal(DIM),
              p + "self_attn.q_proj.weight": rng.standard_normal((DIM, DIM)) / DIM ** 0.5,
              p + "self_attn.k_proj.weight": rng.standard_normal((KV * hd, DIM)) / DIM ** 0.5,
              p + "self_attn.v_proj.weight": rng.standard_normal((KV * hd, DIM)) / DIM ** 0.5,
              p + "self_attn.o_proj.weight": rng.standard_normal((DIM, DIM)) / DIM ** 0.5,
              p + "mlp.gate_proj.weight": rng.standard_normal((FFN, DIM)) / DIM ** 0.5,
              p + "mlp.up_proj.weight": rng.standard_normal((FFN, DIM)) / DIM ** 0.5,
              p + "mlp.down_proj.weight": rng.standard_normal((DIM, FFN)) / FFN ** 0.5}
    return {k: v.astype(np.float32) for k, v in w.items()}


_GGUF_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
               "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
               "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
               "mlp.down_proj": "ffn_down"}


def _gguf_name(hf: str) -> str:
    if hf in _GGUF_NAMES:
        return _GGUF_NAMES[hf]
    _, _, i, rest = hf.split(".", 3)
    mod = rest.rsplit(".", 1)[0]
    return f"blk.{i}.{_GGUF_NAMES[mod]}.weight"


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    # llama.cpp's converter stores q/k rotated to GGML's rope layout
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(path: Path, vocab: dict, matrix_type: _Q | None, vocab_only: bool = False) -> bytes:
    w = gguf.GGUFWriter(path, "llama")
    w.add_name("llamajet fuzz seed")
    w.add_context_length(CTX)
    w.add_embedding_length(DIM)
    w.add_block_count(LAYERS)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV)
    w.add_rope_dimension_count(DIM // HEADS)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(len(vocab["tokens"]))
    add_vocab(w, vocab)
    if not vocab_only:
        for name, a in tiny_weights(len(vocab["tokens"])).items():
            if "q_proj" in name:
                a = _permute(a, HEADS)
            elif "k_proj" in name:
                a = _permute(a, KV)
            if a.ndim == 1 or matrix_type in (None, _Q.F32):
                w.add_tensor(_gguf_name(name), a)
            elif matrix_type == _Q.F16:
                w.add_tensor(_gguf_name(name), a.astype(np.float16))
            else:
                q = gguf.quants.quantize(a, matrix_type)
                w.add_tensor(_gguf_name(name), q, raw_dtype=matrix_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path.read_bytes()


def hf_fixture(d: Path) -> None:
    from safetensors.numpy import save_file

    d.mkdir(parents=True, exist_ok=True)
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": DIM,
           "intermediate_size": FFN, "num_hidden_layers": LAYERS, "num_attention_heads": HEADS,
           "num_key_value_heads": KV, "max_position_embeddings": CTX, "rms_norm_eps": 1e-5,
           "rope_theta": 10000.0, "vocab_size": 512, "tie_word_embeddings": True,
           "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float16"}
    (d / "config.json").write_text(json.dumps(cfg, indent=1))
    shutil.copy(STORIES_HF / "tokenizer.json", d / "tokenizer.json")
    save_file({k: v.astype(np.float16) for k, v in tiny_weights(512).items()}, d / "model.safetensors")


def main() -> None:
    for p in (STORIES_GGUF, STORIES_HF, SHAKESPEARE):
        if not p.exists():
            sys.exit(f"make_seeds: shared data missing: {p}")
    FIXTURES.mkdir(parents=True, exist_ok=True)
    tmp = FIXTURES / ".tmp"
    tmp.mkdir(exist_ok=True)
    spm, bpe_tok = stories_vocab(), trained_bpe()
    bpe = bpe_vocab(bpe_tok)

    # gguf: whole models; gguf_vocab: vocabularies alone
    _put("gguf", "tiny-q8_0.gguf", write_gguf(tmp / "a.gguf", spm, _Q.Q8_0))
    _put("gguf", "tiny-f16.gguf", write_gguf(tmp / "b.gguf", spm, _Q.F16))
    _put("gguf", "tiny-q4_0-bpe.gguf", write_gguf(tmp / "c.gguf", bpe, _Q.Q4_0))
    _put("gguf_vocab", "vocab-spm.gguf", write_gguf(tmp / "d.gguf", spm, None, vocab_only=True))
    _put("gguf_vocab", "vocab-bpe.gguf", write_gguf(tmp / "e.gguf", bpe, None, vocab_only=True))

    # safetensors / index / saved: around the tiny HF folder
    hf = FIXTURES / "hf"
    hf_fixture(hf)
    st = (hf / "model.safetensors").read_bytes()
    _put("safetensors", "tiny-f16.safetensors", st)
    hlen = int.from_bytes(st[:8], "little")
    _put("safetensors", "header-only.safetensors", st[:8 + hlen])
    names = list(json.loads(st[8:8 + hlen]))
    names.remove("__metadata__") if "__metadata__" in names else None
    shard = "model-00001-of-00001.safetensors"
    _put("safetensors_index", "valid.json", json.dumps({"metadata": {}, "weight_map": {n: shard for n in names}}).encode())
    _put("safetensors_index", "escape.json", json.dumps({"weight_map": {n: "../outside.safetensors" for n in names}}).encode())
    _put("safetensors_index", "absolute.json", json.dumps({"weight_map": {names[0]: "/etc/passwd"}}).encode())

    from llamajet.quant.quantize import quantize_model

    saved = FIXTURES / "saved"
    shutil.rmtree(saved, ignore_errors=True)
    quantize_model(hf, saved, "int4_asym_g32", embed_scheme="int8_g32")
    _put("saved", "meta.bin", b"\0" + (saved / "llamajet.json").read_bytes())
    _put("saved", "weights.bin", b"\1" + (saved / "model.safetensors").read_bytes())

    # tokenizer.json: the file, NUL, tokenizer_config.json, NUL, text
    text = "Once upon a time, there was a little <s> dog. \u00c9t\u00e9 \U0001f600 1234 \n\t!"
    tcfg = json.dumps({"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True,
                       "chat_template": "{% for m in messages %}{{ m['content'] }}{% endfor %}"})
    _put("tokenizer_json", "spm.bin", (STORIES_HF / "tokenizer.json").read_bytes() + b"\0" + tcfg.encode() + b"\0" + text.encode())
    _put("tokenizer_json", "bpe.bin", bpe_tok.to_str().encode() + b"\0\0" + text.encode())

    # chat templates: the shipped families' and hostile ones
    from llamajet.tokenizer import load_tokenizer

    sys.path.insert(0, str(ROOT / "tests"))
    import conftest

    for name, src in (("smollm2", conftest.SMOLLM2_GGUF), ("llama32", conftest.LLAMA32_TOKENIZER),
                      ("qwen25", conftest.QWEN25_TOKENIZER_DIR)):
        if src is not None:
            t = load_tokenizer(src)
            if t.chat_template:
                _put("chat_template", f"{name}.jinja", t.chat_template.encode())
    hostile = {
        "loop.jinja": "{% for i in range(10**9) %}{{ i }}{% endfor %}",
        "nested-loop.jinja": "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}",
        "big-string.jinja": "{{ 'x' * 10**9 }}",
        "dunder.jinja": "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "recursion.jinja": "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
        "format.jinja": "{{ '%999999999d' % 1 }}{{ '{:>999999999}'.format(1) }}",
        "tools.jinja": "{% for m in messages %}{{ m.role }}: {{ m.content }}{% if m.tool_calls %}"
                       "{{ m.tool_calls | tojson }}{% endif %}\n{% endfor %}{% if tools %}{{ tools | tojson(indent=2) }}"
                       "{% endif %}{% if add_generation_prompt %}assistant:{% endif %}",
        "raise.jinja": "{{ raise_exception('no system role') }}",
    }
    for n, s in hostile.items():
        _put("chat_template", n, s.encode() + b"\0" + b"v")

    # server bodies: byte 0 = endpoint (0 chat, 1 completions, 2 tokenize, 3 detokenize, 5 responses,
    # 6 messages, 7 messages/count_tokens, 8 embeddings: targets._ENDPOINTS)
    chat = {"model": "fuzz", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "temperature": 0}
    bodies = {
        "chat.bin": (0, chat),
        "chat-stream.bin": (0, chat | {"stream": True, "stream_options": {"include_usage": True}}),
        "chat-sampling.bin": (0, chat | {"temperature": 0.8, "top_p": 0.9, "seed": 3, "n": 2, "stop": ["\n", "."],
                                          "logit_bias": {"5": -100}, "logprobs": True, "top_logprobs": 3,
                                          "presence_penalty": 0.5, "frequency_penalty": 0.1}),
        "chat-tools.bin": (0, chat | {"tools": [{"type": "function", "function": {
            "name": "get_weather", "description": "weather", "parameters": {
                "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                "required": ["city"]}}}], "tool_choice": "auto"}),
        "chat-schema.bin": (0, chat | {"response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "strict": True, "schema": {"type": "object", "properties": {
                "a": {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 3},
                "b": {"anyOf": [{"type": "number"}, {"type": "null"}]}}, "required": ["a"]}}}}),
        "chat-json.bin": (0, chat | {"response_format": {"type": "json_object"}}),
        "completion.bin": (1, {"model": "fuzz", "prompt": "Once upon", "max_tokens": 3, "echo": True, "logprobs": 2}),
        "completion-ids.bin": (1, {"prompt": [1, 2, 3, 4], "max_tokens": 2, "suffix": None}),
        "tokenize.bin": (2, {"prompt": "Hello there"}),
        "tokenize-chat.bin": (2, {"messages": [{"role": "user", "content": "Hi"}], "add_generation_prompt": True}),
        "detokenize.bin": (3, {"tokens": [1, 100, 200]}),
        "responses.bin": (5, {"model": "fuzz", "input": "Hi", "instructions": "Be brief.", "max_output_tokens": 3}),
        "responses-items.bin": (5, {"model": "fuzz", "input": [
            {"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
            {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"},
            {"type": "function_call_output", "call_id": "c1", "output": "sunny"}],
            "tools": [{"type": "function", "name": "get_weather", "parameters": {
                "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}],
            "text": {"format": {"type": "json_object"}}, "stream": True}),
        "messages.bin": (6, {"model": "fuzz", "max_tokens": 3, "system": "Be brief.", "stop_sequences": ["."],
                             "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]}),
        "messages-tools.bin": (6, {"model": "fuzz", "max_tokens": 3, "stream": True, "tool_choice": {"type": "any"},
                                   "tools": [{"name": "f", "input_schema": {"type": "object", "properties": {
                                       "x": {"type": "integer"}}}}],
                                   "messages": [{"role": "user", "content": "Call f."}]}),
        "count-tokens.bin": (7, {"model": "fuzz", "messages": [{"role": "user", "content": "Hi"}]}),
        "embeddings.bin": (8, {"model": "fuzz", "input": ["Hello", "there"], "encoding_format": "base64"}),
    }
    for n, (ep, b) in bodies.items():
        _put("server", n, bytes([ep]) + json.dumps(b).encode())
    _put("server", "not-json.bin", b"\0{\"messages\": [")

    shutil.rmtree(tmp)
    for t in sorted(CORPUS.iterdir()):
        files = list(t.iterdir())
        print(f"{t.name}: {len(files)} seeds, {sum(f.stat().st_size for f in files)} bytes")


if __name__ == "__main__":
    main()
