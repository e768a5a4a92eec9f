#!/usr/bin/env bash
# The device half of `cargo xtask gpu`: runs the bundled GPU bench (conformance suite on CUDA,
# then the benches) on a machine with an NVIDIA GPU, and keeps its output in $OUT/gpu.log when
# OUT is set (the device tool's output folder). The bundle beside this script holds the bench
# binary (xz-compressed) and the shared libraries of its static LLVM that such a machine may
# lack.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
bin="$here/gpu_bench"
if [[ ! -x "$bin" ]]; then
    python3 -c "import lzma,shutil,sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2],'wb'))" \
        "$here/gpu_bench.xz" "$bin"
    chmod +x "$bin"
fi
cuda_libs=$( (ls -d /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib /usr/local/nvidia/lib64 2>/dev/null || true) | tr "\n" ":")
export LD_LIBRARY_PATH="$here/lib:${cuda_libs}${LD_LIBRARY_PATH:-}"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,clocks.max.mem,driver_version --format=csv,noheader || true
log="${OUT:-/tmp}/gpu.log"
"$bin" "$@" 2>&1 | tee "$log"
