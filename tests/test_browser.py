"""The lecture notebooks as a learner meets them: JupyterLab in headless Chromium, Run > Run All Cells,
then what the page shows — no error output, every figure loaded, the math typeset, the widget steppers
drawn and redrawing when a slider is dragged. This is where the lecture notebooks are executed when
Chromium is available (tests/test_notebooks.py then leaves them to this file).

Artifacts: a screenshot per notebook (and of each stepper before and after the drag) in
FLASHLAB_SCREENSHOT_DIR, else <pytest tmp>/screenshots; the executed notebooks, as JupyterLab saved
them, in FLASHLAB_EXECUTED_DIR, else <pytest tmp>/browser-executed (tests/test_site.py builds the
site from them when no GPU-executed copies are committed).
"""
import datetime
import os
import re
import shutil
import time
from pathlib import Path

import nbformat
import pytest

import browser_util
from flashlab import device
from browser_util import JS_IMAGES, JS_NOTEBOOK_STATE, ROOT

LECTURES = sorted((ROOT / "notebooks").glob("*.ipynb"))
TIMEOUT = float(os.environ.get("FLASHLAB_BROWSER_TIMEOUT", 900))     # seconds per notebook
IMAGE_MIMES = ("image/png", "image/jpeg", "image/svg+xml", "image/gif")


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    browser_util.require()
    course = tmp_path_factory.mktemp("course")
    shutil.copytree(ROOT / "notebooks", course / "notebooks")   # the repository's copies stay stripped
    with browser_util.JupyterLab(course, tmp_path_factory.mktemp("jupyterlab")) as server, \
            browser_util.chromium() as context:
        page = context.new_page()         # one JupyterLab page; each test opens its notebook in it
        page.goto(server.lab_url())
        page.wait_for_function("() => window.jupyterapp && window.jupyterapp.shell", timeout=120_000)
        page.locator("#jp-MainMenu").wait_for(timeout=120_000)
        yield server, page, course


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    return (browser_util.artifact_dir(tmp_path_factory, "FLASHLAB_SCREENSHOT_DIR", "screenshots"),
            browser_util.artifact_dir(tmp_path_factory, "FLASHLAB_EXECUTED_DIR", "browser-executed"))


def _state(page):
    return page.evaluate(JS_NOTEBOOK_STATE)


def _wait_until_run(page, server, name):
    """After Run All Cells: wait until no cell is queued or running and the kernel is idle (twice in a row)."""
    deadline, calm = time.monotonic() + TIMEOUT, 0
    while True:
        st = _state(page)
        assert st is not None, f"{name}: the notebook is no longer the current tab"
        assert st["kernel"] not in ("dead", "unknown"), f"{name}: the kernel died\n{server and server.log_tail()}"
        dialog = page.locator(".jp-Dialog")
        if dialog.count():
            pytest.fail(f"{name}: JupyterLab shows a dialog: {dialog.first.inner_text()[:300]!r}")
        done = st["kernel"] == "idle" and not any(c["state"] == "running" for c in st["cells"])
        calm = calm + 1 if done else 0
        if calm >= 2:
            return st
        if time.monotonic() > deadline:
            running = [i for i, c in enumerate(st["cells"]) if c["state"] == "running"]
            pytest.fail(f"{name}: not finished after {TIMEOUT:.0f} s; code cells still queued or running: {running}")
        time.sleep(1)


def _save(page, course, relpath):
    """File > Save Notebook, then read back what JupyterLab wrote."""
    page.locator("#jp-MainMenu").get_by_text("File", exact=True).click()
    page.locator('#jp-mainmenu-file .lm-Menu-item[data-command="docmanager:save"]').click()
    page.wait_for_function(f"() => {{ const s = ({JS_NOTEBOOK_STATE})(); return s && !s.dirty; }}", timeout=60_000)
    return nbformat.read(course / relpath, as_version=4)


def _full_screenshot(page, path):
    """The whole notebook in one picture: the viewport made as tall as the notebook's content."""
    page.evaluate("() => window.jupyterapp.shell.collapseLeft()")
    js_bottom = """() => {
      const outer = document.querySelector('.jp-NotebookPanel .jp-WindowedPanel-outer');
      outer.scrollTop = 0;
      const cells = document.querySelectorAll('.jp-NotebookPanel .jp-Cell');
      return cells[cells.length - 1].getBoundingClientRect().bottom; }"""
    page.wait_for_timeout(300)
    size = page.viewport_size
    page.set_viewport_size({"width": size["width"], "height": min(16000, int(page.evaluate(js_bottom)) + 60)})
    page.wait_for_timeout(500)
    page.evaluate(js_bottom)
    page.screenshot(path=str(path))
    page.set_viewport_size(size)


