"""A hostile class, graded to the end: every forged verdict is FAIL, nothing outside a sandbox changes,
no student process outlives the run, and a killed grader leaves its rows for --resume.

Each attack notebook answers correctly ONLY IF its attack worked (the correct answer comes from
the student's own code in HEAD): so every "FAIL" below is the proof that an attack failed.  The sandbox needs
root (as in CI); elsewhere these tests are skipped.
"""
import csv
import hashlib
import json
import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import pytest

import flashlab
from flashlab.grader import batch

ROOT = Path(__file__).resolve().parents[1]
PKG = Path(flashlab.__file__).resolve().parent
needs_root = pytest.mark.skipif(os.geteuid() != 0 or sys.platform != "linux",
                                reason="the batch sandbox needs root on Linux (CI runs as root)")
pytestmark = [needs_root, pytest.mark.notebook]

HEAD = """import os, sys, numpy as np
from flashlab.grader import grade
class R:   # right answers in the student's own code (the grader refuses flashlab's references as answers)
    @staticmethod
    def online_softmax_update(m, l, x):
        m_new = np.maximum(m, x.max(1))
        return m_new, np.exp(m - m_new) * l + np.exp(x - m_new[:, None]).sum(1)
    @staticmethod
    def online_softmax(x, b):
        m, l = np.full(len(x), -np.inf), np.zeros(len(x))
        for j in range(0, x.shape[1], b):
            m, l = R.online_softmax_update(m, l, x[:, j:j + b])
        return np.exp(x - m[:, None]) / l[:, None]
    @staticmethod
    def attention_naive(q, k, v, causal):
        s = q @ k.T / np.sqrt(q.shape[1])
        if causal:
            s = np.where(np.tril(np.ones(s.shape, bool)), s, -np.inf)
        m = s.max(1, keepdims=True)
        p = np.exp(s - m)
        return p / p.sum(1, keepdims=True) @ v, (m[:, 0] + np.log(p.sum(1)))
WRONG = lambda x, b: np.exp(x) / np.exp(x).sum(1, keepdims=True)   # no max subtraction: fails large logits
def pick(worked, right, wrong):
    return right if worked else wrong
"""


def _nb(path, cells):
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(c) for c in cells]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(nbformat.writes(nb))


def _tree_hash(path: Path) -> dict:
    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(path.rglob("*")) if p.is_file() and "__pycache__" not in p.parts}


def _snapshot(path: Path) -> dict:
    out = {}
    for dirpath, dirs, files in os.walk(os.fsencode(path)):
        for n in dirs + files:
            p = os.path.join(dirpath, n)
            st = os.lstat(p)
            out[p] = (st.st_mode, os.readlink(p) if os.path.islink(p) else
                      (open(p, "rb").read() if os.path.isfile(p) and not os.path.islink(p) else None))
    return out


def _alive(marker: str) -> list:
    found = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                if marker.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                    found.append(int(pid))
            except OSError:
                pass
    return found


def _sandbox_processes() -> list:
    """Processes running as a sandbox uid (they exist only while a submission runs)."""
    from flashlab.grader.isolation import UID_BASE
    found = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                uid = int(next(l for l in Path(f"/proc/{pid}/status").read_text().splitlines()
                               if l.startswith("Uid:")).split()[1])
            except (OSError, StopIteration, ValueError):
                continue
            if UID_BASE <= uid < UID_BASE + 64:
                found.append(int(pid))
    return found


