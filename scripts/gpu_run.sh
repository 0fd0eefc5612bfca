#!/usr/bin/env bash
# One GPU session's worth of checks and timings: the test suite on CUDA, then the benchmark.
# Usage: bash scripts/gpu_run.sh OUTDIR [bench args...]
set -uo pipefail
out=${1:-.out}; shift || true
mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
python3 -m flashlab env | tee "$out/env.txt"
python3 -m pytest -q -x -p no:cacheprovider tests/test_attention.py tests/test_gpu.py tests/test_reference.py 2>&1 | tail -30 | tee "$out/pytest.txt"
python3 - <<'PY' 2>&1 | tee "$out/memory.txt"
import torch
from flashlab import bench, flash_attention
from flashlab.reference import attention_naive_torch
for D in (64, 128):
    for causal in (False, True):
        p = bench.peak_memory(lambda q, k, v, c: flash_attention(q, k, v, c), 16384, D, torch.float16, 1, 2048 // D, causal)
        print(f"peak fwd+bwd above inputs/outputs, N=16384 D={D} H={2048//D} causal={causal}: {p/2**20:.1f} MiB "
              f"(inputs {3*2048*16384*2/2**20:.0f} MiB; one S would be {(2048//D)*16384**2*2/2**30:.1f} GiB)")
PY
python3 -m flashlab bench --json "$out/bench.json" "$@" 2>&1 | tee "$out/bench.txt"
