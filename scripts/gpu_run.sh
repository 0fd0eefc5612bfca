#!/usr/bin/env bash
# Checks and timings on a GPU machine in one call.
#   bash scripts/gpu_run.sh OUTDIR tests           the whole test suite on CUDA (executed notebooks kept)
#   bash scripts/gpu_run.sh OUTDIR bench [ARGS]    peak memory at N=16384, then python -m flashlab bench ARGS
#   bash scripts/gpu_run.sh OUTDIR record          the recordings the notebooks show on a CPU (notebook 06's
#                                                  FA1/L2/autotune, the short-problem probe), then every
#                                                  lecture notebook executed for the site (15-20 minutes
#                                                  on an H200, most of it notebooks 05 and 06)
# Python packages the machine lacks may be put as wheels in .whl/ (installed into /tmp/site).
set -uo pipefail
out=${1:-.out}; what=${2:-tests}; shift 2 || true
mkdir -p "$out"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
python3 -m flashlab env | tee "$out/env.txt"
if [ "$what" = record ]; then
  python3 scripts/record_part2b.py --out "$out/h200_fa1_l2.json" 2>&1 | tee "$out/record_part2b.txt" | tail -30
  python3 scripts/small_problems.py > "$out/small_problems.txt" 2>&1; sed -n '/=== host work/,$p' "$out/small_problems.txt"
  python3 scripts/execute_for_site.py --out "$out/executed" 2>&1 | tee "$out/site.txt" | tail -15
  (cd "$out" && tar czf executed.tgz executed && rm -rf executed)   # one file: calls return a limited number
elif [ "$what" = tests ]; then
  FLASHLAB_EXECUTED_DIR="$out/executed" python3 -m pytest -q -p no:cacheprovider --durations=15 2>&1 \
    | tee "$out/pytest.txt" | tail -40
  (cd "$out" && tar czf executed.tgz executed && rm -rf executed)
else
  python3 - <<'PY' 2>&1 | tee "$out/memory.txt"
import torch
from flashlab import bench, flash_attention
for D in (64, 128):
    for causal in (False, True):
        H = 2048 // D
        p = bench.peak_memory(lambda q, k, v, c: flash_attention(q, k, v, c), 16384, D, torch.float16, 1, H, causal)
        print(f"N=16384 D={D} H={H} causal={causal}: fwd+bwd peak above inputs, grads and O: {p / 2**20:.1f} MiB "
              f"(q, k, v: {3 * H * 16384 * D * 2 / 2**20:.0f} MiB; one S: {H * 16384**2 * 2 / 2**30:.0f} GiB)")
PY
  python3 -m flashlab bench --json "$out/bench.json" "$@" 2>&1 | tee "$out/bench.txt" | tail -80
fi