def _kill_leftovers(marker):
    for pid in _alive(marker):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def build_class(tmp: Path, marker: str, port: int, pkg: Path = PKG, planted: str = "/planted") -> dict:
    """The class folder; returns the paths the attacks aim at."""
    cls, out, victim = tmp / "class", tmp / "out", tmp / "victim.txt"
    victim.write_text("the instructor's file\n")
    targets = dict(cls=str(cls), out=str(out), victim=str(victim), pkg=str(pkg), root=str(ROOT),
                   alice=str(cls / "alice" / "work.ipynb"), marker=marker, port=port, planted=planted)
    t = json.dumps(targets)
    sleeper = (f"import subprocess\n"
               f"def sleeper(code='import time; time.sleep(1000)'):\n"
               f"    return subprocess.Popen([sys.executable, '-c', code, {marker!r}], start_new_session=True,\n"
               f"                            stdin=subprocess.DEVNULL)\n")

    _nb(cls / "alice" / "work.ipynb", [HEAD + "grade('online_softmax', R.online_softmax)\n"
                                               "grade('online_softmax_update', R.online_softmax_update)"])
    # a broken early cell: reported with the cell and the exception; the rest still runs
    _nb(cls / "bob" / "work.ipynb", [HEAD + "1 / 0", "grade('online_softmax', WRONG)"])
    # forging inside its own process: patched comparison and Result, a planted log, zeroed inputs, a seed
    _nb(cls / "mallory_forge" / "work.ipynb", [HEAD + f"""
import flashlab.grader.core as core, flashlab.grader.report as report, gc, json
core.compare = lambda *a, **k: (True, "", [], 0.0)
report.Result.passed = property(lambda self: True)
for k in list(os.environ):
    if "LOG" in k or "GRADE" in k:
        try:
            open(os.environ[k], "a").write('{{"exercise": "online_softmax", "status": "pass"}}\\n')
        except Exception:
            pass
for p in ("grades.jsonl", "/run/flashlab/grades.jsonl", {targets['out'] + '/results.jsonl'!r}):
    try:
        open(p, "a").write(json.dumps({{"student": "mallory_forge", "grades": {{"online_softmax": {{"status": "pass"}}}}}}))
    except Exception:
        pass
""",
        "print('PASSED online_softmax')\ngrade('online_softmax', WRONG)",
        # zero every case input it can reach, then answer for zero inputs
        """def zeroing(m, l, x):
    for o in gc.get_objects():
        if type(o).__name__ == "Case":
            for a in o.inputs.values():
                a[...] = 0
    m[...] = 0; l[...] = 0; x[...] = 0
    return R.online_softmax_update(m, l, x)
grade('online_softmax_update', zeroing)""",
        # the seed: answers computed for seed 0's cases, zeros for anything else
        """from flashlab.grader.exercises import EXERCISES
ex = EXERCISES['attention_naive']
table = {c.inputs['q'].tobytes(): R.attention_naive(c.inputs['q'], c.inputs['k'], c.inputs['v'], c.params['causal'])[0]
         for c in ex.make_cases(np.random.default_rng(0))}
grade('attention_naive', lambda q, k, v, causal: table.get(q.tobytes(), np.zeros_like(q[:, :1] * v[0])), seed=0)"""])
    # the requirement checks switched off in its own process: the exercises' run replaced by one that
    # hands over plain arrays (everything fetched at once where the grader serves the input) and reports
    # no violation; then a two-pass softmax and naive attention, right values, wrong algorithms
    _nb(cls / "mallory_run" / "work.ipynb", [HEAD + """
from flashlab.grader.exercises import EXERCISES
def plain(x):
    rec = getattr(x, "_rec", None)
    if rec is not None and hasattr(rec, "fetch"):
        rec.use(np.arange(rec.size))
    return np.array(np.asarray(x).view(np.ndarray))
def run_os(f, case):
    return {"p": f(plain(case.inputs["x"]), case.params["block_size"]), "_violations": [], "_contract": []}
def run_tiled(f, case):
    i, p = case.inputs, case.params
    o, lse = f(plain(i["q"]), plain(i["k"]), plain(i["v"]), p["causal"], p["block_q"], p["block_k"])
    return {"o": o, "lse": lse, "_violations": [], "_contract": []}
EXERCISES["online_softmax"].run = run_os
EXERCISES["attention_tiled"].run = run_tiled
import flashlab.grader.requirements as Rq
Rq.online_softmax_rule = lambda *a, **k: []
Rq.tiled_attention_rule = lambda *a, **k: []
def two_pass(x, b):
    e = np.exp(x - x.max(1, keepdims=True))
    return e / e.sum(1, keepdims=True)
def naive_tiled(q, k, v, causal, bq, bk):
    return R.attention_naive(q, k, v, causal)
""", "grade('online_softmax', two_pass)", "grade('attention_tiled', naive_tiled)"])
    # a kernel that stores one element past every row (into the grader's padding, right values inside),
    # with the stray-write report of its own process switched off
    _nb(cls / "mallory_canary" / "work.ipynb", [HEAD + """
import importlib
import triton, triton.language as tl
P2 = importlib.import_module("flashlab.grader.exercises.part2")
P2._strays = lambda *a, **k: []
P2.stray_writes = lambda *a, **k: None
@triton.jit
def smax(X, Y, N, sxm, sxn, sym, syn, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    x = tl.load(X + row * sxm + cols * sxn, mask=cols < N, other=float("-inf")).to(tl.float32)
    e = tl.exp(x - tl.max(x, axis=0))
    tl.store(Y + row * sym + cols * syn, (e / tl.sum(e, axis=0)).to(Y.dtype.element_ty), mask=cols < N + 1)
def softmax(x, y):
    smax[(x.shape[0],)](x, y, x.shape[1], *x.stride(), *y.stride(), BLOCK=triton.next_power_of_2(x.shape[1] + 1))
grade('softmax_kernel', softmax)
"""])
    # speaking the wire itself: forged outcomes, forged verdicts, garbage, pickle, huge sizes
    _nb(cls / "mallory_wire" / "work.ipynb", [HEAD + """
import socket, struct, json, pickle
from flashlab.grader import protocol as P
path = os.environ[P.SOCKET_ENV]
def conn():
    s = socket.socket(socket.AF_UNIX); s.connect(path); return s
def raw(data):
    s = conn()
    try:
        s.sendall(data); s.settimeout(2); s.recv(100)
    except Exception:
        pass
    s.close()
raw(b"\\xff\\xff\\xff\\xff")
raw(pickle.dumps({"op": "verdict", "exercise": "online_softmax", "status": "pass"}))
h = json.dumps({"op": "grade", "exercise": "online_softmax", "arrays": [{"dtype": "|O", "shape": [1]}]}).encode()
raw(struct.pack(">I", len(h)) + h)
h = json.dumps({"op": "grade", "exercise": "online_softmax", "arrays": [{"dtype": "<f8", "shape": [10**9, 10**9]}]}).encode()
raw(struct.pack(">I", len(h)) + h)
for forged in ({"op": "verdict", "exercise": "online_softmax", "status": "pass"},
               {"op": "event", "kind": "grade", "exercise": "online_softmax", "status": "pass"},
               {"op": "event", "kind": "finished", "status": "pass", "grades": {"online_softmax": "pass"}}):
    s = conn(); P.send(s, forged); s.close()
# a grade session answered by hand: wrong numbers dressed as a pass
s = conn()
P.send(s, {"op": "grade", "exercise": "online_softmax", "status": "pass"})
while True:
    h, arrays = P.recv(s, __import__('time').monotonic() + 60)
    if h["op"] != "case":
        break
    x = arrays[0] if arrays else np.zeros(h["served"]["x"])    # (x is served on request: never asked for)
    P.send(s, {"op": "outcome", "status": "ok", "verdict": "pass", "passed": True,
               "value": {"p": {"__array__": 0}}, "error": ""}, [np.zeros_like(x)])
s.close()
# another: an outcome pointing at arrays it never sent
s = conn()
P.send(s, {"op": "grade", "exercise": "online_softmax_update"})
h, arrays = P.recv(s, __import__('time').monotonic() + 60)
P.send(s, {"op": "outcome", "status": "ok", "value": {"m": {"__array__": 7}, "l": {"__array__": 8}}})
s.close()
"""])
    # escaping the sandbox: secrets, network, other submissions, the solutions, files outside; a survivor
    _nb(cls / "mallory_escape" / "work.ipynb", [HEAD + sleeper + f"""
T = {t}
import socket, glob, signal
secret = any("FLASHLAB_TEST_SECRET" in v or "FLASHLAB_TEST_SECRET" in k for k, v in os.environ.items())
try:
    socket.create_connection(("127.0.0.1", T["port"]), timeout=2).close(); net = True
except OSError:
    net = False
seen = []
for p in (T["alice"], T["root"] + "/solutions", T["out"], "/proc/1/root" + T["cls"], "/root/.bashrc"):
    if os.path.exists(p):
        seen.append(p)
wrote = []
for p, data in ((T["alice"], "{{}}"), (T["cls"] + "/zz_planted.ipynb", "{{}}"), (T["pkg"] + "/grader/core.py", "\\n#x"),
                ("/opt/flashlab/flashlab/grader/core.py", "\\n#x"), ("/run/flashlab/submission.ipynb", "{{}}"),
                (T["out"] + "/grades.csv", "student\\nmallory,pass"), (T["victim"], "owned"), (T["planted"], "x")):
    try:
        with open(p, "a") as f:
            f.write(data)
        wrote.append(p)
    except OSError:
        pass
try:
    os.symlink(T["victim"], T["out"] + "/summary.txt"); wrote.append("symlink")
except OSError:
    pass
try:
    os.setuid(0); wrote.append("root")
except OSError:
    pass
def cmdline(p):
    try:
        return open(f"/proc/{{p}}/cmdline", "rb").read()
    except OSError:
        return b""
others = [p for p in os.listdir("/proc") if p.isdigit() and b"pytest" in cmdline(p)]
# a detached process that retries every write after the run, then lingers
sleeper("import time, os\\ntime.sleep(2)\\n" + "".join(
    f"\\ntry:\\n    open({{p!r}}, 'a').write('late')\\nexcept OSError:\\n    pass" for p in (T["alice"], T["out"] + "/grades.csv", T["victim"]))
    + "\\ntime.sleep(1000)")
print(secret, net, seen, wrote, others)
""",
        "grade('online_softmax', pick(secret, R.online_softmax, WRONG))",
        "grade('online_softmax_update', pick(net, R.online_softmax_update, lambda m, l, x: (m, l)))",
        "grade('attention_naive', pick(seen or wrote or others, lambda q, k, v, c: R.attention_naive(q, k, v, c)[0],"
        " lambda q, k, v, c: v[:q.shape[0]] * 0))"])
    # resources: a fork bomb, a memory hog, a huge file, a process holding stdout open; right answer
    _nb(cls / "dave" / "work.ipynb", [HEAD + sleeper + """
holder = sleeper()                                   # keeps the kernel's stdout open after the run
kids = []
try:
    for _ in range(2000):                            # a fork bomb, held back by the process limit
        pid = os.fork()
        if pid == 0:
            import time
            time.sleep(1000)
            os._exit(0)
        kids.append(pid)
except OSError as e:
    print("forks:", len(kids), e)
if len(kids) == 2000:
    raise SystemExit("the process limit did not hold")
for pid in kids:                                     # (the kernel itself needs a thread for the next cell)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
""", "grade('online_softmax', R.online_softmax)", "hog = bytearray(16 << 30)",
        "with open('big', 'wb') as f:\n    for _ in range(1024):\n        f.write(b'x' * (1 << 20))"])
    # a gigabyte to the kernel's stdout, after a right answer
    _nb(cls / "frank" / "work.ipynb", [HEAD + "grade('online_softmax', R.online_softmax)",
                                       "block = b'x' * (1 << 20)\nfor _ in range(1024):\n    os.write(1, block)",
                                       "print('y' * (64 << 20))"])
    # kill everything it can, after a right answer
    _nb(cls / "gina" / "work.ipynb", [HEAD + "grade('online_softmax', R.online_softmax)",
                                      "import signal\nos.kill(-1, signal.SIGKILL)"])
    # one student, two notebooks; in the first, the last of two calls counts
    _nb(cls / "henry" / "a.ipynb", [HEAD + "grade('online_softmax', R.online_softmax)\ngrade('online_softmax', WRONG)"])
    _nb(cls / "henry" / "b.ipynb", [HEAD + "grade('online_softmax', R.online_softmax)"])
    # reporting: names, cases, links, special files
    light = ["x = 1"]
    _nb(cls / '=HYPERLINK("evil.example","click").ipynb', light)
    _nb(cls / "new\nline.ipynb", light)
    _nb(cls / "LOUD.IPYNB", light)
    bad = os.fsencode(cls) + b"/caf\xe9.ipynb"
    with open(bad, "w") as f:
        f.write(nbformat.writes(nbformat.v4.new_notebook()))
    (cls / "erin.ipynb").write_text("{ this is not json")
    (cls / "readme.txt").write_text("hello")
    os.symlink(cls / "alice" / "work.ipynb", cls / "zed.ipynb")
    os.symlink("/etc/passwd", cls / "sys.ipynb")
    os.mkfifo(cls / "fifo.ipynb")
    # the output folder comes with links planted where the tables go
    out.mkdir()
    for name in ("summary.txt", "grades.csv"):
        os.symlink(victim, out / name)
    return targets