def _drag_slider(page, stepper, shots, tag):
    """Drag the stepper's slider to 60% of its track; the figure below it must be redrawn."""
    handle = stepper.locator(".widget-slider .noUi-handle").first
    track = stepper.locator(".widget-slider .noUi-base").first
    readout = stepper.locator(".widget-slider .widget-readout").first
    image = stepper.locator(".widget-output img").first
    stepper.scroll_into_view_if_needed()
    image.wait_for(state="visible", timeout=60_000)
    before_value, before_src = readout.inner_text(), image.get_attribute("src")
    stepper.screenshot(path=str(shots / f"{tag}-before.png"))
    hb, tb = handle.bounding_box(), track.bounding_box()
    page.mouse.move(hb["x"] + hb["width"] / 2, hb["y"] + hb["height"] / 2)
    page.mouse.down()
    page.mouse.move(tb["x"] + 0.6 * tb["width"], hb["y"] + hb["height"] / 2, steps=8)
    page.mouse.up()
    deadline = time.monotonic() + 60
    while image.count() == 0 or image.get_attribute("src") == before_src:
        assert time.monotonic() < deadline, f"{tag}: slider moved to {readout.inner_text()!r}, figure not redrawn"
        page.wait_for_timeout(250)
    _wait_until_run(page, None, tag)          # every value the drag passed through is drawn; the last one stays
    after_value = readout.inner_text()
    assert after_value != before_value, f"{tag}: the slider did not move (readout {before_value!r})"
    loaded = image.evaluate("img => img.complete && img.naturalWidth > 0 && img.getBoundingClientRect().width > 0")
    assert loaded, f"{tag}: the redrawn figure did not load"
    stepper.screenshot(path=str(shots / f"{tag}-after.png"))
    return before_value, after_value


@pytest.mark.notebook
@pytest.mark.parametrize("path", LECTURES, ids=lambda p: p.name)
def test_lecture_in_jupyterlab(path, lab, artifacts):
    server, page, course = lab
    shots, executed = artifacts
    relpath = f"notebooks/{path.name}"
    page_errors = []
    on_error = lambda e: page_errors.append(str(e))   # noqa: E731
    page.on("pageerror", on_error)
    try:
        t_open = time.monotonic()
        page.evaluate("p => window.jupyterapp.commands.execute('docmanager:open', {path: p})", relpath)
        page.wait_for_function(f"""() => {{ const s = ({JS_NOTEBOOK_STATE})();
                                   return s && s.path === {relpath!r} && s.kernel === 'idle'; }}""", timeout=120_000)
        page.locator("#jp-MainMenu").get_by_text("Run", exact=True).click()
        page.get_by_role("menuitem", name="Run All Cells", exact=True).click()
        page.wait_for_function(f"""() => {{ const s = ({JS_NOTEBOOK_STATE})();
                                   return s && s.cells.some(c => c.state === 'running' || c.count !== null); }}""",
                               timeout=60_000)   # Run All Cells took effect
        t0 = time.monotonic()
        print(f"{path.name}: opened in {t0 - t_open:.0f} s", flush=True)
        _wait_until_run(page, server, path.name)
        run_s = time.monotonic() - t0
        nb = _save(page, course, relpath)
        nb.metadata["flashlab_run"] = {**device.report(), "how": "in JupyterLab by tests/test_browser.py",
                                       "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
        nbformat.write(nb, executed / f"notebooks-{path.name}")

        # 1. every code cell ran, and none left an error
        code = [c for c in nb.cells if c.cell_type == "code"]
        errors = [(i, o.get("ename"), o.get("evalue")) for i, c in enumerate(code)
                  for o in c.outputs if o.output_type == "error"]
        assert not errors, f"{path.name}: error output in code cells {errors}"
        not_run = [i for i, c in enumerate(code) if c.execution_count is None]
        assert not not_run, f"{path.name}: code cells never ran: {not_run}"

        # 2. every figure is on the page and loaded, with a size
        saved_images = sum(1 for c in code for o in c.outputs
                           if o.output_type in ("display_data", "execute_result") and any(m in o.data for m in IMAGE_MIMES))
        if any("viz.fig_" in c.source for c in code):
            assert saved_images, f"{path.name}: the notebook draws figures, but no image output was saved"
        images = page.evaluate(JS_IMAGES, page.locator(".jp-NotebookPanel .jp-Notebook").element_handle())
        assert len(images) >= saved_images, f"{path.name}: {saved_images} image outputs, {len(images)} on the page"
        broken = [im for im in images if not (im["complete"] and min(im["natural"]) > 0 and min(im["box"]) > 0)]
        assert not broken, f"{path.name}: figures not rendered: {broken}"

        # 3. the math in the markdown is typeset, without TeX errors
        if any("$" in c.source for c in nb.cells if c.cell_type == "markdown"):
            page.wait_for_function("() => document.querySelectorAll('.jp-MarkdownCell mjx-container').length > 0",
                                   timeout=60_000)
            assert page.locator(".jp-MarkdownCell mjx-merror").count() == 0, f"{path.name}: a TeX error in markdown"

        # 4. the widget steppers: drawn, and redrawn when their slider is dragged
        expected = sum(len(re.findall(r"\bviz\.interact_\w+\(", c.source)) for c in code)
        steppers = page.locator(".jp-OutputArea-output > .jupyter-widgets.widget-vbox")
        assert steppers.count() == expected, f"{path.name}: {expected} widget steppers expected, {steppers.count()} drawn"
        for k in range(expected):
            _drag_slider(page, steppers.nth(k), shots, f"{path.stem}-stepper{k}")

        if page_errors:     # reported, not failed on: JupyterLab itself logs some
            print(f"{path.name}: JavaScript errors on the page: {page_errors[:5]}")
        _full_screenshot(page, shots / f"{path.stem}.png")
        print(f"{path.name}: ran in {run_s:.0f} s in JupyterLab, all checks {time.monotonic() - t0 - run_s:.0f} s; {len(images)} figures, {expected} steppers; "
              f"screenshot {shots / (path.stem + '.png')}")
    except BaseException:
        page.screenshot(path=str(shots / f"{path.stem}-FAILED.png"))
        page.keyboard.press("Escape")     # a dialog left open would block the next notebook
        raise
    finally:
        page.remove_listener("pageerror", on_error)
        page.evaluate(browser_util.JS_CLOSE_ALL)
        server.shutdown_sessions()
