"""Execute one notebook, keeping the executed copy even if a cell fails or times out.

    python scripts/run_notebook.py NOTEBOOK OUT.ipynb [CELL_TIMEOUT_S]

Prints each code cell's wall time, so a slow cell is easy to find.
"""
import sys
import time

import nbformat
from nbclient import NotebookClient

src, dst = sys.argv[1], sys.argv[2]
timeout = float(sys.argv[3]) if len(sys.argv) > 3 else 600
nb = nbformat.read(src, as_version=4)
client = NotebookClient(nb, timeout=timeout, kernel_name="python3")
t0 = time.time()
try:
    with client.setup_kernel():
        for i, cell in enumerate(nb.cells):
            if cell.cell_type != "code":
                continue
            start = time.time()
            client.execute_cell(cell, i)
            print(f"cell {i:>2}: {time.time() - start:7.2f} s  {cell.source.splitlines()[0][:60]}", flush=True)
finally:
    nbformat.write(nb, dst)
    print(f"total {time.time() - t0:.1f} s; wrote {dst}")
