"""The course site: built by its one command (scripts/build_site.py), served on 127.0.0.1 and opened
in headless Chromium with no network: every notebook has a page, the math is typeset, the figures
load, and no page asks for anything outside the site.

The build takes its outputs from docs/site/executed (a GPU run, when committed) and from the
lecture notebooks that tests/test_browser.py just ran in JupyterLab (FLASHLAB_EXECUTED_DIR, else
<pytest tmp>/browser-executed). Screenshots: FLASHLAB_SCREENSHOT_DIR (else <pytest tmp>/screenshots),
as site-*.png.
"""
import functools
import http.server
import json
import subprocess
import sys
import threading

import nbformat
import pytest

import browser_util
from browser_util import ROOT

LECTURES = sorted((ROOT / "notebooks").glob("*.ipynb"))


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


def _site_tools_missing():
    try:
        import jupyter_server_mathjax  # noqa: F401
        import myst_nb  # noqa: F401
        import sphinx  # noqa: F401
        import sphinx_book_theme  # noqa: F401
    except ImportError as e:
        return f"the site's build tools are missing ({e.name}): pip install -r requirements-dev.txt"
    return None


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    reason = _site_tools_missing()
    if reason:
        if browser_util.in_ci():
            pytest.fail(f"CI must build the site, but: {reason}", pytrace=False)
        pytest.skip(reason)
    out = tmp_path_factory.mktemp("site")
    executed = browser_util.artifact_dir(tmp_path_factory, "FLASHLAB_EXECUTED_DIR", "browser-executed")
    cmd = [sys.executable, "scripts/build_site.py", "--out", str(out), "--executed", str(executed)]
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    print(run.stdout)
    assert run.returncode == 0, f"the site build failed:\n{run.stdout}\n{run.stderr}"
    pages = json.loads((out / "pages.json").read_text())
    handler = functools.partial(QuietHandler, directory=str(out / "html"))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield {"url": f"http://127.0.0.1:{server.server_address[1]}", "pages": pages, "out": out,
               "warnings": (out / "warnings.txt").read_text() if (out / "warnings.txt").exists() else ""}
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture(scope="module")
def browser(site):
    browser_util.require()
    with browser_util.chromium() as context:
        yield context


def test_every_notebook_has_a_page_with_outputs(site):
    pages = {p["notebook"]: p for p in site["pages"]}
    assert sorted(pages) == [p.name for p in LECTURES]
    assert not [l for l in site["warnings"].splitlines() if "ERROR" in l or "CRITICAL" in l], site["warnings"]
    for p in pages.values():
        assert (site["out"] / "html" / p["page"]).is_file(), f"no page for {p['notebook']}"
        staged = nbformat.read(site["out"] / "src" / "notebooks" / p["notebook"], as_version=4)
        errors = [o.get("ename") for c in staged.cells if c.cell_type == "code" for o in c.outputs
                  if o.output_type == "error"]
        assert not errors, f"{p['notebook']}: the site would show error outputs {errors}"
    without = [n for n, p in pages.items() if p["outputs"] == "none"]
    if without and len(without) == len(pages) and not browser_util.in_ci():
        pytest.skip("no executed notebooks for the site: run tests/test_browser.py first, or commit a GPU run")
    assert not without, (f"pages without outputs: {without} "
                         "(the browser test's executed copies or docs/site/executed should cover every notebook)")


def _check_page(page, url, name, expect_figures, shots):
    page.goto(url)
    page.wait_for_load_state("load")
    # MathJax 2 typesets after load (a quick preview first, then the real rendering): wait for every formula
    js_math = """() => Array.from(document.querySelectorAll('span.math.notranslate, div.math.notranslate')).map(el => ({
        rendered: el.querySelector('.MathJax, .MathJax_Display') !== null,
        raw: /\\\\[\\(\\[]/.test(el.innerText), text: el.innerText.slice(0, 60)}))"""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout
    try:
        page.wait_for_function(f"() => ({js_math})().every(m => m.rendered && !m.raw)", timeout=60_000)
    except PlaywrightTimeout:
        pass    # reported below, formula by formula
    if page.evaluate("() => !!(window.MathJax && MathJax.Hub)"):     # and its queue to drain
        page.evaluate("() => new Promise(done => MathJax.Hub.Queue(done))")
    math = page.evaluate(js_math)
    # a TeX error becomes <merror>, an undefined macro red text (MathJax's noErrors/noUndefined)
    errors = page.evaluate("""() => Array.from(document.querySelectorAll('.MathJax[data-mathml], .MathJax_Display [data-mathml]'))
        .map(e => e.getAttribute('data-mathml'))
        .filter(m => m.includes('<merror') || m.includes('mathcolor="red"')).map(m => m.slice(0, 120))""")
    images = page.evaluate("""() => Array.from(document.querySelectorAll('img')).map(img => {
        const r = img.getBoundingClientRect();
        return {ok: img.complete && img.naturalWidth > 0 && r.width > 0 && r.height > 0,
                output: img.closest('.cell_output') !== null, src: (img.getAttribute('src') || '').slice(0, 60)}; })""")
    height = page.evaluate("() => document.documentElement.scrollHeight")
    page.screenshot(path=str(shots / f"site-{name}.png"), full_page=height <= 16000,
                    clip=None if height <= 16000 else {"x": 0, "y": 0, "width": 1280, "height": 16000})
    assert not errors, f"{name}: TeX errors {errors}"
    bad_math = [m["text"] for m in math if not m["rendered"] or m["raw"]]
    assert not bad_math, f"{name}: math left untypeset: {bad_math[:5]}"
    broken = [im["src"] for im in images if not im["ok"]]
    assert not broken, f"{name}: images not loaded: {broken}"
    figures = sum(im["output"] for im in images)
    assert figures >= expect_figures, f"{name}: {expect_figures} figures in the notebook, {figures} on the page"
    return len(math), figures


