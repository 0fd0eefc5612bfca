"""Headless Chromium for the tests: a JupyterLab server driven as a learner drives it, and static pages.

Used by tests/test_browser.py (the lecture notebooks, run in JupyterLab), tests/test_site.py (the
rendered course site) and tests/test_notebooks.py (which leaves the lectures to the browser when it
can run). Chromium is Debian's ``chromium`` package, driven by the ``playwright`` client
(requirements-dev.txt); Playwright's own browser download is not used.
"""
from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

CHROMIUM_FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() == "true"


def chromium_path() -> str | None:
    """FLASHLAB_CHROMIUM, else `chromium` (Debian) or `chromium-browser` on PATH."""
    env = os.environ.get("FLASHLAB_CHROMIUM")
    if env:
        return env if os.access(env, os.X_OK) else None
    return shutil.which("chromium") or shutil.which("chromium-browser")


def missing() -> str | None:
    """Why the browser tests cannot run here, or None when they can."""
    reasons = []
    if chromium_path() is None:
        reasons.append("no Chromium (apt-get install chromium, or set FLASHLAB_CHROMIUM)")
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        reasons.append("no playwright client (pip install -r requirements-dev.txt)")
    return "; ".join(reasons) or None


def require() -> None:
    """Skip with the reason when the browser tools are missing; in CI (CI=true) fail instead."""
    reason = missing()
    if reason is None:
        return
    if in_ci():
        pytest.fail(f"CI must run the browser tests, but: {reason}", pytrace=False)
    pytest.skip(reason)


def artifact_dir(tmp_path_factory, env: str, name: str) -> Path:
    """A folder for test artifacts: the environment variable `env` if set, else one under pytest's tmp dir."""
    path = Path(os.environ[env]) if os.environ.get(env) else tmp_path_factory.getbasetemp() / name
    path.mkdir(parents=True, exist_ok=True)
    return path


