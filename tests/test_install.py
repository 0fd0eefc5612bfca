"""Getting started: the Colab install cell, the course map, and running from the wrong folder."""
import importlib.util
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import nbformat
import pytest

from flashlab.colab import REPO_URL, install_cell

ROOT = Path(__file__).resolve().parents[1]


def _run_cell(monkeypatch, in_colab: bool):
    """Run the install cell's code (in Colab or not; flashlab not installed) and return the commands
    it would run, without running them."""
    calls = []
    monkeypatch.setattr(subprocess, "run", lambda cmd, **kw: calls.append(cmd))
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "flashlab" else real_find_spec(name, *a))
    if in_colab:
        monkeypatch.setitem(sys.modules, "google.colab", types.ModuleType("google.colab"))
    else:
        monkeypatch.delitem(sys.modules, "google.colab", raising=False)
    exec(install_cell(), {})
    monkeypatch.undo()
    return calls


def test_install_cell_does_nothing_outside_colab(monkeypatch):
    assert _run_cell(monkeypatch, in_colab=False) == []


def test_install_cell_leaves_torch_and_triton_alone(monkeypatch, tmp_path):
    """The cell's pip command, pointed at this checkout instead of the repository URL, in a fresh
    virtual environment that already has torch (and triton): pip would install flashlab only."""
    calls = _run_cell(monkeypatch, in_colab=True)
    assert len(calls) == 1, calls
    cmd = calls[0]
    assert cmd[1:4] == ["-m", "pip", "install"] and cmd[-1] == f"git+{REPO_URL}@main", cmd
    assert not any(a in ("-U", "--upgrade", "--force-reinstall") for a in cmd)
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    from importlib.metadata import PackageNotFoundError, version
    for dep in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]:
        name = dep.split(";")[0].split("[")[0].split("<")[0].split(">")[0].split("=")[0].strip()
        try:
            version(name)
        except PackageNotFoundError:  # offline, pip could not resolve it: not what this test is about
            pytest.skip(f"{name} (a dependency of flashlab) is not installed here")
    venv = tmp_path / "venv"
    # (no pip of its own: this pip drives the venv's interpreter with --python, seconds faster).  It sees
    # this interpreter's packages through a .pth file: --system-site-packages would show the *base*
    # interpreter's, which lack torch when this one is itself a virtual environment.
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    py = venv / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
    site_dir = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                              capture_output=True, text=True, check=True).stdout.strip()
    ours = [p for p in sys.path if os.path.basename(p) in ("site-packages", "dist-packages") and os.path.isdir(p)]
    Path(site_dir, "_this_environment.pth").write_text("".join(p + "\n" for p in ours))
    r = subprocess.run([str(py), "-c", "import torch, triton"], capture_output=True, text=True)
    assert r.returncode == 0, "the venv should see this environment's torch and triton: " + r.stderr
    report = tmp_path / "report.json"
    # Offline (--no-index, --no-build-isolation): pip may only use what is installed, so a requirement
    # that would replace torch or triton fails here just as it would plan a reinstall online.
    args = ([sys.executable, "-m", "pip", "--python", str(py)] + cmd[3:-1]
            + ["--no-index", "--no-build-isolation", "--dry-run", "--report", str(report), str(ROOT)])
    r = subprocess.run(args, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    would_install = {item["metadata"]["name"].lower() for item in json.loads(report.read_text())["install"]}
    assert would_install == {"flashlab"}, would_install


def test_pyproject_does_not_depend_on_torch_or_triton():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert not [d for d in deps if d.split()[0].lower().startswith(("torch", "triton", "nvidia"))], deps


def test_start_here_is_the_course_map():
    """`jupyter lab START_HERE.ipynb` opens on the course map: README's table, every lecture linked."""
    text = "".join(c.source for c in nbformat.read(ROOT / "START_HERE.ipynb", as_version=4).cells)
    readme = (ROOT / "README.md").read_text().split("## The course\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in readme.splitlines() if line.startswith("|")]
    assert rows, "README has no course table"
    missing = [r for r in rows if r not in text]
    assert not missing, f"START_HERE.ipynb lacks README's course rows (copy them over): {missing}"
    for nb in sorted((ROOT / "notebooks").glob("*.ipynb")):
        assert f"(notebooks/{nb.name})" in text, f"START_HERE.ipynb does not link {nb.name}"


def test_running_from_the_parent_folder_says_what_to_do(tmp_path):
    """From the folder that contains the clone, `import flashlab` finds the clone itself (a namespace
    package); importing a module of flashlab then explains instead of failing later."""
    (tmp_path / "flashlab").symlink_to(ROOT, target_is_directory=True)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    code = ("import flashlab, sys\n"
            "assert flashlab.__file__ is None, flashlab.__file__\n"
            # what an editable install's finder does: serve flashlab's modules to the namespace package
            f"flashlab.__path__.append({str(ROOT / 'flashlab')!r})\n"
            "import flashlab.device\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert r.returncode != 0
    assert "ImportError" in r.stderr and "inside the repository" in r.stderr, r.stderr
