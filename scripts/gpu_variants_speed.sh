#!/usr/bin/env bash
# The attention variants on a GPU in one call (docs/BENCHMARKS.md): (a) every variant, forward and backward,
# against float64 (the run stops on a mismatch), (b) flashlab beside FlexAttention and SDPA at the issue's
# shapes, (c) the targets, printed last.  Hand-picked tiles (FLASHLAB_AUTOTUNE=0), as the issue's
# numbers were measured; about 4-5 minutes on an H200 with a cold compile cache.
# Usage: bash scripts/gpu_variants_speed.sh [out.json]    (default: variants_speed.json)
set -u
export PYTHONPATH=$PWD
out=${1:-variants_speed.json}
python -m flashlab env | grep -E "torch|triton|gpu|compute"
FLASHLAB_AUTOTUNE=0 python -m flashlab bench --variants --json "$out"
