#!/usr/bin/env bash
# Builds the ggml oracle of reference/quant_golden.py: the llama.cpp vendored by the PyPI sdist of
# llama-cpp-python 0.3.36 (upstream ggml-org/llama.cpp commit 0c1e57098, per its CHANGELOG), as a
# shared Release build, so that DEST/build/bin/libggml-base.so can be loaded through ctypes.
#
#   reference/build_llama_cpp.sh DEST [PYTHON]
#
# DEST receives venv/ (scikit-build-core and cmake from PyPI), the sdist, its unpacked tree and
# build/. Idempotent: every step is skipped when its output already exists, and the final cmake
# build is incremental. JOBS (default 2) sets the build parallelism. Never run by CI.
#
# Then: reference/quant_golden.py --out golden --ggml-lib DEST/build/bin/libggml-base.so
#       reference/llama_golden.py --out golden --llama-dest DEST   (also uses DEST/build/bin/llama-perplexity)
set -euo pipefail

VERSION=0.3.36
UPSTREAM=0c1e57098

DEST=${1:?usage: $0 DEST [PYTHON]}
PYTHON=${2:-python3}
JOBS=${JOBS:-2}
mkdir -p "$DEST"
DEST=$(cd "$DEST" && pwd)

# 1. A virtual environment with the sdist's build backend and cmake.
if [ ! -x "$DEST/venv/bin/python" ]; then
    "$PYTHON" -m venv "$DEST/venv"
fi
if [ ! -x "$DEST/venv/bin/cmake" ] || ! "$DEST/venv/bin/python" -c 'import scikit_build_core' 2>/dev/null; then
    "$DEST/venv/bin/python" -m pip install --quiet scikit-build-core cmake
fi
CMAKE="$DEST/venv/bin/cmake"

# 2. The source distribution (no wheel, no build isolation: the backend comes from the venv).
SDIST="$DEST/llama_cpp_python-$VERSION.tar.gz"
if [ ! -f "$SDIST" ]; then
    mkdir -p "$DEST/download"
    "$DEST/venv/bin/python" -m pip download --quiet --no-deps --no-binary :all: --no-build-isolation \
        -d "$DEST/download" "llama-cpp-python==$VERSION"
    mv "$DEST/download/llama_cpp_python-$VERSION.tar.gz" "$SDIST"
    rmdir "$DEST/download" 2>/dev/null || true
fi
SRC="$DEST/llama_cpp_python-$VERSION"
if [ ! -d "$SRC/vendor/llama.cpp/ggml" ]; then
    tar -xzf "$SDIST" -C "$DEST"
fi
if ! grep -q "llama.cpp@$UPSTREAM" "$SRC/CHANGELOG.md"; then
    echo "warning: $SRC/CHANGELOG.md does not name upstream commit $UPSTREAM" >&2
fi

# 3. Configure and build (shared libraries; the quantizer tools and tests as a sanity check; the
#    perplexity, bench and simple-generation tools for reference/llama_golden.py and speed anchors,
#    llama-server for reference/llama_server_fixtures.py).
if [ ! -f "$DEST/build/CMakeCache.txt" ]; then
    "$CMAKE" -S "$SRC/vendor/llama.cpp" -B "$DEST/build" \
        -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_UI=OFF \
        -DLLAMA_USE_PREBUILT_UI=OFF -DBUILD_SHARED_LIBS=ON -DLLAMA_BUILD_TESTS=ON -DGGML_OPENMP=OFF
fi
"$CMAKE" --build "$DEST/build" -j"$JOBS" --target llama-quantize test-quantize-perf test-quantize-fns \
    llama-perplexity llama-bench llama-simple llama-server

LIB="$DEST/build/bin/libggml-base.so"
test -f "$LIB" || { echo "error: $LIB was not built" >&2; exit 1; }
echo "oracle ready: $LIB"