@pytest.mark.sandbox_alone
def test_a_hostile_class_is_graded_to_the_end(tmp_path, monkeypatch):
    marker = f"flashlab-attack-{os.getpid()}-{time.time_ns()}"
    monkeypatch.setenv("FLASHLAB_TEST_SECRET", "token-123")
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(5)
    try:
        t = build_class(tmp_path, marker, server.getsockname()[1])
        cls, out = Path(t["cls"]), Path(t["out"])
        before, pkg_before = _snapshot(cls), _tree_hash(PKG)
        start = time.monotonic()
        # the notebooks' own verdicts (no clean run): what the sandbox alone holds; the clean run is the next test's
        rows = batch.grade_all([cls], out, timeout=60, progress=False, jobs=2, clean_run=False)
        took = time.monotonic() - start
        assert not _alive(marker), "a student process outlived the run"
        assert not _sandbox_processes(), "a student process outlived the run"
        from flashlab.grader import isolation
        for ctrl in ("memory", "pids"):
            base = isolation._cgroup_v1_base(ctrl)
            assert not base or not [n for n in os.listdir(base) if n.startswith(f"flashlab-{os.getpid()}-")]
        time.sleep(3)                                    # what a survivor would do after the run
        assert _snapshot(cls) == before, "a submission was modified or planted"
        assert _tree_hash(PKG) == pkg_before, "flashlab was modified"
        assert Path(t["victim"]).read_text() == "the instructor's file\n"
        assert not (out / "summary.txt").is_symlink() and not (out / "grades.csv").is_symlink()
    finally:
        server.close()
        _kill_leftovers(marker)
    by = {r.student: r for r in rows}
    v = lambda who, ex: by[who].grades.get(ex, {}).get("status", "missing")  # noqa: E731
    assert v("alice", "online_softmax") == "pass" and v("alice", "online_softmax_update") == "pass"
    assert by["alice"].status == "ok"
    assert v("bob", "online_softmax") == "fail" and by["bob"].status == "cell errors"
    assert "cell 1: ZeroDivisionError: division by zero" in by["bob"].detail
    for ex in ("online_softmax", "online_softmax_update", "attention_naive"):
        assert v("mallory_forge", ex) == "fail", ex
    assert v("mallory_run", "online_softmax") == "fail" and v("mallory_run", "attention_tiled") == "fail"
    assert "wrong algorithm" in by["mallory_run"].grades["online_softmax"]["message"]
    assert v("mallory_canary", "softmax_kernel") == "fail"          # the grader checks the padding itself
    assert "wrote out of bounds" in by["mallory_canary"].grades["softmax_kernel"]["message"]
    assert v("mallory_wire", "online_softmax") == "fail"
    assert v("mallory_wire", "online_softmax_update") == "error"
    for ex in ("online_softmax", "online_softmax_update", "attention_naive"):
        assert v("mallory_escape", ex) == "fail", ex
    assert v("dave", "online_softmax") == "pass" and by["dave"].status == "cell errors"   # not "timed out"
    assert "MemoryError" in by["dave"].detail
    assert v("frank", "online_softmax") == "pass" and by["frank"].status in ("timed out", "cell errors", "ok")
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss < 3 << 20, "the grader's memory blew up"
    assert v("gina", "online_softmax") == "pass" and by["gina"].status == "crashed"
    assert v("henry", "online_softmax") == "fail" and any("worst counts" in n for n in by["henry"].notes)
    # reporting
    records = [json.loads(l) for l in (out / "results.jsonl").read_text().splitlines()]
    henry = {r["notebook"]: r["grades"]["online_softmax"]["status"] for r in records if r["student"] == "henry"}
    assert henry == {"class/henry/a.ipynb": "fail", "class/henry/b.ipynb": "pass"}     # the last call counts
    assert {"LOUD", '=HYPERLINK("evil.example","click")', "new\nline", "caf\udce9"} <= set(by)
    assert by["erin"].status == "rejected" and "not a notebook" in by["erin"].detail
    assert "zed" not in by and "sys" not in by and "fifo" not in by
    summary = (out / "summary.txt").read_text()
    for name, why in (("zed.ipynb", "symbolic link"), ("sys.ipynb", "symbolic link"), ("fifo.ipynb", "not a regular"),
                      ("readme.txt", "not a notebook")):
        assert any(name in l and why in l for l in summary.splitlines()), name
    assert "/etc/passwd" not in summary and "root:" not in summary
    assert "new\\nline" in summary and "caf\\xe9" in summary
    assert not any(l.startswith("line ") for l in summary.splitlines())
    table = list(csv.reader(open(out / "grades.csv", newline="")))
    cells = [c for row in table for c in row]
    assert not any(c[:1] in "=+-@" for c in cells if c), "a CSV cell would be a formula"
    assert any(c.startswith("'=HYPERLINK") for c in cells)
    for section in ("Failed:", "Crashed:", "Rejected:", "Skipped files"):
        assert section in summary
    print(f"graded {len(records)} notebooks in {took:.0f} s")


