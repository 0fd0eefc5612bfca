"""Build the course site: the notebooks of notebooks/, with their outputs, as static HTML (Sphinx + MyST-NB).

    python scripts/build_site.py [--executed DIR ...] [--out build/site]

Each notebook's page shows the first executed copy whose code is the notebook's current code, looked
for (as NAME.ipynb or notebooks-NAME.ipynb) in docs/site/executed/ (the GPU run of
scripts/execute_for_site.py), then in each --executed DIR (e.g. the CPU run kept by the browser
test); failing that, the notebook without outputs. A note at the top of each page says which, from
the run record the executed copy carries. The interactive steppers become the still frame they showed
when the run ended. Nothing is executed, and nothing is fetched: the theme and MathJax come from
installed packages (requirements-dev.txt).

Writes OUT/src (the staged sources), OUT/html (the site: open OUT/html/index.html), OUT/pages.json
(per page: where its outputs came from, how many figures) and OUT/warnings.txt (Sphinx's warnings).
"""
from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parents[1]
SITE = ROOT / "docs" / "site"
GPU_EXECUTED = SITE / "executed"
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
WIDGET_STATE = "application/vnd.jupyter.widget-state+json"
IMAGE_MIMES = ("image/png", "image/jpeg", "image/svg+xml", "image/gif")


def _code(nb):
    return [c.source.strip() for c in nb.cells if c.cell_type == "code"]


def _is_subsequence(ran: list, now: list) -> bool:
    """Whether the code cells that ran appear, in order and unchanged, among the notebook's code cells now."""
    it = iter(now)
    return all(any(cell == c for c in it) for cell in ran)


def find_executed(path: Path, folders: list[Path]):
    """(executed notebook, its file) for the first copy whose code matches `path`'s; (None, stale files).

    A copy matches when its code cells are the notebook's, or the notebook's with some cells added
    since the run (they show no output on the page, and the page says so); a changed or removed
    code cell makes the copy stale.
    """
    want, stale = _code(nbformat.read(path, as_version=4)), []
    for folder in folders:
        for name in (path.name, f"{path.parent.name}-{path.name}"):
            f = folder / name
            if f.is_file():
                nb = nbformat.read(f, as_version=4)
                if _is_subsequence(_code(nb), want):
                    return nb, f
                stale.append(f)
    return None, stale


def with_current_text(executed, path: Path):
    """The executed notebook with the markdown of the notebook at `path`; (notebook, code cells added since).

    Prose may be corrected after a GPU run without running again: outputs come only from code cells,
    so the page takes the outputs from the executed copy and every markdown cell from the notebook
    as it is now.  A code cell added since the run is shown without output.
    """
    current = nbformat.read(path, as_version=4)
    ran = [c for c in executed.cells if c.cell_type == "code"]
    cells, added = [], 0
    for c in current.cells:
        if c.cell_type == "code":
            if ran and ran[0].source.strip() == c.source.strip():
                c = ran.pop(0)
            else:
                c.outputs, c.execution_count, added = [], None, added + 1
        cells.append(c)
    merged = nbformat.v4.new_notebook(cells=cells, metadata=executed.metadata)
    merged.nbformat, merged.nbformat_minor = executed.nbformat, executed.nbformat_minor
    return merged, added


def describe_run(record: dict | None, source: Path) -> str:
    """One sentence on where a page's outputs come from, from the executed copy's run record."""
    if not record:
        return f"Outputs from an executed copy with no run record ({source.parent.name}/{source.name})."
    versions = f"torch {record.get('torch')}, triton {record.get('triton')}"
    date = str(record.get("date", ""))[:10]
    how = record.get("how", "")
    if record.get("gpu"):
        where = f"a run on an {record['gpu']} ({versions}, compiled Triton kernels)"
    else:
        where = (f"a CPU run through Triton's interpreter ({versions}): small sizes, "
                 "and no timings (they would time NumPy, not a GPU)")
    return f"Outputs from {where}, executed {date}{' ' + how if how else ''}."


def _captured_outputs(state: dict, model_id: str) -> list:
    """What the Output widgets inside widget `model_id` showed when the run ended."""
    model = state.get(model_id)
    if model is None:
        return []
    if model.get("model_name") == "OutputModel":
        return list(model.get("state", {}).get("outputs", []))
    found = []
    for child in model.get("state", {}).get("children", []):
        if isinstance(child, str) and child.startswith("IPY_MODEL_"):
            found += _captured_outputs(state, child[len("IPY_MODEL_"):])
    return found


