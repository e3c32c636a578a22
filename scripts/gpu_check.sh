#!/usr/bin/env bash
# Everything a machine with a GPU should run, in one go:
#   1. the build with the CUDA kernels (FUSIONRING_CUDA=on), in place;
#   2. what is there: the GPU, torch, nvcc, NCCL through CuPy (hvd.nccl_built());
#   3. the GPU tests: the kernels bit-equal to the CPU's (the cluster quantizer's torch
#      kernels to a last bit of a mean, and free of host synchronization), world-size-1 NCCL
#      collectives, a training step with each compressor and selector against the host, the
#      DDP hooks on an NCCL group, a parameter-server worker with a GPU model, two ranks on
#      one GPU refused, and on a machine of several GPUs the multi-rank tests;
#   4. examples/synthetic_benchmark.py on the GPU (one rank);
#   5. scripts/bench_gpu.py: kernel throughput against a device copy, the allreduce on the GPU
#      against staged through host memory, and host-device copies in a profiled training step
#      with each compressor (docs/benchmarks/gpu.md).
# Logs and the report go to $OUT (default /tmp/gpu_check) as well.
#
# Needs torch with CUDA, CuPy (pip install "fusionring[gpu]", or any cupy-cuda1Nx with its
# NCCL), mpi4py with an MPI, cmake, pybind11 and nvcc. On a machine that cannot fetch
# packages, put the missing wheels in .whl/ first; they are installed into /tmp/site. MPICH's
# wheel brings mpicxx, mpiexec and libmpi (13 MB), fetched elsewhere with e.g.
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_28_x86_64 -d .whl mpich
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/gpu_check}
mkdir -p "$out"
python=${PYTHON:-python3}
status=0

if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
    "$python" -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
    export PATH=/tmp/site/bin:$PATH
    export LD_LIBRARY_PATH=/tmp/site/lib:${LD_LIBRARY_PATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-}
export PYTHONUNBUFFERED=1

echo "== 1. build with CUDA"
FUSIONRING_CUDA=${FUSIONRING_CUDA:-on} "$python" setup.py -q build_ext --inplace >"$out/build.log" 2>&1 || {
    tail -40 "$out/build.log"; echo "build failed"; exit 1; }

echo "== 2. what is there"
nvidia-smi -L || true
command -v nvcc >/dev/null && nvcc --version | tail -1
"$python" - <<'EOF' | tee "$out/env.txt"
import torch, fusionring
from fusionring import _C
import fusionring.torch as hvd
print("torch", torch.__version__, "cuda", torch.version.cuda, "gpus", torch.cuda.device_count(),
      torch.cuda.get_device_name() if torch.cuda.is_available() else "-")
print("fusionring", fusionring.__version__, "nm_cuda_built", getattr(_C, "nm_cuda_built", False),
      "nccl_built", hvd.nccl_built())
EOF

echo "== 3. GPU tests"
"$python" -m pytest -q -rs tests/test_nccl.py tests/test_nm.py tests/test_compressed_ring_ranks.py \
    tests/test_cluster_kernels.py \
    2>&1 | tee "$out/tests.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

echo "== 4. a Horovod-style script on the GPU"
mpiexec -n 1 "$python" examples/synthetic_benchmark.py --num-iters 2 2>&1 | tee "$out/example.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

echo "== 5. benchmark"
"$python" scripts/bench_gpu.py --output docs/benchmarks/gpu.md 2>&1 | tee "$out/bench.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
cp docs/benchmarks/gpu.md docs/benchmarks/gpu.png docs/benchmarks/gpu.json "$out"/ 2>/dev/null
exit $status
