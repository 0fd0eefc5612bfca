"""Execute the lecture notebooks on a GPU and keep the executed copies for the course site.

    python scripts/execute_for_site.py [--out docs/site/executed] [--timeout 1800] [NOTEBOOK ...]

Run from a clone on a CUDA machine (no install needed: the repository is put on the kernels'
PYTHONPATH). Needs, besides torch and triton: numpy, matplotlib, tqdm, hypothesis, ipywidgets,
nbformat, nbclient, ipykernel. Checks those and the GPU first (``--allow-cpu`` runs it through the
interpreter instead, to try the script), executes each notebook of notebooks/ (or the ones named)
top to bottom, and writes OUT/NAME.ipynb with its outputs, its widgets' state and a run record
(``metadata.flashlab_run``: GPU, versions, date) that the site's pages quote. A notebook that fails
is written to build/site-failed/ instead, never to OUT. Prints a table last: time, figures and size
per notebook. Then: ``python scripts/build_site.py`` shows them.
"""
from __future__ import annotations

import argparse
import datetime
import importlib.util
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NEEDED = ["numpy", "matplotlib", "tqdm", "hypothesis", "ipywidgets", "nbformat", "nbclient", "ipykernel", "torch", "triton"]
IMAGE_MIMES = ("image/png", "image/jpeg", "image/svg+xml", "image/gif")
# Warnings of the machine, not of the course, dropped from the pages (they also name its install paths):
# PyTorch's note that autograd's thread had no CUDA context yet before its first cuBLAS call, and its
# profiler's note that it clears events after each cycle (each with the source line it points at).
MACHINE_NOISE = ("UserWarning: Attempting to run cuBLAS, but there was no current CUDA context",
                 "return Variable._execution_engine.run_backward(",
                 "UserWarning: Warning: Profiler clears events at the end of each cycle", "  _warn_once(\n")


def drop_machine_noise(nb) -> int:
    """Remove MACHINE_NOISE lines from the stderr outputs of ``nb`` (and outputs left empty); returns how many lines."""
    dropped = 0
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        kept = []
        for o in cell.get("outputs", []):
            if o.get("output_type") == "stream" and o.get("name") == "stderr":
                lines = o["text"].splitlines(keepends=True)
                clean = [ln for ln in lines if not any(m in ln or m == ln for m in MACHINE_NOISE)]
                dropped += len(lines) - len(clean)
                if not "".join(clean).strip():
                    continue
                o["text"] = "".join(clean)
            kept.append(o)
        cell["outputs"] = kept
    return dropped


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("notebooks", nargs="*", type=Path, help="default: every notebooks/*.ipynb")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "site" / "executed")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per cell")
    ap.add_argument("--allow-cpu", action="store_true", help="run without a GPU (Triton's interpreter, small sizes)")
    args = ap.parse_args(argv)

    # 1. check: the packages, then the device
    missing = [m for m in NEEDED if importlib.util.find_spec(m) is None]
    if missing:
        print(f"missing packages: {' '.join(missing)}  (pip install {' '.join(missing)})")
        return 2
    os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
    sys.path.insert(0, str(ROOT))
    from flashlab import device  # noqa: E402  (before anything imports triton)
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError, CellTimeoutError, DeadKernelError

    record = device.report()
    print(device.format_report(record), flush=True)
    if record["device"] != "cuda" and not args.allow_cpu:
        print("no CUDA GPU here: the site's outputs should come from a GPU (use --allow-cpu to try the script anyway)")
        return 2

    paths = [p.resolve() for p in args.notebooks] or sorted((ROOT / "notebooks").glob("*.ipynb"))
    out, failed_dir = args.out.resolve(), ROOT / "build" / "site-failed"
    out.mkdir(parents=True, exist_ok=True)

    # 2. execute, one notebook at a time, in its own kernel
    rows = []
    for path in paths:
        nb = nbformat.read(path, as_version=4)
        client = NotebookClient(nb, timeout=args.timeout, kernel_name="python3", store_widget_state=True,
                                resources={"metadata": {"path": str(path.parent)}})
        print(f"{path.name} ...", flush=True)
        t0, status = time.perf_counter(), "ok"
        try:
            client.execute()
        except (CellExecutionError, CellTimeoutError, DeadKernelError) as e:
            status = f"FAILED: {type(e).__name__}: {str(e).strip().splitlines()[-1][:120] if str(e).strip() else ''}"
        seconds = time.perf_counter() - t0
        nb.metadata["flashlab_run"] = {**record, "how": "by scripts/execute_for_site.py", "seconds": round(seconds, 1),
                                       "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
        dest = out / path.name if status == "ok" else failed_dir / path.name
        dest.parent.mkdir(parents=True, exist_ok=True)
        drop_machine_noise(nb)
        nbformat.write(nb, dest)
        figures = sum(1 for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
                      if o.output_type in ("display_data", "execute_result") and any(m in o.get("data", {}) for m in IMAGE_MIMES))
        rows.append((path.name, status, seconds, figures, dest.stat().st_size / 1024, dest))
        print(f"{path.name}: {status}, {seconds:.1f} s -> {dest}", flush=True)

    # 3. the table
    print()
    print(f"executed on {record.get('gpu') or 'CPU (interpreter)'}, torch {record['torch']}, triton {record['triton']}")
    width = max(len(r[0]) for r in rows)
    print(f"| {'notebook':<{width}} | status | seconds | figures | size (KiB) |")
    print(f"|{'-' * (width + 2)}|--------|---------|---------|------------|")
    for name, status, seconds, figures, kib, _ in rows:
        print(f"| {name:<{width}} | {status[:6]:<6} | {seconds:>7.1f} | {figures:>7} | {kib:>10.0f} |")
    total = sum(r[4] for r in rows if r[1] == "ok")
    print(f"total written to {out}: {total / 1024:.1f} MiB")
    for name, status, *_, dest in rows:
        if status != "ok":
            print(f"{name}: {status} (partial copy: {dest})")
    return 0 if all(r[1] == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
