#!/usr/bin/env bash
# Build a native llama.cpp `llama-server` to use as a benchmark yardstick.
#
# Usage: bash benchmarks/build_llama_server.sh [OUT_DIR]      (default: /tmp/llama-server)
#
# The llama.cpp sources come from the pinned llama-cpp-python sdist on PyPI
# (vendor/llama.cpp inside it), so only PyPI access is needed.  The result is
# OUT_DIR/bin/llama-server: static llama/ggml libs (BUILD_SHARED_LIBS=OFF),
# -march=native (GGML_NATIVE=ON), no web UI assets, no HTTPS, no curl.
#
# Idempotent: if OUT_DIR/bin/llama-server already exists and `--version` runs,
# its path is printed and nothing is rebuilt.
#
# Environment overrides:
#   PIP                 pip to download the sdist with (default: <repo>/.venv/bin/pip, else pip3)
#   LLAMA_CPP_PY_VER    llama-cpp-python version to take llama.cpp from (default: 0.3.36)
#   JOBS                parallel build jobs (default: 2)
#   KEEP_BUILD_DIR=1    keep the temporary source/build dir (its path is printed)
set -euo pipefail

die() { echo "build_llama_server: ERROR: $*" >&2; exit 1; }
log() { echo "build_llama_server: $*" >&2; }

OUT_DIR="${1:-/tmp/llama-server}"
VER="${LLAMA_CPP_PY_VER:-0.3.36}"
JOBS="${JOBS:-2}"
SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO_ROOT="$(cd "${SCRIPT_DIR}/.." && pwd)"
BIN="${OUT_DIR}/bin/llama-server"

# ---- idempotency -----------------------------------------------------------
if [[ -x "${BIN}" ]] && "${BIN}" --version >/dev/null 2>&1; then
    log "already built: $("${BIN}" --version 2>&1 | grep -m1 -i version || true)"
    echo "${BIN}"
    exit 0
fi

# ---- tools -----------------------------------------------------------------
if [[ -z "${PIP:-}" ]]; then
    if [[ -x "${REPO_ROOT}/.venv/bin/pip" ]]; then
        PIP="${REPO_ROOT}/.venv/bin/pip"
    elif command -v pip3 >/dev/null 2>&1; then
        PIP="$(command -v pip3)"
    else
        die "no pip found (set PIP=/path/to/pip)"
    fi
fi
for t in cmake tar "${CC:-gcc}" "${CXX:-g++}"; do
    command -v "$t" >/dev/null 2>&1 || die "required tool not found on PATH: $t"
done

WORK="$(mktemp -d "${TMPDIR:-/tmp}/llama-server-build.XXXXXX")"
cleanup() {
    if [[ "${KEEP_BUILD_DIR:-0}" == "1" ]]; then
        log "kept build dir: ${WORK}"
    else
        rm -rf "${WORK}"
    fi
}
trap cleanup EXIT

# ---- sources ---------------------------------------------------------------
log "downloading llama-cpp-python==${VER} sdist with ${PIP}"
"${PIP}" download --quiet --no-deps --no-binary :all: "llama-cpp-python==${VER}" -d "${WORK}/dl" \
    || die "pip download of llama-cpp-python==${VER} sdist failed"
SDIST="$(ls "${WORK}"/dl/llama_cpp_python-"${VER}".tar.gz 2>/dev/null | head -n1 || true)"
[[ -n "${SDIST}" ]] || die "sdist llama_cpp_python-${VER}.tar.gz not found in ${WORK}/dl"

log "extracting vendor/llama.cpp from $(basename "${SDIST}")"
tar -xzf "${SDIST}" -C "${WORK}" "llama_cpp_python-${VER}/vendor/llama.cpp" \
    || die "could not extract vendor/llama.cpp from ${SDIST}"
SRC="${WORK}/llama_cpp_python-${VER}/vendor/llama.cpp"
[[ -f "${SRC}/CMakeLists.txt" ]] || die "no CMakeLists.txt in ${SRC}"
[[ -f "${SRC}/tools/server/CMakeLists.txt" ]] || die "no tools/server in ${SRC} (server sources missing from sdist)"

# ---- configure -------------------------------------------------------------
CMAKE_ARGS=(
    -DCMAKE_BUILD_TYPE=Release
    -DBUILD_SHARED_LIBS=OFF
    -DGGML_NATIVE=ON
    -DLLAMA_CURL=OFF              # deprecated/ignored in this tree; harmless
    -DLLAMA_OPENSSL=OFF           # no HTTPS: fewer runtime deps
    -DLLAMA_BUILD_TESTS=OFF
    -DLLAMA_BUILD_EXAMPLES=OFF
    -DLLAMA_BUILD_APP=OFF
    -DLLAMA_BUILD_TOOLS=ON        # tools/server lives under tools/
    -DLLAMA_BUILD_SERVER=ON
    -DLLAMA_BUILD_UI=OFF          # no npm build of the web UI
    -DLLAMA_USE_PREBUILT_UI=OFF   # no download of UI assets: server embeds an empty UI table
)
EXTRA_FLAGS=""
if grep -qw amx_tile /proc/cpuinfo 2>/dev/null; then
    # llama.cpp's AMX path faults on Sapphire Rapids.  With GGML_NATIVE=ON the
    # GGML_AMX_* options alone do not help (-march=native defines __AMX_INT8__),
    # so also strip the ISA explicitly; GCC honours explicit -mno-* over -march.
    log "CPU has AMX: disabling llama.cpp AMX kernels"
    CMAKE_ARGS+=(-DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF)
    EXTRA_FLAGS="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
fi
if [[ -n "${EXTRA_FLAGS}" ]]; then
    CMAKE_ARGS+=("-DCMAKE_C_FLAGS=${CFLAGS:-} ${EXTRA_FLAGS}" "-DCMAKE_CXX_FLAGS=${CXXFLAGS:-} ${EXTRA_FLAGS}")
fi

BUILD="${WORK}/build"
log "configuring: cmake ${CMAKE_ARGS[*]}"
cmake -S "${SRC}" -B "${BUILD}" "${CMAKE_ARGS[@]}" > "${WORK}/configure.log" 2>&1 || {
    tail -n 40 "${WORK}/configure.log" >&2
    die "cmake configure failed (log above)"
}

# ---- build -----------------------------------------------------------------
log "building target llama-server with -j${JOBS} (takes several minutes)"
t0=$(date +%s)
cmake --build "${BUILD}" --target llama-server -j"${JOBS}" > "${WORK}/build.log" 2>&1 || {
    tail -n 60 "${WORK}/build.log" >&2
    die "build failed (log tail above)"
}
log "build took $(( $(date +%s) - t0 ))s"

BUILT="$(find "${BUILD}" -type f -name llama-server -perm -u+x | head -n1)"
[[ -n "${BUILT}" ]] || die "build finished but no llama-server binary under ${BUILD}"

# ---- install ---------------------------------------------------------------
mkdir -p "${OUT_DIR}/bin" || die "cannot create ${OUT_DIR}/bin"
install -m 0755 "${BUILT}" "${BIN}.tmp.$$"
mv -f "${BIN}.tmp.$$" "${BIN}"
"${BIN}" --version >/dev/null 2>&1 || die "installed ${BIN} does not run --version"
log "$("${BIN}" --version 2>&1 | grep -m1 -i version || true)"
echo "${BIN}"
