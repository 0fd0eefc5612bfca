"""Record on a GPU what notebooks 04 and 05 show, so that a CPU run can show it as "recorded".

    python3 scripts/record_part2.py --out flashlab/data/h200_part2.json

Checks first (each provider against a float32 reference before it is timed; the learner's
kernel, taken from solutions/05_flash_forward.ipynb, must pass grade("flash_forward")), then
times, and prints a short table last.  Sections (each also a key of the JSON file):

  softmax   fused Triton row softmax vs torch.softmax vs five unfused torch ops: ms, GB/s, peak
  matmul    the primer's tiled matmul vs torch.matmul, fp16, 4096^3: TFLOP/s
  regs      n_regs / n_spills of the compiled softmax and forward kernels
  tflops    forward TFLOP/s vs N = 512..16384 (16k tokens, hidden 2048), D = 64 and 128, fp16,
            non-causal: naive PyTorch, the learner's kernel, flashlab, SDPA flash, SDPA cuDNN
  memory    peak memory of one forward vs N = 1k..128k (B = 1, H = 16, D = 64, fp16): naive until
            it runs out, flashlab, SDPA (default backend)
  accuracy  max |error| vs float64 of flashlab and of PyTorch's naive attention in the same dtype
"""
from __future__ import annotations

import argparse
import importlib.util
import datetime
import json
import math
import platform
import sys
import tempfile
import time
from pathlib import Path

import flashlab  # noqa: I001  (first: GPU or interpreter)
from flashlab import bench, device, hardware, reference
from flashlab.kernels import primer
import torch
import torch.nn.functional as F
import triton

ROOT = Path(__file__).resolve().parents[1]
NS = [512, 1024, 2048, 4096, 8192, 16384]
NS_MEMORY = [1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072]


def learner_kernel():
    """The kernel of solutions/05_flash_forward.ipynb (the cell that ends in grade("flash_forward", ...))."""
    nb = json.loads((ROOT / "solutions" / "05_flash_forward.ipynb").read_text())
    for cell in nb["cells"]:
        src = "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
        if cell["cell_type"] == "code" and 'grade("flash_forward"' in src:
            # the cell's code up to the grading lines at its end ("result = grade(...)", "result")
            lines = src.splitlines()
            cut = next(i for i, l in enumerate(lines) if not l.startswith((" ", "\t")) and "grade(" in l)
            body = "\n".join(lines[:cut])
            # a real file, so that @triton.jit can read the kernel's source
            path = Path(tempfile.mkdtemp()) / "learner_flash_forward.py"
            path.write_text("import flashlab\nimport math\nimport torch\nimport triton\n"
                            "import triton.language as tl\n\n" + body + "\n")
            spec = importlib.util.spec_from_file_location("learner_flash_forward", path)
            mod = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(mod)
            return mod.flash_forward
    raise SystemExit("no flash_forward cell in solutions/05_flash_forward.ipynb")


def softmax_section(do_bench):
    rows = []
    peak = hardware.peak_bandwidth(torch.cuda.get_device_name(), torch.cuda.get_device_properties(0).total_memory)

    def unfused(x):
        m = x.max(dim=1, keepdim=True).values
        e = torch.exp(x - m)
        return e / e.sum(dim=1, keepdim=True)

    for n in (1024, 4096, 16384):
        m = (1 << 26) // n                       # 2^26 elements: 256 MB in fp32, past the 50 MB L2
        x = torch.randn(m, n, device="cuda")
        y = torch.empty_like(x)
        ref = torch.softmax(x.double(), dim=1)
        for name, fn, bytes_moved in (("fused Triton", lambda: primer.softmax(x, y), 2 * x.numel() * 4),
                                      ("torch.softmax", lambda: torch.softmax(x, dim=1), 2 * x.numel() * 4),
                                      ("unfused torch ops", lambda: unfused(x), 8 * x.numel() * 4)):
            out = fn()
            out = y if out is None else out
            err = (out.double() - ref).abs().max().item()
            assert err < 1e-5, (name, err)
            ms = do_bench(fn, return_mode="median")
            rows.append(dict(provider=name, M=m, N=n, dtype="fp32", ms=ms, bytes=bytes_moved,
                             gbps=bytes_moved / (ms * 1e-3) / 1e9, max_err=err))
        del x, y, ref
        torch.cuda.empty_cache()
    return {"rows": rows, "peak_gbps": None if peak is None else peak / 1e9}


def matmul_section(do_bench):
    n = 4096
    a, b = torch.randn(n, n, device="cuda", dtype=torch.float16), torch.randn(n, n, device="cuda", dtype=torch.float16)
    c = torch.empty(n, n, device="cuda", dtype=torch.float16)
    primer.matmul(a, b, c)
    ref = a.float() @ b.float()
    err = ((c.float() - ref).abs().max() / ref.abs().max()).item()
    assert err < 1e-2, err
    out = []
    for name, fn in (("primer matmul (Triton)", lambda: primer.matmul(a, b, c)), ("torch.matmul", lambda: a @ b)):
        ms = do_bench(fn, return_mode="median")
        out.append(dict(provider=name, M=n, N=n, K=n, dtype="fp16", ms=ms, tflops=2 * n ** 3 / (ms * 1e-3) / 1e12))
    return out