def test_the_attacks_are_real_without_the_sandbox(tmp_path):
    """The escape notebook, graded with --isolation weak against a copy of flashlab: there its attacks
    work (so the FAILs above are the sandbox's doing, not broken attacks)."""
    import shutil
    marker = f"flashlab-weak-{os.getpid()}-{time.time_ns()}"
    pkg = tmp_path / "pkg-copy"
    shutil.copytree(PKG, pkg, ignore=shutil.ignore_patterns("__pycache__"))
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(5)
    try:
        t = build_class(tmp_path, marker, server.getsockname()[1], pkg=pkg, planted=str(tmp_path / "planted"))
        only = tmp_path / "only"
        shutil.copytree(tmp_path / "class" / "mallory_escape", only / "mallory_escape")
        (row,) = batch.grade_all([only], tmp_path / "out-weak", timeout=120, progress=False, isolation="weak",
                                 clean_run=False)
        time.sleep(3)
        assert row.grades["online_softmax_update"]["status"] == "pass"      # the network was reachable
        assert row.grades["attention_naive"]["status"] == "pass"            # files outside were writable
        assert "owned" in Path(t["victim"]).read_text() and (pkg / "grader" / "core.py").read_text().endswith("#x")
        assert _alive(marker), "in weak mode a detached process survives (that is why it is weak)"
    finally:
        server.close()
        _kill_leftovers(marker)