@pytest.mark.parametrize("name", ["index"] + [p.stem for p in LECTURES])
def test_page_in_browser(name, site, browser, tmp_path_factory):
    shots = browser_util.artifact_dir(tmp_path_factory, "FLASHLAB_SCREENSHOT_DIR", "screenshots")
    pages = {p["page"]: p for p in site["pages"]}
    rel = "index.html" if name == "index" else f"notebooks/{name}.html"
    info = pages.get(rel, {"figures": 0, "notebook": None})
    page = browser.new_page()
    before = len(browser.external_requests)
    try:
        n_math, n_fig = _check_page(page, f"{site['url']}/{rel}", name, info["figures"], shots)
        if info["notebook"]:
            text = page.inner_text("article")
            assert info["note"][:20] in text, f"{name}: the note on where the outputs come from is missing"
            src = nbformat.read(ROOT / "notebooks" / info["notebook"], as_version=4)
            if any("$" in c.source for c in src.cells if c.cell_type == "markdown"):
                assert n_math > 0, f"{name}: the notebook has math, the page none"
    finally:
        page.close()
    external = browser.external_requests[before:]
    assert not external, f"{name}: the page asked for resources outside the site: {external}"


def test_pages_take_prose_from_the_notebook_and_outputs_from_the_run(tmp_path):
    """A markdown fix after a GPU run reaches the page; the outputs stay those of the run; a code cell
    added since shows no output; a changed code cell makes the copy stale."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("build_site", ROOT / "scripts" / "build_site.py")
    build_site = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build_site)
    v4 = nbformat.v4
    ran = v4.new_notebook(cells=[v4.new_markdown_cell("old words"), v4.new_code_cell("print(1)"),
                                 v4.new_code_cell("print(2)"), v4.new_markdown_cell("old end")],
                          metadata={"flashlab_run": {"gpu": "X"}})
    for c, text in zip(ran.cells[1:3], ("1\n", "2\n")):
        c.outputs = [v4.new_output("stream", name="stdout", text=text)]
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "nb.ipynb").write_text(nbformat.writes(ran))
    now = v4.new_notebook(cells=[v4.new_markdown_cell("new words"), v4.new_code_cell("print(1)"),
                                 v4.new_code_cell("print('new')"), v4.new_code_cell("print(2)"),
                                 v4.new_markdown_cell("new end")])
    (tmp_path / "nb.ipynb").write_text(nbformat.writes(now))
    found, _ = build_site.find_executed(tmp_path / "nb.ipynb", [tmp_path / "run"])
    assert found is not None
    merged, added = build_site.with_current_text(found, tmp_path / "nb.ipynb")
    assert [c.source for c in merged.cells] == ["new words", "print(1)", "print('new')", "print(2)", "new end"]
    assert [c.outputs[0]["text"] if c.outputs else None for c in merged.cells[1:4]] == ["1\n", None, "2\n"]
    assert added == 1 and merged.metadata["flashlab_run"] == {"gpu": "X"}
    now.cells[1].source = "print(10)"          # a code cell that ran has changed: the copy is stale
    (tmp_path / "nb.ipynb").write_text(nbformat.writes(now))
    found, stale = build_site.find_executed(tmp_path / "nb.ipynb", [tmp_path / "run"])
    assert found is None and stale == [tmp_path / "run" / "nb.ipynb"]


def test_machine_noise_is_dropped_and_nothing_else():
    """The executor drops the GPU machine's own warnings (they name its install paths), not the course's output."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("execute_for_site", ROOT / "scripts" / "execute_for_site.py")
    ex = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ex)
    v4 = nbformat.v4
    cell = v4.new_code_cell("x")
    cell.outputs = [v4.new_output("stream", name="stderr", text="/some/site-packages/torch/autograd/graph.py:869: "
                                  "UserWarning: Attempting to run cuBLAS, but there was no current CUDA context! ...\n"
                                  "  return Variable._execution_engine.run_backward(  # Calls into the C++ engine\n"),
                    v4.new_output("stream", name="stderr", text="a real warning\n"),
                    v4.new_output("stream", name="stdout", text="ok\n")]
    nb = v4.new_notebook(cells=[cell])
    assert ex.drop_machine_noise(nb) == 2
    assert [o["text"] for o in nb.cells[0].outputs] == ["a real warning\n", "ok\n"]