@contextlib.contextmanager
def chromium(viewport=(1280, 900)):
    """A Playwright browser context on a fresh, empty profile. Requests leaving 127.0.0.1 (or file://)
    are refused and recorded in ``context.external_requests``: the tests run with no network and
    check that nothing needs one."""
    from playwright.sync_api import sync_playwright

    with tempfile.TemporaryDirectory(prefix="flashlab-chromium-") as profile, sync_playwright() as pw:
        context = pw.chromium.launch_persistent_context(
            profile, executable_path=chromium_path(), headless=True, args=CHROMIUM_FLAGS,
            viewport={"width": viewport[0], "height": viewport[1]})
        external = []

        def guard(route):
            url = route.request.url
            if url.startswith(("http://127.0.0.1", "file://", "data:", "blob:")):
                route.continue_()
            else:
                external.append(url)
                route.abort()

        context.route("**/*", guard)
        context.external_requests = external
        try:
            yield context
        finally:
            context.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class JupyterLab:
    """JupyterLab on 127.0.0.1 (a free port, a token, its own config/runtime/settings folders), serving `root`.

    Three settings differ from JupyterLab's defaults: every cell is attached to the page (windowing
    off), so a figure far down the notebook is in the DOM to be checked; saving a notebook keeps its
    widgets' state (the site shows a stepper's last frame from it); no news pop-up."""

    def __init__(self, root: Path, workdir: Path):
        self.root, self.workdir = Path(root), Path(workdir)
        self.port, self.token = _free_port(), secrets.token_hex(16)
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = self.workdir / "jupyterlab.log"
        self.proc = None

    def __enter__(self):
        env = dict(os.environ)
        for var, sub in [("JUPYTER_CONFIG_DIR", "config"), ("JUPYTER_RUNTIME_DIR", "runtime"),
                         ("JUPYTER_DATA_DIR", "data"), ("JUPYTERLAB_SETTINGS_DIR", "settings"),
                         ("JUPYTERLAB_WORKSPACES_DIR", "workspaces")]:
            env[var] = str(self.workdir / sub)
            (self.workdir / sub).mkdir(parents=True, exist_ok=True)
        for plugin, settings in [("@jupyterlab/notebook-extension/tracker", {"windowingMode": "none"}),
                                 ("@jupyterlab/apputils-extension/notification", {"fetchNews": "false"}),
                                 ("@jupyter-widgets/jupyterlab-manager/plugin", {"saveState": True})]:
            f = self.workdir / "settings" / f"{plugin}.jupyterlab-settings"
            f.parent.mkdir(parents=True, exist_ok=True)
            f.write_text(json.dumps(settings))
        cmd = [sys.executable, "-m", "jupyterlab", "--no-browser",
               "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={self.port}", "--ServerApp.port_retries=0",
               f"--IdentityProvider.token={self.token}", f"--ServerApp.root_dir={self.root}",
               "--LabApp.expose_app_in_browser=True",          # window.jupyterapp: read cell models, not pixels
               "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate"]
        if hasattr(os, "geteuid") and os.geteuid() == 0:
            cmd.append("--allow-root")
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, env=env, stdout=self._log, stderr=subprocess.STDOUT, cwd=self.root)
        deadline = time.monotonic() + 120
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"JupyterLab exited ({self.proc.returncode}):\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/api/status?token={self.token}", timeout=5) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            if time.monotonic() > deadline:
                self.__exit__(None, None, None)
                raise RuntimeError(f"JupyterLab did not answer within 120 s:\n{self.log_tail()}")
            time.sleep(0.5)
        return self

    def __exit__(self, *exc):
        if self.proc and self.proc.poll() is None:
            try:   # the server's own shutdown also stops its kernels
                req = urllib.request.Request(f"{self.url}/api/shutdown", method="POST",
                                             headers={"Authorization": f"token {self.token}"})
                urllib.request.urlopen(req, timeout=10).close()
                self.proc.wait(timeout=30)
            except Exception:
                self.proc.terminate()
                try:
                    self.proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()
        if getattr(self, "_log", None):
            self._log.close()

    def log_tail(self, n=40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def lab_url(self) -> str:
        """JupyterLab's address, in a fresh workspace (`reset`: no tabs restored from an earlier visit)."""
        return f"{self.url}/lab?reset&token={self.token}"

    def api(self, path: str, method="GET"):
        req = urllib.request.Request(f"{self.url}/api/{path}", method=method,
                                     headers={"Authorization": f"token {self.token}"})
        with urllib.request.urlopen(req, timeout=30) as r:
            body = r.read()
        return json.loads(body) if body else None

    def shutdown_sessions(self) -> None:
        """Close every notebook session and its kernel (what File > Close and Shut Down Notebook does)."""
        for session in self.api("sessions"):
            self.api(f"sessions/{session['id']}", method="DELETE")


# JavaScript run in the JupyterLab page (window.jupyterapp, exposed by --LabApp.expose_app_in_browser).
JS_NOTEBOOK_STATE = """() => {
  const w = window.jupyterapp && window.jupyterapp.shell.currentWidget;
  if (!w || !w.content || !w.sessionContext) return null;
  const kernel = w.sessionContext.session && w.sessionContext.session.kernel;
  const cells = [];
  for (const c of w.content.model.cells) {
    if (c.type !== 'code') continue;
    const outs = [];
    for (let i = 0; i < c.outputs.length; i++) outs.push(c.outputs.get(i).toJSON());
    cells.push({count: c.executionCount, state: c.executionState || null,
                types: outs.map(o => o.output_type),
                errors: outs.filter(o => o.output_type === 'error').map(o => o.ename + ': ' + o.evalue)});
  }
  return {path: w.context.path, kernel: kernel ? kernel.status : null, dirty: w.content.model.dirty, cells};
}"""

JS_IMAGES = """(root) => Array.from(root.querySelectorAll('.jp-OutputArea-output img')).map(img => {
  const r = img.getBoundingClientRect();
  return {complete: img.complete, natural: [img.naturalWidth, img.naturalHeight], box: [r.width, r.height],
          src: (img.getAttribute('src') || '').slice(0, 80)};
})"""

# Close every document in the main area and shut its kernel down (cleanup between notebooks).
JS_CLOSE_ALL = """async () => {
  const app = window.jupyterapp;
  for (const w of Array.from(app.shell.widgets('main'))) {
    if (w.sessionContext) await w.sessionContext.shutdown();
    w.dispose();
  }
}"""
