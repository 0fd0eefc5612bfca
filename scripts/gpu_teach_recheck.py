"""Re-measure, on one GPU, the numbers notebooks 05-07 now quote as recorded (one script, one table at the end).

    PYTHONPATH=. python scripts/gpu_teach_recheck.py [--out teach_recheck.json] [--quick]

1. the run's ceiling: torch.matmul 4096^3 fp16 (flashlab.teaching.ceiling), once;
2. notebook 05's sweep: forward v1 (the kernel taught, launched with version="v1"), the course's solution
   kernel (solutions/05's flash_forward, as the recording's "learner" row), flashlab.flash_attention as
   shipped (its plan's version, printed), SDPA flash and cuDNN; fp16, non-causal, 16k tokens, D 64 and 128;
3. notebook 07's atomic dQ: the teaching kernel with sem="relaxed" and sem="acq_rel" against backward v2
   (two kernels), each checked first, and how many dQ bits change between runs;
4. the host cost per call (bench.overhead) and the tiny GPT's step time, SDPA against flashlab (bf16).

Every provider is checked against a float32 reference before it is timed (bench.run_case); timings are
the median of triton.testing.do_bench after a warm-up.  Needs a GPU; prints a short table last and
writes everything to --out.
"""
from __future__ import annotations

import argparse
import json
import math
import time

import torch


def solution_kernel():
    """solutions/05's flash_forward, executed from the notebook's code cells (as scripts/record_part2.py does)."""
    import nbformat
    nb = nbformat.read("solutions/05_flash_forward.ipynb", as_version=4)
    cell = next(c for c in nb.cells if c.cell_type == "code" and "def flash_forward(" in c.source)
    src = cell.source.split("result3 = grade")[0]
    import tempfile
    from pathlib import Path
    path = Path(tempfile.mkdtemp()) / "solution_flash_forward.py"
    path.write_text("import math\nimport torch\nimport triton\nimport triton.language as tl\n" + src)
    import importlib.util
    spec = importlib.util.spec_from_file_location("solution_flash_forward", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.flash_forward


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="teach_recheck.json")
    ap.add_argument("--quick", action="store_true", help="N = 1024 and 16384 only, fewer GPT steps")
    args = ap.parse_args()
    import flashlab
    from flashlab import bench, device, gpt, kernels
    from flashlab.teaching import atomic_dq, ceiling, versions
    assert device.DEVICE.type == "cuda", "this script needs a GPU"
    t0 = time.time()
    out = {"machine": {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "triton": __import__("triton").__version__},
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}

    c = ceiling.get(torch.float16)
    out["ceiling"] = {"tflops": c.tflops, "n": c.n, "dtype": c.dtype}

    def v1(q, k, v, causal):
        o, lse = torch.empty_like(q), torch.empty(q.shape[:3], device=q.device)
        kernels.launch_forward(q, k, v, o, lse, causal, q.shape[-1] ** -0.5, version="v1")
        return o

    ns = [1024, 16384] if args.quick else [512, 1024, 2048, 4096, 8192, 16384]
    sol = bench.contract_provider(solution_kernel())
    rows = []
    for d in (64, 128):
        for n in ns:
            rows += bench.as_dicts(bench.run_case(["naive", ("v1 (taught)", v1), ("solution", sol),
                                                   ("flashlab (op)", bench.provider_fn("flashlab")),
                                                   "sdpa-flash", "sdpa-cudnn"], n, d))
    out["tflops"] = rows
    out["plan"] = versions.table(None, Ns=tuple(ns))

    atomic = []
    for d, causal, n in ((64, False, 4096), (64, True, 4096), (128, False, 4096), (128, True, 4096)):
        B, H = 16384 // n, 2048 // d
        g = torch.Generator(device="cuda").manual_seed(n + d)
        q, k, v, do = (torch.randn(B, H, n, d, device="cuda", dtype=torch.float16, generator=g) for _ in range(4))
        o, lse, s = torch.empty_like(q), torch.empty(B, H, n, device="cuda"), 1 / math.sqrt(d)
        kernels.launch_forward(q, k, v, o, lse, causal, s)
        from triton.testing import do_bench
        res = {"D": d, "causal": causal, "N": n}
        grads = {}
        for name, fn in (("v2", lambda *a: kernels.launch_backward(*a, version="v2")),
                         ("relaxed", lambda *a: atomic_dq.launch_backward_atomic(*a, sem="relaxed")),
                         ("acq_rel", lambda *a: atomic_dq.launch_backward_atomic(*a, sem="acq_rel"))):
            gs = [torch.empty_like(t) for t in (q, k, v)]
            call = lambda: fn(q, k, v, o, lse, do, *gs, causal, s)  # noqa: E731
            call()
            first = gs[0].clone()
            call()
            grads[name] = first
            res[f"{name}_differ"] = (first != gs[0]).float().mean().item()
            res[f"{name}_ms"] = do_bench(call, return_mode="median")
        res["max_abs_vs_v2"] = max((grads[x].float() - grads["v2"].float()).abs().max().item() for x in ("relaxed", "acq_rel"))
        atomic.append(res)
    out["atomic"] = atomic

    out["overhead"] = [r.__dict__ for r in bench.overhead(1, 1, 128, 64, (torch.bfloat16,))]
    data = gpt.CharData(gpt.load_text(), block_size=256)
    cfg = gpt.gpu_config(data.vocab_size)
    steps = 60 if args.quick else 300
    out["gpt"] = {}
    for attn in ("sdpa", "flashlab"):
        r = gpt.train(attn, cfg, data, steps=steps, batch_size=32, dtype=torch.bfloat16, lr=1e-3, seed=0)
        out["gpt"][attn] = {"step_ms": r["step_ms"], "final_loss": r["loss"][-1], "peak_mib": r["peak_mib"]}
    out["seconds"] = time.time() - t0
    json.dump(out, open(args.out, "w"), indent=1, default=str)

    print(out["plan"])
    print(f"ceiling: {c.label}")
    print(f"{'provider':<16}{'D':>4}{'N':>7}{'TFLOP/s':>9}{'% ceil':>8}  status")
    for r in rows:
        if r["N"] in (ns[0], ns[-1]):
            print(f"{r['provider']:<16}{r['D']:>4}{r['N']:>7}{r['tflops']:>9.0f}{100 * r['tflops'] / c.tflops:>7.0f}%  {r['status']}")
    for a in atomic:
        print(f"atomic dQ D={a['D']} causal={a['causal']}: v2 {a['v2_ms']:.2f} ms, relaxed {a['relaxed_ms']:.2f} ms "
              f"({a['relaxed_ms'] / a['v2_ms']:.2f}x), acq_rel {a['acq_rel_ms']:.2f} ms ({a['acq_rel_ms'] / a['v2_ms']:.2f}x); "
              f"bits differ: relaxed {a['relaxed_differ']:.4%}, acq_rel {a['acq_rel_differ']:.4%}, v2 {a['v2_differ']:.4%}")
    print(bench.format_overhead([bench.OverheadRow(**r) for r in out["overhead"]]) if hasattr(bench, "OverheadRow") else "")
    print("GPT step (bf16, 6x6x64, context 256, batch 32): "
          + ", ".join(f"{k} {v['step_ms']:.1f} ms" for k, v in out["gpt"].items()))
    print(f"wrote {args.out} in {out['seconds']:.0f} s")
    _ = flashlab


if __name__ == "__main__":
    main()