def static_widgets(nb) -> int:
    """Replace each widget by a note and the still frame it showed; drop the widget state (its
    renderer would come from a CDN). Returns how many widgets were replaced."""
    state = nb.metadata.get("widgets", {}).get(WIDGET_STATE, {}).get("state", {})
    n = 0
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        outputs = []
        for out in cell.outputs:
            view = out.get("data", {}).get(WIDGET_VIEW) if out.output_type in ("display_data", "execute_result") else None
            if view is None:
                outputs.append(out)
                continue
            n += 1
            frames = [nbformat.from_dict(o) for o in _captured_outputs(state, view.get("model_id", ""))]
            note = ("*An interactive stepper: run the notebook to drag its slider."
                    + (" The frame it showed at the end of the run:*" if frames else "*"))
            outputs.append(nbformat.v4.new_output("display_data", data={"text/markdown": note, "text/plain": note}))
            outputs += frames
        cell.outputs = outputs
    nb.metadata.pop("widgets", None)
    return n


_LINKED_REMOTE_IMAGE = re.compile(r"\[!\[([^\]]*)\]\((https?://[^)\s]+)\)\]\(([^)\s]+)\)")
_REMOTE_IMAGE = re.compile(r"!\[([^\]]*)\]\((https?://[^)\s]+)\)")


def local_only(nb) -> None:
    """Markdown images hosted elsewhere (the Colab badge) become plain links: a page loads nothing remote."""
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            src = _LINKED_REMOTE_IMAGE.sub(r"[\1](\3)", cell.source)
            cell.source = _REMOTE_IMAGE.sub(r"[\1](\2)", src)


def count_images(nb) -> int:
    return sum(1 for c in nb.cells if c.cell_type == "code" for o in c.outputs
               if o.output_type in ("display_data", "execute_result") and any(m in o.get("data", {}) for m in IMAGE_MIMES))


def stage(src: Path, folders: list[Path]) -> list[dict]:
    """Copy the site's sources and the notebooks (executed where possible) into `src`; one dict per page."""
    shutil.copytree(SITE, src, ignore=shutil.ignore_patterns("executed", "_build", "__pycache__"))
    (src / "notebooks").mkdir()
    pages = []
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        executed, found = find_executed(path, folders)
        if executed is not None:
            (nb, added), source = with_current_text(executed, path), found
            kind = "gpu" if (nb.metadata.get("flashlab_run") or {}).get("gpu") else "cpu"
            note = describe_run(nb.metadata.get("flashlab_run"), source)
            if added:
                many = added > 1
                note += (f" {added} code cell{'s were' if many else ' was'} added to the notebook after that run "
                         f"and {'show' if many else 'shows'} no output here.")
            admonition = "note"
        else:
            nb, source, kind, admonition = nbformat.read(path, as_version=4), path, "none", "warning"
            why = ("its executed copy (" + ", ".join(f"{f.parent.name}/{f.name}" for f in found)
                   + ") is older than its code") if found else "this build was given no executed copy of it"
            note = f"This page shows the notebook without outputs: {why}. Run it to see them."
        widgets = static_widgets(nb)
        local_only(nb)
        nb.cells.insert(1, nbformat.v4.new_markdown_cell(f"```{{{admonition}}}\n{note}\n```"))
        nbformat.write(nb, src / "notebooks" / path.name)
        pages.append({"notebook": path.name, "page": f"notebooks/{path.stem}.html", "outputs": kind,
                      "source": str(source.relative_to(ROOT) if source.is_relative_to(ROOT) else source),
                      "note": note, "figures": count_images(nb), "widgets": widgets})
    return pages


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--executed", action="append", type=Path, default=[],
                    help="a folder of executed notebooks, used after docs/site/executed (repeatable)")
    ap.add_argument("--out", type=Path, default=ROOT / "build" / "site")
    args = ap.parse_args(argv)
    out = args.out.resolve()
    src, html = out / "src", out / "html"
    for d in (src, html):
        shutil.rmtree(d, ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)
    pages = stage(src, [GPU_EXECUTED] + [f.resolve() for f in args.executed])
    (out / "pages.json").write_text(json.dumps(pages, indent=1))
    warnings = out / "warnings.txt"
    cmd = [sys.executable, "-m", "sphinx", "-b", "html", "-q", "-w", str(warnings), str(src), str(html)]
    rc = subprocess.run(cmd, cwd=ROOT).returncode
    width = max(len(p["notebook"]) for p in pages)
    print(f"{'notebook':<{width}}  outputs  figures  source")
    for p in pages:
        print(f"{p['notebook']:<{width}}  {p['outputs']:<7}  {p['figures']:>7}  {p['source']}")
    n_warn = len([l for l in warnings.read_text().splitlines() if "WARNING" in l]) if warnings.exists() else 0
    print(f"{'built' if rc == 0 else 'FAILED'}: {html / 'index.html'}  ({n_warn} Sphinx warnings in {warnings})")
    return rc


if __name__ == "__main__":
    sys.exit(main())