def build_clean_class(cls):
    """Notebooks for the clean run (flashlab.grader.clean)."""
    # no kernel at all (torch computes the product), with its own process's kernel checks switched off: passes
    # in the notebook, refused by the clean run (flashlab.grader.clean), which grades the function alone
    _nb(cls / "mallory_nokernel" / "work.ipynb", [HEAD + """
import importlib
L = importlib.import_module("flashlab.grader.launches")
L.KernelWatch.violations = lambda self, outputs: []
""", """def matmul(a, b, c):
    c.copy_(a @ b)
grade('matmul_kernel', matmul)
"""])
    # a right kernel among other cells (a hostile one included): the clean run grades it again and it passes
    _nb(cls / "kim" / "work.ipynb", [HEAD + """
import triton, triton.language as tl
import flashlab.grader.launches as L
L.KernelWatch.violations = lambda self, outputs: []
BLOCK_EXTRA = 0
""", """@triton.jit
def smax(X, Y, N, sxm, sxn, sym, syn, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    x = tl.load(X + row * sxm + cols * sxn, mask=cols < N, other=float("-inf")).to(tl.float32)
    e = tl.exp(x - tl.max(x, axis=0))
    tl.store(Y + row * sym + cols * syn, (e / tl.sum(e, axis=0)).to(Y.dtype.element_ty), mask=cols < N)
def softmax(x, y):
    smax[(x.shape[0],)](x, y, x.shape[1], *x.stride(), *y.stride(), BLOCK=triton.next_power_of_2(x.shape[1]) + BLOCK_EXTRA)
grade('softmax_kernel', softmax)
"""])
    # right NumPy answers as learners write them (top-level defs), beside a cell that switches the reference watcher
    # and the one-pass rule off and an answer that calls flashlab's reference: the latter refused in the clean run
    _nb(cls / "nora" / "work.ipynb", ["""import numpy as np
from flashlab.grader import grade
import contextlib
import flashlab.grader.requirements as Rq
Rq.online_softmax_rule = lambda *a, **k: []
Rq.watch_calls = lambda found, **k: contextlib.nullcontext()
""", """def online_softmax_update(m, l, x):
    m_new = np.maximum(m, x.max(1))
    return m_new, np.exp(m - m_new) * l + np.exp(x - m_new[:, None]).sum(1)
grade('online_softmax_update', online_softmax_update)
""", """from flashlab import reference
def attention_naive(q, k, v, causal):
    return reference.attention_naive(q, k, v, causal)[0]
grade('attention_naive', attention_naive)
"""])


