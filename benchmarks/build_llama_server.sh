#!/usr/bin/env bash
# Build a native llama.cpp `llama-server` (mainline, from the pinned
# llama-cpp-python sdist) to use as a benchmark yardstick; see
# build_llama_cpp.sh, which does the work.
#
# Usage: bash benchmarks/build_llama_server.sh [OUT_DIR]      (default: /tmp/llama-server)
set -euo pipefail
exec bash "$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/build_llama_cpp.sh" llama-server "$@"
