"""Command line: python -m flashlab {env,bench,demo,grade,assign}."""
from __future__ import annotations

import argparse
import json
import sys


def _env(args):
    from . import device
    device.print_report()
    return 0


def _bench(args):
    import torch

    from . import device
    device.require_triton("python -m flashlab bench")

    from . import bench
    dtypes = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
    rows = []
    for mode in args.modes:
        for dt in args.dtypes:
            for D in args.head_dims:
                for causal in args.causal:
                    for N in args.seqlens:
                        rows += bench.run_case(args.providers, N, D, dtypes[dt], causal, mode)
                        print(bench.format_table(rows[-len(args.providers):]).split("\n", 2)[-1], flush=True)
    print()
    print(bench.format_table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(bench.as_dicts(rows), f, indent=1)
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flashlab", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("env", help="print the environment report (GPU or interpreter, versions)")
    p.set_defaults(func=_env)

    from . import device
    if device.TRITON:
        from .bench import PROVIDERS
    else:  # bench imports the kernels: without Triton, `bench` says what is missing
        PROVIDERS = ()
    p = sub.add_parser("bench", help="time flashlab against SDPA's backends (needs a GPU)")
    p.add_argument("--providers", nargs="+", default=list(PROVIDERS[:5]), choices=PROVIDERS or None)
    p.add_argument("--seqlens", nargs="+", type=int, default=[512, 1024, 2048, 4096, 8192, 16384])
    p.add_argument("--head-dims", nargs="+", type=int, default=[64, 128])
    p.add_argument("--dtypes", nargs="+", default=["fp16"], choices=["fp16", "bf16", "fp32"])
    p.add_argument("--modes", nargs="+", default=["fwd", "bwd"], choices=["fwd", "bwd"])
    p.add_argument("--causal", nargs="+", type=lambda s: s.lower() in ("1", "true", "yes"), default=[False, True])
    p.add_argument("--json", help="also write the rows to this JSON file")
    p.set_defaults(func=_bench)

    from . import demo
    demo.add_command(sub)

    from .grader import cli as grader_cli
    grader_cli.add_commands(sub)

    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except device.TritonMissing as e:   # a laptop without Triton: say so, no traceback
        print(e, file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
