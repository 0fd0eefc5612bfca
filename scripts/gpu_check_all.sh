#!/usr/bin/env bash
# The GPU checks and timings of every part of the package, in two calls of a few minutes each
# (docs/BENCHMARKS.md says which run each recorded number comes from):
#   bash scripts/gpu_check_all.sh OUTDIR a    the op's launch path: every gpu-marked test of the plan, the kernels,
#                                             the op, torch.compile and CUDA graphs; the host cost per call beside
#                                             SDPA; split-KV decoding's tests and benchmark
#   bash scripts/gpu_check_all.sh OUTDIR b    the variants' tests on the GPU; ring attention's one-GPU step timings;
#                                             python -m flashlab bench at N = 4096 beside SDPA's backends
#   bash scripts/gpu_check_all.sh OUTDIR c    the class leaderboard (scripts/gpu_leaderboard.py); then, in parallel,
#                                             the variants', decoding's and the ring's tests and every solution
#                                             notebook on the GPU; then notebook 04 executed for the site, ring
#                                             attention's step timings, decoding beside SDPA and Flex, the tiny
#                                             call's host profile (pytest-xdist and the notebook packages needed,
#                                             installed INTO the interpreter's environment, e.g. `python3 -m pip
#                                             install --no-index --no-deps .whl/*.whl`: graded notebooks run with
#                                             the interpreter's own packages and flashlab, never PYTHONPATH)
# Each step has a time limit; its last lines are printed, its whole output kept in OUTDIR.
set -u
out=${1:-.out}; part=${2:-a}
mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
t0=$SECONDS
step() {   # step NAME LIMIT CMD...
  local name=$1 limit=$2; shift 2
  echo "== $name (limit ${limit} s): $*"
  timeout "$limit" "$@" > "$out/$name.txt" 2>&1; local rc=$?
  tail -n "${TAIL:-6}" "$out/$name.txt"; echo "   rc $rc, [$((SECONDS - t0)) s]"
}
python3 -m flashlab env > "$out/env.txt" 2>&1; grep -iE "torch|triton|gpu" "$out/env.txt" | head -4
if [ "$part" = a ]; then
  step gpu_tests 230 python3 -m pytest -q -p no:cacheprovider -x -m gpu tests/test_plan.py tests/test_gpu.py \
    tests/test_attention.py tests/test_compile.py tests/test_kernels.py tests/test_decode.py
  TAIL=14 step overhead 70 python3 -m flashlab bench --overhead
  TAIL=14 step overhead_demo 70 python3 -m flashlab bench --overhead --overhead-shape 1,16,1024,64 --causal true
  TAIL=30 step decode 60 python3 scripts/bench_decode.py --json "$out/bench_decode.json"
elif [ "$part" = c ]; then
  TAIL=25 step leaderboard 170 python3 scripts/gpu_leaderboard.py "$out/lb"
  echo "== in parallel: tests (variants, decode, ring) and the solution notebooks on the GPU (limit 150 s)"
  timeout 150 python3 -m pytest -q -p no:cacheprovider -n 6 tests/test_variants.py tests/test_decode.py \
    tests/test_ring.py > "$out/gpu_tests.txt" 2>&1 &
  timeout 150 python3 -m pytest -q -p no:cacheprovider -n 5 tests/test_notebooks.py -k test_solution_passes \
    > "$out/gpu_solutions.txt" 2>&1 &
  wait
  tail -n 4 "$out/gpu_tests.txt"; tail -n 4 "$out/gpu_solutions.txt"; echo "   [$((SECONDS - t0)) s]"
  TAIL=3 step site04 30 python3 scripts/execute_for_site.py --out "$out/executed" notebooks/04_triton_primer.ipynb
  TAIL=12 step ring_steps 45 python3 scripts/ring_bench.py --ns 4096 16384 --out "$out/h200_ring.json"
  TAIL=30 step decode 55 python3 scripts/bench_decode.py --json "$out/bench_decode.json"
  TAIL=40 step host_profile 25 python3 scripts/host_profile.py --out "$out/host_profile.txt"
else
  step variants_tests 130 python3 -m pytest -q -p no:cacheprovider tests/test_variants.py tests/test_ring.py
  TAIL=30 step ring_steps 60 python3 scripts/ring_bench.py --ns 4096 16384 --out "$out/h200_ring.json"
  TAIL=30 step bench 100 python3 -m flashlab bench --seqlens 4096 --dtypes bf16 --providers flashlab sdpa-flash \
    sdpa-cudnn --json "$out/bench.json"
fi
echo "total $((SECONDS - t0)) s"