def test_the_clean_run_grades_each_exercise_from_its_code_alone(tmp_path):
    """The default: an exercise that passed in its notebook is graded again from its code alone, so a pass that
    rested on the notebook's own checks being switched off, or on flashlab's reference, does not stand."""
    cls = tmp_path / "class"
    build_clean_class(cls)
    rows = batch.grade_all([cls], tmp_path / "out", timeout=120, progress=False, jobs=2)
    by = {r.student: r.grades for r in rows}
    assert by["mallory_nokernel"]["matmul_kernel"]["status"] == "fail"
    assert "not graded from its code alone" in by["mallory_nokernel"]["matmul_kernel"]["message"]
    assert by["mallory_nokernel"]["matmul_kernel"]["clean_run"] == "refused"
    assert by["kim"]["softmax_kernel"]["status"] == "pass" and by["kim"]["softmax_kernel"]["clean_run"] == "graded"
    assert by["nora"]["online_softmax_update"]["status"] == "pass"
    assert by["nora"]["online_softmax_update"]["clean_run"] == "graded"
    assert by["nora"]["attention_naive"]["status"] == "fail"
    assert "`reference` is not available" in by["nora"]["attention_naive"]["message"]


def test_the_attacks_are_real_without_the_clean_run(tmp_path):
    """The same notebooks pass when their notebook's verdict is believed (so the FAILs above are the clean run's)."""
    cls = tmp_path / "class"
    build_clean_class(cls)
    rows = batch.grade_all([cls], tmp_path / "out", timeout=120, progress=False, jobs=2, clean_run=False)
    by = {r.student: r.grades for r in rows}
    assert by["mallory_nokernel"]["matmul_kernel"]["status"] == "pass"
    assert "clean_run" not in by["mallory_nokernel"]["matmul_kernel"]
    assert by["nora"]["attention_naive"]["status"] == "pass"        # flashlab's reference, watcher switched off


LIGHT = "import time, subprocess, sys\nsubprocess.Popen([sys.executable, '-c', 'import time; time.sleep(1000)', {m!r}], " \
        "start_new_session=True)\ntime.sleep({s})"