def regs_section():
    out = {}
    x = torch.randn(64, 4096, device="cuda")
    y = torch.empty_like(x)
    k = primer.softmax_kernel[(64,)](x, y, 4096, *x.stride(), *y.stride(), BLOCK_N=4096, num_warps=8)
    out["softmax_kernel (BLOCK_N=4096, 8 warps)"] = _regs(k)
    from flashlab.kernels import forward_config
    from flashlab.kernels.common import LOG2E
    from flashlab.kernels.forward import flash_fwd_kernel
    for d in (64, 128):
        q = torch.randn(1, 16, 4096, d, device="cuda", dtype=torch.float16)
        o, lse = torch.empty_like(q), torch.empty(1, 16, 4096, device="cuda")
        cfg = forward_config(d, q.dtype)
        k = flash_fwd_kernel[(triton.cdiv(4096, cfg.block_m) * 16,)](   # 1-D grid: Q tiles x (B*H)
            q, q, q, o, lse, *q.stride(), *q.stride(), *q.stride(), *o.stride(), *lse.stride(),
            16, 4096, 4096, LOG2E / math.sqrt(d), CAUSAL=False, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
            HEAD_DIM=d, DOT_PRECISION="ieee", num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        out[f"flash_fwd_kernel (D={d}, {cfg.block_m}x{cfg.block_n}, {cfg.num_warps} warps)"] = _regs(k)
    return out


def _regs(compiled):
    for name in ("_init_handles",):
        if hasattr(compiled, name):
            getattr(compiled, name)()
    return {"n_regs": getattr(compiled, "n_regs", None), "n_spills": getattr(compiled, "n_spills", None)}


def tflops_section(learner):
    rows = []
    providers = ["naive", ("learner", bench.contract_provider(learner)), "flashlab", "sdpa-flash", "sdpa-cudnn"]
    for d in (64, 128):
        for n in NS:
            for r in bench.run_case(providers, n, d, torch.float16, causal=False, mode="fwd"):
                rows.append(bench.as_dicts([r])[0])
    return rows


def memory_section():
    fns = {"naive": lambda q, k, v: reference.attention_naive_torch(q, k, v, return_lse=False)[0],
           "flashlab": lambda q, k, v: flashlab.flash_attention(q, k, v),
           "SDPA": lambda q, k, v: F.scaled_dot_product_attention(q, k, v)}
    out = {name: [] for name in fns}
    for name, fn in fns.items():
        for n in NS_MEMORY:
            try:
                out[name].append([n, bench.peak_memory_forward(fn, n, 64)])
            except torch.cuda.OutOfMemoryError:
                out[name].append([n, None])
                torch.cuda.empty_cache()
                break
    return out


def accuracy_section():
    out = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    for dt in (torch.float16, torch.bfloat16):
        for causal in (False, True):
            q, k, v = (torch.randn(1, 8, 2048, 64, device="cuda", generator=gen).to(dt) for _ in range(3))
            ref = reference.attention_naive_torch(q.double(), k.double(), v.double(), causal)[0]
            ours = flashlab.flash_attention(q, k, v, causal)
            theirs = reference.attention_naive_torch(q, k, v, causal, return_lse=False)[0]
            out.append(dict(dtype=str(dt).replace("torch.", ""), causal=causal, N=2048, D=64,
                            flashlab=(ours.double() - ref).abs().max().item(),
                            torch_naive=(theirs.double() - ref).abs().max().item()))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="JSON file to write, e.g. flashlab/data/h200_part2.json")
    args = ap.parse_args()
    if device.DEVICE.type != "cuda":
        raise SystemExit("needs a CUDA GPU: this script records GPU timings")
    from triton.testing import do_bench
    from flashlab.grader import grade

    t0 = time.time()
    learner = learner_kernel()
    verdict = grade("flash_forward", learner)
    print(verdict)
    if not verdict.passed:
        raise SystemExit("the solution notebook's kernel does not pass its grader: not timing it")
    props = torch.cuda.get_device_properties(0)
    record = {
        "what": "notebooks 04 and 05, recorded by scripts/record_part2.py",
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": {"gpu": props.name, "gpu_memory_gib": round(props.total_memory / 2**30, 1),
                    "compute_capability": f"{props.major}.{props.minor}", "python": platform.python_version(),
                    "torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda},
        "command": "python3 scripts/record_part2.py --out " + args.out,
    }
    record["softmax"] = softmax_section(do_bench)
    record["matmul"] = matmul_section(do_bench)
    record["regs"] = regs_section()
    record["accuracy"] = accuracy_section()
    record["tflops"] = tflops_section(learner)
    record["memory"] = memory_section()
    record["seconds"] = round(time.time() - t0, 1)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=1))

    print(f"\n{props.name}, torch {torch.__version__}, triton {triton.__version__}, {record['seconds']} s")
    for r in record["softmax"]["rows"]:
        print(f"softmax N={r['N']:>5} {r['provider']:<18} {r['ms']:8.3f} ms {r['gbps']:7.0f} GB/s")
    for r in record["matmul"]:
        print(f"matmul 4096^3 fp16 {r['provider']:<22} {r['tflops']:6.0f} TFLOP/s")
    for k, v in record["regs"].items():
        print(f"{k}: {v}")
    for r in record["accuracy"]:
        print(f"accuracy {r['dtype']} causal={r['causal']}: flashlab {r['flashlab']:.2e}  torch {r['torch_naive']:.2e}")
    for name, pts in record["memory"].items():
        shown = (f"{n}: {'OOM' if b is None else f'{b / 2**20:.0f} MiB'}" for n, b in pts)
        print(f"memory {name:<9}: " + ", ".join(shown))
    print(bench.format_table([bench.Row(**r) for r in record["tflops"]]))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    sys.exit(main())
