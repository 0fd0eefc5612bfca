"""The attention variants beside FlexAttention and SDPA: ``python -m flashlab bench --variants`` (flashlab/bench_variants.py
says what it runs).

    python scripts/bench_variants.py [--quick] [--json out.json] [--only gqa,window,...] [--no-check]
"""
import sys

sys.path.insert(0, ".")
from flashlab.bench_variants import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
