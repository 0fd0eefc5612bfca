#!/usr/bin/env bash
# The oldest torch / triton pair the README names, checked: a fresh virtual environment with that pair
# (PyPI's Linux torch wheels are CUDA builds: about 5 GB installed with their nvidia-* packages, so this is
# not part of CI), the rest of requirements.txt without torch and triton, flashlab editable, then the
# interpreter tests of the kernels, the op, the plan and the variants.  No GPU needed.
#
#   scripts/check_floor.sh [TORCH_VERSION] [TRITON_VERSION] [VENV_DIR]    (defaults: 2.6.0 3.2.0, a temporary dir)
#
# Triton 3.2's interpreter turns one-element arrays into Python ints, which NumPy 2.4 refuses
# ("only 0-dimensional arrays can be converted to Python scalars"), so NumPy stays below 2.4 here.
set -euo pipefail
cd "$(dirname "$0")/.."
torch_v=${1:-2.6.0}
triton_v=${2:-3.2.0}
venv=${3:-$(mktemp -d)/venv}
python3 -m venv "$venv"
py="$venv/bin/python"
"$py" -m pip install -q "torch==$torch_v" "triton==$triton_v"
"$py" -m pip install -q "numpy<2.4" matplotlib ipywidgets nbformat nbclient ipykernel pytest hypothesis tqdm
"$py" -m pip install -q --no-deps -e .
"$py" -m flashlab env
timeout 1500 "$py" -m pytest -q -p no:cacheprovider -m "not gpu" -W "ignore::DeprecationWarning" \
    tests/test_kernels.py tests/test_attention.py tests/test_plan.py tests/test_variants.py
