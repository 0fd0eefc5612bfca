#!/usr/bin/env bash
# The launch path on a GPU, in one call (docs/BENCHMARKS.md, "The launch plan and the host cost"):
# the GPU tests of the plan, the fast launch, CUDA graphs, autocast and torch.compile; the host cost per
# call beside SDPA (python -m flashlab bench --overhead); and python -m flashlab bench at one shape.
# Usage: bash scripts/gpu_launch_path.sh [bench seqlens...]   (default 4096)
set -u
export PYTHONPATH=$PWD
seqlens=${*:-4096}
python -m flashlab env | grep -E "torch|triton|gpu|compute"
t0=$SECONDS
step() { local limit=$1; shift; echo "== $* (limit ${limit}s)"; timeout "$limit" "$@" 2>&1 | tail -${TAIL:-4};
         echo "   [$((SECONDS - t0)) s]"; }
step 120 python -m pytest -q -p no:cacheprovider tests/test_plan.py -m gpu
step 60 python -m pytest -q -p no:cacheprovider tests/test_attention.py -k "gpu or autocast or cached or scale"
step 60 python -m pytest -q -p no:cacheprovider tests/test_compile.py -k "fullgraph_is_accurate or dynamic or opcheck"
step 90 python -m pytest -q -p no:cacheprovider tests/test_kernels.py -k "gpu_tuned_launch or gpu_one_pass_tuned"
TAIL=12 step 60 python -m flashlab bench --overhead
TAIL=12 step 60 python -m flashlab bench --overhead --causal true
TAIL=14 step 120 python -m flashlab bench --seqlens $seqlens --head-dims 64 --providers flashlab sdpa-flash sdpa-cudnn
