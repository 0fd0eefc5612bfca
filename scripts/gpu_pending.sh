#!/usr/bin/env bash
# The kernel changes that a CPU machine could only compile, on an sm_90 GPU in one call: first the GPU tests of
# the changed kernels (stop on a failure), then the dropout call timed against main's kernels in one process each
# (main's flashlab/ copied to scripts/_alt/main first: git archive main flashlab | tar -x -C scripts/_alt/main), a
# backward call's time by layout (bwd_call_profile.py: (B, N, H, D) memory's dQ scaling) and the dropout target.
# Usage: bash scripts/gpu_pending.sh OUTDIR
set -eu
out=${1:?OUTDIR}
export PYTHONPATH=$PWD
python -m pytest -q -m gpu -n 8 -x -p no:cacheprovider tests/test_backward_v6.py tests/test_variants_v6.py \
    2>&1 | tail -4
PYTHONPATH=scripts/_alt/main python scripts/dropout_time.py main "$out/dropout_main.json"
python scripts/dropout_time.py branch "$out/dropout_branch.json"
python scripts/bwd_call_profile.py "$out/bwd_call_profile.json"
FLASHLAB_AUTOTUNE=0 python -m flashlab bench --variants dropout --json "$out/variants_dropout.json"
# the packed backward's kernel against the dense one of the same shape (8 x 2048 causal, H 16): where the warps stall
for case in dense_bhsd docs; do
    /usr/local/cuda/bin/ncu --kernel-name regex:flash_bwd_kernel_v6 --launch-skip 1 --launch-count 1 \
        --section SchedulerStats --section WarpStateStats --section ComputeWorkloadAnalysis \
        --section MemoryWorkloadAnalysis python -c "
import sys, torch
sys.path.insert(0, 'scripts')
import bwd_call_profile as b
xs, f = b.$case()
o = f()
do = torch.randn_like(o)
for _ in range(2):
    torch.autograd.grad(o, xs, do, retain_graph=True)
torch.cuda.synchronize()" > "$out/ncu_$case.txt" 2>&1 || true
    grep -E "Warp Cycles Per Issued|Stall|Issue Slot|Eligible|Duration" "$out/ncu_$case.txt" | head -30
done
