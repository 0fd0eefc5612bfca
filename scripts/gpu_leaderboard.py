"""GPU only: grade a small made-up class with ``--leaderboard`` and check the leaderboard it writes.

    python scripts/gpu_leaderboard.py OUT [--full | --quick] [--students ada,ben,...] [--no-fallback]

Builds a class in a temporary folder: each student's notebook is the course's solution notebook
(``solutions/05_flash_forward.ipynb``, ``solutions/07_backward.ipynb``) cut to its import cell and the
exercise's cell, with the kernel changed:

    ada   forward: the solution kernel with 128 x 64 tiles and 8 warps
    ben   forward: the solution kernel as it is (64 x 64); backward: the solution kernels as they are
    cat   forward: the solution kernel with 32 x 32 tiles (slow)
    dan   forward and backward: a wrapper over flashlab's own kernels (kernels.launch_forward / _backward):
          right, but not the student's kernel: the clean run (flashlab.grader.clean) refuses it, "failed"
    eve   forward: ben's kernel reading at most 2048 keys: right on the grader's cases (N <= 1024),
          wrong at the timed shapes (N >= 4096): "wrong at a timed shape", never ranked
    fox   forward: every other key tile skipped (twice as fast, wrong): fails its grade, never timed
    gil   forward: the process exits inside the function: "crashed"

then runs the real ``python -m flashlab grade CLASS --out OUT/grades --leaderboard --jobs 4`` (as root: the
sandbox; if the sandbox cannot start on this machine, it prints why and runs again with
``--isolation weak``, saying so in its output and in the figure's title; ``--no-fallback`` stops
instead), copies ``leaderboard.csv`` and ``leaderboard.png`` into OUT, checks what it expects of
them, and prints a short table last.  Shapes: N = 4096, 16384 and D = 64, 128, causal both ways
(``--full``: also N = 1024, the protocol's 12 shapes; ``--quick``: N = 4096 only).

It then calls ``leaderboard("flash_forward", fn)`` in its own process, as a learner's notebook does,
for the solution kernel at N = 4096 (``--no-notebook`` skips it).

The graded notebooks run with the interpreter's own packages and flashlab only (the grader never passes
PYTHONPATH on): nbformat, nbclient and ipykernel must be installed into that interpreter's environment.

Writes into OUT: leaderboard.csv, leaderboard.png, leaderboard_notebook.png, grades/ (grades.csv, summary.txt, results.jsonl),
grade.log (the command's output), checks.json (each check and whether it held).
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))          # this checkout's flashlab, also for the notebook run in this process
EXERCISES = "flash_forward,flash_backward"


def _cells(notebook: str):
    return [("".join(c["source"]) if isinstance(c["source"], list) else c["source"])
            for c in json.loads((ROOT / "solutions" / notebook).read_text())["cells"] if c["cell_type"] == "code"]


def _solution(src: str) -> str:
    """A solution cell as a learner who solved it would hand it in: markers gone, grade() calls gone."""
    lines = [l for l in src.splitlines() if "### BEGIN SOLUTION" not in l and "### END SOLUTION" not in l]
    return "\n".join(l for l in lines if not re.match(r"^(result\d*\s*=\s*grade\(|result\d*\s*$)", l))


def forward_source(tiles=None, warps=None, max_keys=None, skip_tiles=False, with_grade=True) -> str:
    cells = _cells("05_flash_forward.ipynb")
    src = _solution(next(c for c in cells if "def flash_forward(q, k, v, o, lse, causal)" in c))
    if tiles:
        old = "BLOCK_M, BLOCK_N = (64, 64) if q.is_cuda else (32, 32)"
        assert old in src, "the solution's tile line changed: update scripts/gpu_leaderboard.py"
        src = src.replace(old, f"BLOCK_M, BLOCK_N = {tiles}")
    if warps:
        old = "BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, HEAD_DIM=D)"
        assert src.count(old) == 1
        src = src.replace(old, f"BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, HEAD_DIM=D, num_warps={warps})")
    if max_keys:
        old = "    Nk = k.shape[2]\n"
        assert src.count(old) == 1
        src = src.replace(old, f"    Nk = min(k.shape[2], {max_keys})   # reads at most {max_keys} keys\n")
    if skip_tiles:
        old = "for start_n in range(0, hi, BLOCK_N):"
        assert src.count(old) == 1
        src = src.replace(old, "for start_n in range(0, hi, 2 * BLOCK_N):   # every other key tile")
    return src + ('\n\ngrade("flash_forward", flash_forward)\n' if with_grade else "\n")


def backward_source() -> str:
    cells = _cells("07_backward.ipynb")
    kernels = [c for c in cells if "@triton.jit" in c]
    wrapper = _solution(next(c for c in cells if "def flash_backward(" in c))
    return "\n\n".join(kernels + [wrapper]) + '\n\ngrade("flash_backward", flash_backward)\n'


IMPORTS = """import flashlab
from flashlab import device
from flashlab.grader import grade
import math
import torch
import triton
import triton.language as tl
"""

COURSE_WRAPPERS = '''import os
os.environ["FLASHLAB_FAST_LAUNCH"] = "0"    # every launch through Triton's own path (the grader counts launches)
import math
import flashlab
from flashlab import kernels
from flashlab.grader import grade


def flash_forward(q, k, v, o, lse, causal):
    kernels.launch_forward(q, k, v, o, lse, causal, 1.0 / math.sqrt(q.shape[-1]))


def flash_backward(q, k, v, o, lse, do, dq, dk, dv, causal):
    kernels.launch_backward(q, k, v, o, lse, do, dq, dk, dv, causal, 1.0 / math.sqrt(q.shape[-1]))


grade("flash_forward", flash_forward)
grade("flash_backward", flash_backward)
'''

CRASH = IMPORTS + '''
import os


def flash_forward(q, k, v, o, lse, causal):
    os._exit(3)


grade("flash_forward", flash_forward)
'''

# student -> (cells, expected leaderboard status per exercise: one, or a tuple of the acceptable ones)
CLASS = {
    "ada": ([IMPORTS, forward_source("(128, 64)", warps=8)], {"flash_forward": "ranked"}),
    "ben": ([IMPORTS, forward_source(), backward_source()], {"flash_forward": "ranked", "flash_backward": "ranked"}),
    "cat": ([IMPORTS, forward_source("(32, 32)")], {"flash_forward": "ranked"}),
    "dan": ([COURSE_WRAPPERS], {"flash_forward": "failed", "flash_backward": "failed"}),   # refused: clean run
    "eve": ([IMPORTS, forward_source(max_keys=2048)], {"flash_forward": "wrong at a timed shape"}),
    "fox": ([IMPORTS, forward_source(skip_tiles=True)], {"flash_forward": "failed"}),
    "gil": ([CRASH], {"flash_forward": ("crashed", "error")}),   # the kernel died: its run "crashed", its case "error"
}


def notebook(cells) -> str:
    return json.dumps({"cells": [{"cell_type": "code", "execution_count": None, "id": f"c{i}", "metadata": {},
                                  "outputs": [], "source": src} for i, src in enumerate(cells)],
                       "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3",
                                                   "language": "python"}},
                       "nbformat": 4, "nbformat_minor": 5}, indent=1)


def run_grade(cls, grades, args, isolation, log):
    cmd = [sys.executable, "-m", "flashlab", "grade", str(cls), "--out", str(grades), "--leaderboard",
           "--leaderboard-seqlens", *map(str, args.seqlens), "--leaderboard-dims", *map(str, args.dims),
           "--exercises", EXERCISES, "--timeout", str(args.timeout), "--memory", "unlimited", "--quiet",
           "--jobs", str(args.jobs),
           "--isolation", isolation]
    print("$ " + " ".join(cmd), flush=True)
    t0 = time.time()
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    log.write(f"$ {' '.join(cmd)}\n[exit {p.returncode} after {time.time() - t0:.0f} s]\n--- stdout\n{p.stdout}\n"
              f"--- stderr\n{p.stderr}\n")
    log.flush()
    print(f"[exit {p.returncode} after {time.time() - t0:.0f} s]", flush=True)
    return p


def learner_board(out: Path, work: Path, check) -> list:
    """What a learner sees: ``leaderboard("flash_forward", fn)`` in their own process, for the solution
    kernel (ben's), at N = 4096; its figure is OUT/leaderboard_notebook.png."""
    import importlib.util
    path = work / "my_kernel.py"                      # a file, so that @triton.jit finds the source
    path.write_text(IMPORTS + "\n" + forward_source(with_grade=False))
    spec = importlib.util.spec_from_file_location("my_kernel", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    from flashlab.grader import leaderboard
    t0 = time.time()
    board = leaderboard("flash_forward", mod.flash_forward, seqlens=(4096,), dims=(64, 128),
                        name="my kernel", verbose=False)
    print(repr(board), flush=True)
    board.figure().savefig(out / "leaderboard_notebook.png", dpi=100, bbox_inches="tight")
    mine = [e for e in board.entries if e.kind == "student"]
    check("leaderboard() in a notebook: the kernel ranks", mine and mine[0].status == "ranked",
          mine[0].status + ": " + mine[0].detail if mine else "no entry")
    check("leaderboard() in a notebook: flashlab (op) and SDPA flash timed",
          all(any(e.name == n and e.score(board.shape_labels["flash_forward"]) for e in board.entries)
              for n in ("flashlab (op)", "SDPA flash")))
    print(f"[leaderboard() in {time.time() - t0:.0f} s]", flush=True)
    return board.entries


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", help="folder for leaderboard.csv, leaderboard.png, grades/, grade.log, checks.json")
    ap.add_argument("--full", action="store_true", help="the protocol's 12 shapes (N = 1024, 4096, 16384)")
    ap.add_argument("--quick", action="store_true", help="N = 4096 only (4 shapes)")
    ap.add_argument("--students", default=",".join(CLASS), help="comma-separated subset of " + ",".join(CLASS))
    ap.add_argument("--timeout", type=int, default=480, help="seconds per notebook")
    ap.add_argument("--no-fallback", action="store_true", help="stop if the sandbox cannot start (no weak run)")
    ap.add_argument("--no-notebook", action="store_true", help="skip the learner's leaderboard() run")
    ap.add_argument("--jobs", type=int, default=4,
                    help="notebooks graded at once (these notebooks do no GPU work outside grade(), so a timed "
                         "window, which holds grade() cases back, has the GPU alone)")
    args = ap.parse_args()
    args.seqlens = [1024, 4096, 16384] if args.full else [4096] if args.quick else [4096, 16384]
    args.dims = [64, 128]
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    students = [s for s in args.students.split(",") if s]
    unknown = [s for s in students if s not in CLASS]
    if unknown:
        print(f"unknown students {unknown}; they are {', '.join(CLASS)}")
        return 2

    import torch
    if not torch.cuda.is_available():
        print("no CUDA GPU here: the leaderboard needs one (on a CPU `grade --leaderboard` only grades and says so)")
        return 2
    start = time.time()
    work = Path(tempfile.mkdtemp(prefix="flashlab-leaderboard-"))
    os.chmod(work, 0o755)
    cls = work / "class"
    cls.mkdir()
    for s in students:
        (cls / s).mkdir()
        (cls / s / "submission.ipynb").write_text(notebook(CLASS[s][0]))
    grades = out / "grades"
    shutil.rmtree(grades, ignore_errors=True)
    checks = []

    def check(name, ok, detail=""):
        checks.append({"check": name, "ok": bool(ok), "detail": str(detail)[:500]})
        print(f"{'PASS' if ok else 'FAIL'}  {name}" + (f"  ({detail})" if detail and not ok else ""), flush=True)

    isolation = "auto"
    with open(out / "grade.log", "w") as log:
        p = run_grade(cls, grades, args, "auto", log)
        if p.returncode == 2 and "error:" in p.stderr:
            why = [l for l in p.stderr.splitlines() if l.strip()][-12:]
            print("SANDBOX COULD NOT START on this machine; the grader said:\n  " + "\n  ".join(why), flush=True)
            check("the sandbox starts here", False, why[-1] if why else "")
            if args.no_fallback:
                return 1
            print("FALLBACK: grading again with --isolation weak (these are this script's own notebooks; weak "
                  "isolation runs them as this user, and the figure's title says so)", flush=True)
            isolation = "weak"
            shutil.rmtree(grades, ignore_errors=True)
            p = run_grade(cls, grades, args, "weak", log)
        else:
            check("the sandbox starts here", p.returncode != 2, p.stderr[-300:])
    print(p.stderr[-4000:], flush=True)
    summary = (grades / "summary.txt").read_text() if (grades / "summary.txt").exists() else ""
    m = re.search(r"isolation: (.*?); \d+ notebooks", summary.splitlines()[0] if summary else "")
    ran_in = m.group(1) if m else isolation
    for name in ("leaderboard.csv", "leaderboard.png"):
        if (grades / name).exists():
            shutil.copy(grades / name, out / name)
    check("grade --leaderboard exited 0", p.returncode == 0, f"exit {p.returncode}")
    check("leaderboard.csv and leaderboard.png written", (out / "leaderboard.csv").exists()
          and (out / "leaderboard.png").exists())
    rows = list(csv.DictReader(open(out / "leaderboard.csv"))) if (out / "leaderboard.csv").exists() else []
    got = {(r["exercise"], r["name"]): r for r in rows}
    for s in students:
        for ex, want in CLASS[s][1].items():
            r = got.get((ex, s))
            want = want if isinstance(want, tuple) else (want,)
            check(f"{s} {ex}: {' or '.join(want)}", r is not None and r["status"] in want,
                  f"got {r['status'] if r else 'no row'}: {r['detail'] if r else ''}")
    ranked = [r for r in rows if r["status"] == "ranked"]
    check("ranked rows have numbers in (5, 2000) TFLOP/s", ranked and all(5 < float(r["tflops_geomean"]) < 2000
                                                                           for r in ranked))
    for ex in ("flash_forward", "flash_backward"):
        ranks = sorted(int(r["rank"]) for r in ranked if r["exercise"] == ex)
        if any(CLASS[s][1].get(ex) == "ranked" for s in students):
            check(f"{ex}: ranks are 1..{len(ranks)}", ranks and ranks == list(range(1, len(ranks) + 1)), ranks)
        refs = {r["name"]: r for r in rows if r["exercise"] == ex and r["kind"] == "reference"}
        if any(e == ex for s in students for e in CLASS[s][1]):
            check(f"{ex}: references flashlab (op) and SDPA flash timed",
                  all(refs.get(n, {}).get("tflops_geomean") for n in ("flashlab (op)", "SDPA flash")), list(refs))
        # dan wraps the op's own kernels: timed through the sandbox it should land near the op timed in-process
        dan, op = got.get((ex, "dan")), refs.get("flashlab (op)")
        if dan and op and dan["tflops_geomean"] and op["tflops_geomean"]:
            ratio = float(dan["tflops_geomean"]) / float(op["tflops_geomean"])
            check(f"{ex}: dan (the op's kernels, timed in the sandbox) within 25% of the op timed in the grader",
                  0.75 < ratio < 1.25, f"ratio {ratio:.2f}")
    if "ada" in students and "cat" in students and ("flash_forward", "ada") in got and ("flash_forward", "cat") in got:
        a, c = got[("flash_forward", "ada")]["tflops_geomean"], got[("flash_forward", "cat")]["tflops_geomean"]
        check("ada (128 x 64 tiles) faster than cat (32 x 32)", a and c and float(a) > float(c), f"{a} vs {c}")
    if not args.no_notebook:
        try:
            learner_board(out, work, check)
        except Exception as e:
            check("leaderboard() in a notebook runs", False, f"{type(e).__name__}: {e}")
    (out / "checks.json").write_text(json.dumps({"isolation": ran_in, "seqlens": args.seqlens, "dims": args.dims,
                                                 "seconds": round(time.time() - start), "checks": checks},
                                                indent=1))
    shutil.rmtree(work, ignore_errors=True)

    print(f"\nisolation: {ran_in}{' (FALLBACK: the sandbox could not start)' if isolation == 'weak' else ''}; "
          f"shapes: N {args.seqlens}, D {args.dims}; {time.time() - start:.0f} s; files in {out}")
    print(f"{'exercise':<15}{'rank':>5}  {'name':<15}{'kind':<10}{'TFLOP/s':>9}  status")
    for r in rows:
        print(f"{r['exercise']:<15}{r['rank']:>5}  {r['name'][:14]:<15}{r['kind']:<10}{r['tflops_geomean']:>9}  "
              f"{r['status']}" + (f": {r['detail'][:60]}" if r["detail"] and r["status"] != "ranked" else ""))
    bad = [c for c in checks if not c["ok"]]
    print(f"checks: {len(checks) - len(bad)} of {len(checks)} held" + (": FAILED " + "; ".join(c["check"] for c in bad)
                                                                      if bad else ""))
    return 0 if not bad else 1


if __name__ == "__main__":
    sys.exit(main())
