"""Command line: python -m flashlab {env,plan,bench,demo,grade,assign}."""
from __future__ import annotations

import argparse
import dataclasses
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

    if args.variants:
        from . import bench_variants
        argv = ([] if args.variants == "all" else ["--only", args.variants]) + (["--json", args.json] if args.json
                                                                                 else [])
        return bench_variants.main(argv + (["--no-check"] if args.no_check else []))
    from . import bench
    dtypes = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
    if args.overhead:
        B, H, N, D = (int(x) for x in args.overhead_shape.split(","))
        rows = []
        for causal in args.causal if args.causal_given else [False]:
            rows += bench.overhead(B, H, N, D, [dtypes[d] for d in (args.dtypes if args.dtypes_given else
                                                                      ["fp16", "bf16"])], causal, args.calls)
        print(bench.format_overhead(rows))
        from .kernels import tiles
        print(f"flashlab's launches: {tiles.STATS['fast']} through the compiled kernels' runners, "
              f"{tiles.STATS['jit']} through Triton's launch path")
        if args.json:
            with open(args.json, "w") as f:
                json.dump([bench.asdict(r) for r in rows], f, indent=1)
        return 0
    rows = []
    for mode in args.modes:
        for dt in args.dtypes:
            for D in args.head_dims:
                for causal in args.causal:
                    for N in args.seqlens:
                        rows += bench.run_case(args.providers, N, D, dtypes[dt], causal, mode)
                        print(bench.format_table(rows[-len(args.providers):]).split("\n", 2)[-1], flush=True)
                        if args.json:   # after every case: a run stopped by a time limit keeps its rows
                            with open(args.json, "w") as f:
                                json.dump(bench.as_dicts(rows), f, indent=1)
    print()
    print(bench.format_table(rows))
    return 0


def _plan_variant(args, H: int):
    """The plan's Variant from the variant flags (ValueError naming the flag on bad input)."""
    from .kernels import plan as P
    groups = 1
    if args.gqa is not None:
        if args.gqa < 1 or H % args.gqa:
            raise ValueError(f"--gqa takes the number of K/V heads, a divisor of H = {H}; got {args.gqa}")
        groups = H // args.gqa
    window = None
    if args.window is not None:
        try:
            left, right = (int(x) for x in args.window.split(","))
        except ValueError:
            raise ValueError(f"--window must be L,R (two ints, -1 unbounded), e.g. 1023,0; got {args.window!r}")
        if left < -1 or right < -1:
            raise ValueError(f"--window takes ints >= 0, or -1 for unbounded; got {args.window!r}")
        window = (left, right)
    if args.dropout is not None and not 0.0 <= args.dropout < 1.0:
        raise ValueError(f"--dropout takes a probability in [0, 1), got {args.dropout}")
    mask = {None: None, "bool": "bool", "float": "additive"}[args.mask]
    return P.Variant(kv_groups=groups, window=window, softcap=args.softcap, alibi=args.alibi, mask=mask,
                     dropout=bool(args.dropout), varlen=args.varlen)