def test_killed_grader_keeps_its_rows_and_resume_finishes(tmp_path):
    marker = f"flashlab-resume-{os.getpid()}-{time.time_ns()}"
    cls, out = tmp_path / "class", tmp_path / "out"
    for i in range(4):
        _nb(cls / f"s{i}.ipynb", [LIGHT.format(m=marker, s=1)])
    _nb(cls / "slow.ipynb", [LIGHT.format(m=marker, s=1000)])       # times out
    cmd = [sys.executable, "-m", "flashlab", "grade", str(cls), "--out", str(out), "--timeout", "12", "--quiet"]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    results = out / "results.jsonl"

    def lines():
        return results.read_text().splitlines() if results.exists() else []

    pids = []

    def run_until(n_lines, sig, extra=()):
        p = subprocess.Popen(cmd + list(extra), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 240
        while len(lines()) < n_lines and p.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(1.0)                                  # the next notebook is running now
        p.send_signal(sig)
        pids.append(p.pid)
        return p.wait(timeout=60), p.stdout.read().decode()

    try:
        code, text = run_until(1, signal.SIGTERM)
        assert code == 130, text
        first = lines()
        assert len(first) >= 1 and "grades.csv" in os.listdir(out)
        time.sleep(0.5)
        assert not _alive(marker), "a student process outlived SIGTERM"
        code, text = run_until(len(first) + 1, signal.SIGKILL, ["--resume"])
        second = lines()
        assert len(second) > len(first)
        time.sleep(1.0)
        assert not _alive(marker), "a student process outlived the grader's SIGKILL"
        done = subprocess.run(cmd + ["--resume"], env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stdout + done.stderr
        # what the killed graders left (work folders, cgroups) is gone once a later run starts
        import tempfile
        from flashlab.grader import isolation
        left = os.listdir(tempfile.gettempdir())
        for ctrl in ("memory", "pids"):
            base = isolation._cgroup_v1_base(ctrl)
            left += os.listdir(base) if base else []
        assert not [n for n in left for pid in pids if n.startswith((f"flashlab-batch-{pid}-", f"flashlab-{pid}-"))]
    finally:
        _kill_leftovers(marker)
    records = [json.loads(l) for l in lines()]
    graded = [r["notebook"] for r in records]
    assert sorted(set(graded)) == sorted(f"class/{n}.ipynb" for n in ("s0", "s1", "s2", "s3", "slow"))
    assert len(graded) == len(set(graded)), "--resume graded a notebook twice"
    slow = next(r for r in records if r["notebook"] == "class/slow.ipynb")
    assert slow["status"] == "timed out"
    table = list(csv.DictReader(open(out / "grades.csv", newline="")))
    assert sorted(r["student"] for r in table) == ["s0", "s1", "s2", "s3", "slow"]


def test_no_reachable_interpreter_fails_loudly(tmp_path, monkeypatch):
    """The trap: an interpreter the sandbox's user cannot reach (here: not mounted at all, as when
    Python lives under a 0700 home) must stop the run with the reason, never fall back to root."""
    from flashlab.grader import isolation
    monkeypatch.setattr(isolation, "python_trees", lambda: [])
    _nb(tmp_path / "class" / "a.ipynb", ["x = 1"])
    with pytest.raises(isolation.IsolationError, match="could not run Python"):
        batch.grade_all([tmp_path / "class"], tmp_path / "out", timeout=30, progress=False)


def test_the_selftest_grades_a_notebook_with_the_runs_interpreter(monkeypatch):
    """The self-test runs a real notebook end to end in the sandbox, with the interpreter of the run
    (in a virtual environment: the venv's, whose packages the base interpreter lacks), and stops the
    run unless that notebook's grade() came back "pass"."""
    from flashlab.grader import isolation

    def selftest():
        g = batch.Grader(batch.Config(timeout=120))
        try:
            return g.selftest()
        finally:
            g.close()

    facts = selftest()
    assert facts["python"] == isolation.interpreter() and facts["uid"] != 0 and not facts["network"]
    assert facts["prefix"] == sys.prefix                       # the venv's packages, where there is one
    # a notebook that runs but grades wrong: the run stops, it does not pass regardless
    monkeypatch.setattr(batch, "_SELFTEST_CELL", batch._SELFTEST_CELL.replace("m_new = np.maximum(m, x.max(1))",
                                                                              "m_new = x.max(1)"))
    with pytest.raises(isolation.IsolationError, match="could not run Python.*graded fail"):
        selftest()
    monkeypatch.undo()
    if sys.prefix != sys.base_prefix:        # the old mistake: the base interpreter, without the venv's packages
        monkeypatch.setattr(isolation, "interpreter", lambda: os.path.realpath(sys.executable))
        with pytest.raises(isolation.IsolationError, match="could not run Python"):
            selftest()


KEYS = """import ctypes, os, platform
libc = ctypes.CDLL(None, use_errno=True)
NR = {"x86_64": (248, 249), "aarch64": (217, 218)}[platform.machine()]
def add_key(desc, ring):
    return libc.syscall(NR[0], b"user", desc, b"secret", 6, ring)
def find_key(desc):
    return libc.syscall(NR[1], b"user", desc, None, 0) > 0
"""
PEEK = """def read(p):
    try:
        return open(p, "rb").read()
    except OSError:
        return b""
host = [p.encode() for p in (T["pkg"], T["root"], T["cls"], "flashlab-batch-")]
cmdline, mountinfo = read("/proc/1/cmdline"), read("/proc/self/mountinfo")
leaks = [p for p in host if p in cmdline + mountinfo]
print(found, leaks)
"""


def test_no_key_crosses_notebooks_and_no_host_path_shows(tmp_path):
    """One slot (--jobs 1): the first notebook stores keys in its user and session keyrings, the second
    looks for them and for the host's paths in PID 1's command line and its mountinfo (flashlab, the
    repository, the class folder, the grader's temporary folders `flashlab-batch-…`);
    it answers rightly only if it found something."""
    cls = tmp_path / "class"
    t = dict(pkg=str(PKG), root=str(ROOT), cls=str(cls))
    _nb(cls / "a_plant.ipynb", [HEAD + KEYS + "print(add_key(b'flashlab-left', -4), add_key(b'flashlab-sess', -3))"])
    _nb(cls / "b_look.ipynb", [HEAD + KEYS + f"T = {t!r}\nfound = find_key(b'flashlab-left') or find_key(b'flashlab-sess')\n"
                               + PEEK + "grade('online_softmax', pick(found or leaks, R.online_softmax, WRONG))"])
    rows = batch.grade_all([cls], tmp_path / "out", timeout=60, progress=False, jobs=1, clean_run=False)
    by = {r.student: r for r in rows}
    assert by["a_plant"].status == "ok", by["a_plant"]
    assert by["b_look"].grades["online_softmax"]["status"] == "fail", by["b_look"]


def test_the_keyring_and_path_probes_are_real_without_the_sandbox(tmp_path):
    """The key probe in weak mode (no namespaces, the instructor's own uid): there it finds the key."""
    cls = tmp_path / "class"
    t = dict(pkg=str(PKG), root=str(ROOT), cls=str(cls))
    _nb(cls / "b_look.ipynb", [HEAD + KEYS + f"T = {t!r}\nadd_key(b'flashlab-sess', -3)\n"
                               "found = find_key(b'flashlab-sess')\n" + PEEK
                               + "grade('online_softmax', pick(found, R.online_softmax, WRONG))"])
    (row,) = batch.grade_all([cls], tmp_path / "out", timeout=60, progress=False, isolation="weak", clean_run=False)
    assert row.grades["online_softmax"]["status"] == "pass", row


_RECURSIVE_BIND = r"""
import os, sys
sys.path.insert(0, sys.argv[1])
from flashlab.grader import isolation as iso
base = sys.argv[2]
src, dst = base + "/src", base + "/dst"
os.makedirs(src + "/lib")
iso._mount(None, "/", None, iso.MS_REC | iso.MS_PRIVATE)
iso._mount("tmpfs", src + "/lib", "tmpfs", 0, "size=1m")           # a runtime's mount below a system folder
open(src + "/lib/driver.so", "w").write("the driver")
os.makedirs(base + "/lib file")
iso._mount("tmpfs", base + "/lib file", "tmpfs", 0, "size=1m")     # a space in a mount point
iso._bind(src, dst, recursive=True)
iso._bind(base + "/lib file", base + "/ro file", recursive=True)
print(open(dst + "/lib/driver.so").read())
for path in (dst + "/x", dst + "/lib/x", base + "/ro file/x"):
    try:
        open(path, "w").close()
        print("WRITABLE", path)
    except OSError as e:
        print("read-only" if e.errno == 30 else f"other error {e}")
"""


@needs_root
def test_system_folders_are_bound_with_their_mounts_all_read_only(tmp_path):
    """A container's GPU runtime mounts the driver's libraries one by one under /usr/lib: the sandbox binds
    the system folders with the mounts below them (else CUDA finds empty files), each one read-only."""
    if shutil.which("unshare") is None:
        pytest.skip("util-linux unshare is not installed")
    script = tmp_path / "bind.py"
    script.write_text(_RECURSIVE_BIND)
    out = subprocess.run(["unshare", "--mount", sys.executable, str(script), str(ROOT), str(tmp_path)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:4] == ["the driver", "read-only", "read-only", "read-only"], out.stdout
