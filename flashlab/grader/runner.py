"""Inside a submission's sandbox: execute the notebook with nbclient, report cell errors.

Run as a script by the batch grader (``python -s runner.py NOTEBOOK TIMEOUT KERNEL``; its
self-test is a notebook of its own run the same way).  It is as untrusted as the notebook it runs: what it
reports (which cell raised what) only fills the table's "detail" column; verdicts
come from the grader's own comparisons (see ``protocol.py``).
"""
from __future__ import annotations

import importlib.util
import os
import socket
import sys
import time


def _protocol():
    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "protocol.py")
    spec = importlib.util.spec_from_file_location("_flashlab_protocol", here)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)          # numpy only: no torch import for the runner
    return mod


P = _protocol()


def report(kind: str, **fields) -> None:
    try:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(os.environ[P.SOCKET_ENV])
        P.send(s, dict(fields, op="event", kind=kind), timeout=10)
        s.close()
    except OSError as e:
        print(f"runner: cannot report {kind}: {e}", file=sys.stderr, flush=True)


def _last_line(text: str) -> str:
    lines = [l for l in str(text).strip().splitlines() if l.strip()]
    return lines[-1][:300] if lines else ""


def run(path: str, timeout: float, kernel_name: str) -> int:
    import nbformat
    from jupyter_client.kernelspec import KernelSpecManager
    from nbclient import NotebookClient
    from nbclient.exceptions import CellTimeoutError, DeadKernelError

    spec = KernelSpecManager().get_kernel_spec(kernel_name)
    if os.path.realpath(spec.argv[0]) != os.path.realpath(sys.executable):
        report("finished", status="crashed", detail=f"kernel spec {kernel_name} runs {spec.argv[0]}, "
                                                    f"not {sys.executable}")
        return 3
    nb = nbformat.read(path, as_version=4)

    def on_cell_executed(cell, cell_index, execute_reply):
        content = (execute_reply or {}).get("content", {})
        if content.get("status") == "error":
            report("cell_error", cell=cell_index + 1,
                   error=_last_line(f"{content.get('ename', 'Error')}: {content.get('evalue', '')}"))

    client = NotebookClient(nb, timeout=timeout, startup_timeout=min(timeout, 120), allow_errors=True,
                            kernel_name=kernel_name, on_cell_executed=on_cell_executed,
                            resources={"metadata": {"path": os.getcwd()}})
    start = time.monotonic()
    try:
        client.execute()
    except CellTimeoutError:
        report("finished", status="timed out", detail=f"a cell ran longer than {timeout:.0f} s")
        return 4
    except DeadKernelError as e:
        report("finished", status="crashed", detail=f"the kernel died: {_last_line(e)}")
        return 5
    except Exception as e:
        report("finished", status="crashed", detail=f"{type(e).__name__}: {_last_line(e)}")
        return 6
    report("finished", status="ok", detail=f"ran in {time.monotonic() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(run(sys.argv[1], float(sys.argv[2]), sys.argv[3]))