def _plan(args):
    import torch

    from . import device
    device.require_triton("python -m flashlab plan")
    from .kernels import plan as P
    try:
        B, H, N, D = (int(x) for x in args.shape.split(","))
    except ValueError:
        print(f"--shape must be B,H,N,D (four integers), got {args.shape!r}", file=sys.stderr)
        return 2
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    if args.fp8:
        dtype = P.FP8_DTYPE
    facts = P.device_facts() if args.device == "here" else P.SIMULATED[args.device]
    here = P.device_facts()
    if args.device != "here":   # a simulated GPU with this Triton: its tensor descriptors or their absence
        facts = dataclasses.replace(facts, host_descriptors=here.host_descriptors,
                                    device_descriptors=here.device_descriptors)
    notes = []
    dk = P.kernel_head_dim(D)
    if args.fp8:                 # an FP8 tensor-core product sums over at least 32 elements
        dk = max(dk, 32)
    if dk != D:
        notes.append(f"head dim {D} is zero-padded to {dk} for the kernels")
    if args.fp8:
        notes.append("fp8: Q, K, V in e4m3 with one scale per (batch, head), V transposed; O in the inputs' dtype "
                     "(flash_attention(..., fp8=True) quantises them)")
    if dtype == torch.bfloat16 and facts.interpret:
        dtype = torch.float32
        notes.append("bf16 runs as fp32 in the interpreter (its bf16 tl.dot is wrong); the output is bf16")
    layout = P.Layout(tma=not args.no_tma, no_zero_stride=not args.kv_expanded)
    try:
        variant = _plan_variant(args, H)
    except ValueError as e:
        print(e, file=sys.stderr)
        return 2
    if variant.varlen:
        notes.append("packed sequences: B is the number of sequences, N (and --nk) the longest")
    if variant.features() and args.kv_expanded:
        notes.append("--kv-expanded changes nothing for the variant kernels (plain pointers)")
    try:
        p = P.plan(B, H, N, args.nk or N, dk, dtype, args.causal, layout=layout, facts=facts,
                   deterministic=args.deterministic or None, variant=variant)
    except ValueError as e:      # e.g. the FP8 forward on a GPU without FP8 tensor cores
        print(e, file=sys.stderr)
        return 2
    print(p)
    for n in notes:
        print("  note:", n)
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flashlab", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("env", help="print the environment report (GPU or interpreter, versions)")
    p.set_defaults(func=_env)

    p = sub.add_parser("plan", help="print the launch plan: which kernels, tiles and grids run for a shape, and why")
    p.add_argument("--shape", required=True, help="B,H,N,D (N: the query length)")
    p.add_argument("--nk", type=int, help="key length (default: N)")
    p.add_argument("--causal", action="store_true")
    p.add_argument("--dtype", default="fp16", choices=["fp16", "bf16", "fp32"])
    p.add_argument("--device", default="here", choices=["here", "t4", "l4", "a100", "h200"],
                   help="plan for this machine (default) or for a simulated GPU")
    p.add_argument("--kv-expanded", action="store_true", help="K, V expanded over heads (a stride 0)")
    p.add_argument("--no-tma", action="store_true", help="strides that tensor descriptors cannot take")
    p.add_argument("--deterministic", action="store_true", help="as under torch.use_deterministic_algorithms")
    p.add_argument("--fp8", action="store_true", help="the FP8 forward (e4m3 Q, K, V; forward only; cc >= 8.9)")
    v = p.add_argument_group("variants (forward v4 / backward v5, or v6 where the plan runs it)")
    v.add_argument("--gqa", type=int, metavar="H_KV", help="grouped-query attention with H_KV K/V heads")
    v.add_argument("--window", metavar="L,R", help="sliding window (left, right), -1 unbounded, e.g. 1023,0")
    v.add_argument("--softcap", action="store_true", help="soft-capped scores (c * tanh(s / c))")
    v.add_argument("--alibi", action="store_true", help="ALiBi biases")
    v.add_argument("--mask", choices=["bool", "float"], help="an attention mask: boolean or additive (float)")
    v.add_argument("--dropout", type=float, metavar="P", help="dropout probability")
    v.add_argument("--varlen", action="store_true", help="packed sequences (B sequences of at most N tokens)")
    p.set_defaults(func=_plan)

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
    p.add_argument("--overhead", action="store_true",
                   help="host cost instead: wall clock per call, back to back, at a tiny shape, beside SDPA "
                        "(fwd and fwd+bwd; default fp16 and bf16, non-causal)")
    p.add_argument("--overhead-shape", default="1,1,128,64", help="B,H,N,D for --overhead")
    p.add_argument("--calls", type=int, default=2000, help="back-to-back calls per repeat for --overhead")
    p.add_argument("--variants", nargs="?", const="all", metavar="NAMES",
                   help="the attention variants instead (GQA, window, packed documents, soft-cap, padding mask, "
                        "dropout; a comma-separated subset, default all) beside FlexAttention and SDPA at notebook "
                        "08's shapes, each checked against float64 first; the targets' table last")
    p.add_argument("--no-check", action="store_true", help="with --variants: skip the float64 checks")
    p.set_defaults(func=_bench)

    from . import demo
    demo.add_command(sub)

    from .grader import cli as grader_cli
    grader_cli.add_commands(sub)

    argv = sys.argv[1:] if argv is None else list(argv)
    given, argv = iter(sys.argv[1:] if argv is None else argv), []
    for a in given:      # "--window -1,64": argparse takes a value that starts with "-" for a flag
        nxt = next(given, None) if a == "--window" else None
        argv.append(a if nxt is None else f"--window={nxt}")
    args = parser.parse_args(argv)
    args.causal_given, args.dtypes_given = "--causal" in argv, "--dtypes" in argv
    try:
        return args.func(args)
    except device.TritonMissing as e:   # a laptop without Triton: say so, no traceback
        print(e, file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
