"""The class as files: which notebooks belong to whom, and the tables written about them.

Inputs: regular files ending in ``.ipynb`` (any case) only; links and special files are listed as
skipped and never opened.  A student is the first folder under the class folder, or the file name
of a notebook directly in it, or what ``--student-pattern`` captures.  Outputs: written in a
folder opened without following links, replaced atomically; every text cell made printable (any
bytes, no control characters) and never a spreadsheet formula.
"""
from __future__ import annotations

import csv
import io
import os
import re
import secrets
import stat
from dataclasses import dataclass, field

MAX_NOTEBOOK = 32 << 20          # bytes
RUN_ORDER = ["ok", "cell errors", "timed out", "crashed", "rejected"]      # better -> worse
VERDICT_ORDER = ["pass", "not implemented", "missing", "fail", "error"]    # better -> worse
SHORT = {"pass": "pass", "fail": "FAIL", "not implemented": "todo", "error": "ERR", "missing": "-"}


# ----------------------------------------------------------------------------
# finding submissions
# ----------------------------------------------------------------------------

@dataclass
class Submission:
    student: str
    notebook: str                # path relative to the class folder's parent (any bytes: surrogate-escaped)
    path: str
    root: str = ""               # the class folder as given; the notebook is opened from it, one folder at a
    parts: tuple = ()            # time, by file descriptor (parts: the names below root), never through a link


@dataclass
class Skipped:
    path: str
    reason: str


def _is_notebook_name(name: str) -> bool:
    return name.lower().endswith(".ipynb") and len(name) > len(".ipynb")


def _stem(name: str) -> str:
    return name[:-len(".ipynb")]


def discover(paths, student_pattern: str | None = None):
    """(submissions, skipped) under ``paths`` (folders or notebook files).  Never follows a link."""
    pattern = re.compile(student_pattern) if student_pattern else None
    subs, skipped = [], []

    def student_of(rel: str, default: str):
        if pattern is None:
            return default
        m = pattern.search(rel)
        if not m:
            return None
        if "student" in pattern.groupindex:
            return m.group("student")
        return m.group(1) if pattern.groups else m.group(0)

    def add(path, rel, default, root="", parts=()):
        who = student_of(rel, default)
        if not who:
            skipped.append(Skipped(rel, "no student name (does not match --student-pattern)"))
        else:
            subs.append(Submission(who, rel, path, root, tuple(parts)))

    def walk(root: str, top: str, base: str, depth: int):
        try:
            entries = sorted(os.scandir(root), key=lambda e: e.name)
        except OSError as e:
            skipped.append(Skipped(os.path.relpath(root, top), f"cannot list: {e.strerror}"))
            return
        for e in entries:
            rel = os.path.relpath(e.path, top)
            if e.is_symlink():
                skipped.append(Skipped(rel, "symbolic link, not followed"))
            elif e.is_dir(follow_symlinks=False):
                if e.name == ".ipynb_checkpoints":
                    continue
                if depth >= 8:
                    skipped.append(Skipped(rel, "folder nested too deeply"))
                else:
                    walk(e.path, top, base, depth + 1)
            elif e.is_file(follow_symlinks=False):
                if _is_notebook_name(e.name):
                    parts = os.path.relpath(e.path, base).split(os.sep)
                    add(e.path, rel, parts[0] if len(parts) > 1 else _stem(parts[0]), base, parts)
                else:
                    skipped.append(Skipped(rel, "not a notebook (.ipynb) file"))
            else:
                skipped.append(Skipped(rel, "not a regular file (FIFO, socket or device), not opened"))

    for arg in paths:
        arg = os.fsdecode(arg) if isinstance(arg, bytes) else str(arg)
        try:
            st = os.lstat(arg)
        except OSError as e:
            skipped.append(Skipped(arg, f"cannot read: {e.strerror}"))
            continue
        if stat.S_ISLNK(st.st_mode):
            skipped.append(Skipped(arg, "symbolic link, not followed"))
        elif stat.S_ISDIR(st.st_mode):
            base = os.path.abspath(arg)
            walk(base, os.path.dirname(base), base, 0)
        elif stat.S_ISREG(st.st_mode) and _is_notebook_name(os.path.basename(arg)):
            add(arg, os.path.basename(arg), _stem(os.path.basename(arg)))
        elif stat.S_ISREG(st.st_mode):
            skipped.append(Skipped(arg, "not a notebook (.ipynb) file"))
        else:
            skipped.append(Skipped(arg, "not a regular file (FIFO, socket or device), not opened"))
    return subs, skipped


_DIR_FLAGS = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)


def _open_below(root: str, parts) -> int:
    """An fd of root/parts[0]/.../parts[-1], each folder opened from the one above it by file descriptor
    with O_NOFOLLOW | O_DIRECTORY (openat): a folder swapped for a link after the listing is refused."""
    fd = os.open(root, _DIR_FLAGS)
    try:
        for name in parts[:-1]:
            nxt = os.open(name, _DIR_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = nxt
        return os.open(parts[-1], _FILE_FLAGS, dir_fd=fd)
    finally:
        os.close(fd)


def read_submission(path, root: str = "", parts=()) -> bytes:
    """The file's bytes; refuses links (in any folder below ``root`` too, where given), special files and
    files over the size limit (no blocking on a FIFO).  ``path`` may be a Submission."""
    if isinstance(path, Submission):
        path, root, parts = path.path, path.root, path.parts
    if root and parts and os.open in os.supports_dir_fd:
        fd = _open_below(root, parts)
    else:
        fd = os.open(path, _FILE_FLAGS)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError("not a regular file")
        if st.st_size > MAX_NOTEBOOK:
            raise ValueError(f"{st.st_size} bytes, over the {MAX_NOTEBOOK >> 20} MiB limit")
        with os.fdopen(os.dup(fd), "rb") as f:
            data = f.read(MAX_NOTEBOOK + 1)
        if len(data) > MAX_NOTEBOOK:
            raise ValueError(f"over the {MAX_NOTEBOOK >> 20} MiB limit")
        return data
    finally:
        os.close(fd)


def check_notebook(data: bytes) -> str:
    """'' if ``data`` is a notebook nbformat can run, else why not (never quoting the file)."""
    import nbformat
    try:
        text = data.decode("utf-8")
        nb = nbformat.reads(text, as_version=4)
    except UnicodeDecodeError:
        return "not UTF-8 text"
    except RecursionError:
        return "JSON nested too deeply"
    except Exception as e:
        return f"not a notebook ({type(e).__name__})"
    if not isinstance(nb.get("cells"), list):
        return "not a notebook (no cells)"
    return ""


# ----------------------------------------------------------------------------
# safe text: names with any bytes, CSV cells that are not formulas
# ----------------------------------------------------------------------------

def show(s) -> str:
    """One printable line: undecodable bytes as \\xNN, control and invisible characters escaped."""
    out = []
    for ch in str(s):
        o = ord(ch)
        if 0xDC80 <= o <= 0xDCFF:
            out.append(f"\\x{o - 0xDC00:02x}")
        elif ch.isprintable():
            out.append(ch)
        else:
            out.append(ch.encode("unicode_escape", "backslashreplace").decode("ascii"))
    return "".join(out)


def csv_cell(value) -> str:
    s = show(value)
    return "'" + s if s[:1] in ("=", "+", "-", "@", "\t", "\r", "|", "%") else s


# ----------------------------------------------------------------------------
# the output folder: no links followed, atomic replacement
# ----------------------------------------------------------------------------

class OutDir:
    def __init__(self, path):
        path = os.path.abspath(os.fsdecode(path) if isinstance(path, bytes) else str(path))
        if os.path.islink(path):
            raise ValueError(f"the output folder {show(path)} is a symbolic link: refusing to follow it")
        os.makedirs(path, exist_ok=True)
        self.path = path
        self.fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        self._append = None

    def replace(self, name: str, text: str | bytes) -> None:
        tmp = f".{name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644, dir_fd=self.fd)
        try:
            with (os.fdopen(fd, "wb") if isinstance(text, bytes) else
                  os.fdopen(fd, "w", encoding="utf-8", newline="")) as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, name, src_dir_fd=self.fd, dst_dir_fd=self.fd)
        except BaseException:
            try:
                os.unlink(tmp, dir_fd=self.fd)
            except OSError:
                pass
            raise

    def _refuse_link(self, name):
        if os.path.islink(os.path.join(self.path, name)):
            raise ValueError(f"{name} in the output folder is a symbolic link: refusing to follow it")

    def read(self, name: str) -> str:
        self._refuse_link(name)
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=self.fd)
        except FileNotFoundError:
            return ""
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                raise ValueError(f"{name} in the output folder is not a regular file")
            return f.read().decode("utf-8", "replace")

    def open_append(self, name: str, fresh: bool) -> None:
        if fresh:
            self.replace(name, "")
        self._refuse_link(name)
        fd = os.open(name, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o644, dir_fd=self.fd)
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise ValueError(f"{name} in the output folder is not a regular file")
        self._append = fd

    def append_line(self, line: str) -> None:
        data = (line.rstrip("\n") + "\n").encode("ascii")
        view = memoryview(data)
        while view:
            view = view[os.write(self._append, view):]
        os.fsync(self._append)

    def close(self) -> None:
        for fd in (self._append, self.fd):
            if fd is not None:
                try:
                    os.close(fd)
                except OSError:
                    pass
        self._append = None


# ----------------------------------------------------------------------------
# the class table
# ----------------------------------------------------------------------------

@dataclass
class StudentRow:
    student: str
    notebooks: list
    status: str                     # the worst run status of the student's notebooks
    grades: dict                    # exercise -> verdict dict ("status", ...)
    detail: str = ""
    notes: list = field(default_factory=list)


def student_rows(records: list, exercises=None) -> list:
    by = {}
    for r in records:
        by.setdefault(r["student"], []).append(r)
    rows = []
    for student in sorted(by):
        recs = sorted(by[student], key=lambda r: r["notebook"])
        grades, where, notes = {}, {}, []
        for r in recs:
            for ex, v in r["grades"].items():
                where.setdefault(ex, []).append((r["notebook"], v["status"]))
                if ex not in grades or VERDICT_ORDER.index(v["status"]) > VERDICT_ORDER.index(grades[ex]["status"]):
                    grades[ex] = v
        for ex, places in where.items():
            if len(places) > 1:
                notes.append(f"{ex} graded in {len(places)} notebooks ("
                             + ", ".join(f"{show(nb)}: {st}" for nb, st in places) + "); the worst counts")
        status = max((r["status"] for r in recs), key=RUN_ORDER.index)
        details = [(f"{show(r['notebook'])}: {r['status']}, " if len(recs) > 1 else "") + r["detail"]
                   for r in recs if r["detail"]]
        for r in recs:
            notes += [f"{show(r['notebook'])}: {n}" for n in r.get("notes", [])]
        rows.append(StudentRow(student, [r["notebook"] for r in recs], status, grades, "; ".join(details), notes))
    return rows


def exercise_columns(rows, exercises=None) -> list:
    if exercises:
        return list(exercises)
    cols = []
    for r in rows:
        for name in r.grades:
            if name not in cols:
                cols.append(name)
    return sorted(cols)


def _status(row, ex) -> str:
    return row.grades.get(ex, {}).get("status", "missing")


def format_csv(rows, exercises=None) -> str:
    cols = exercise_columns(rows, exercises)
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(["student", "notebooks", "run"] + cols + ["passed", "detail"])
    for r in rows:
        w.writerow([csv_cell(r.student), csv_cell(" | ".join(show(n) for n in r.notebooks)), r.status]
                   + [_status(r, c) for c in cols]
                   + [f"{sum(_status(r, c) == 'pass' for c in cols)}/{len(cols)}", csv_cell(r.detail)])
    return buf.getvalue()


def format_summary(rows, skipped=(), exercises=None, header: str = "") -> str:
    cols = exercise_columns(rows, exercises)
    names = [show(r.student) for r in rows]
    w = max([len("student")] + [len(n) for n in names])
    widths = [max(len(c), 5) for c in cols]
    lines = [header] if header else []
    lines.append("  ".join([f"{'student':<{w}}", f"{'run':<12}"] + [f"{c:<{cw}}" for c, cw in zip(cols, widths)]
                           + ["passed"]))
    for r, n in zip(rows, names):
        cells = [f"{SHORT.get(_status(r, c), '?'):<{cw}}" for c, cw in zip(cols, widths)]
        passed = sum(_status(r, c) == "pass" for c in cols)
        lines.append("  ".join([f"{n:<{w}}", f"{r.status:<12}"] + cells + [f"{passed}/{len(cols)}"]))

    def section(title, items):
        if items:
            lines.append("")
            lines.append(title)
            lines.extend("  " + i for i in items)

    full = [n for r, n in zip(rows, names) if cols and all(_status(r, c) == "pass" for c in cols)]
    section(f"Passed everything ({len(full)}):", [", ".join(full)] if full else [])
    failed = []
    for r, n in zip(rows, names):
        bad = [f"{c} {SHORT[_status(r, c)]}" + (f" ({show(r.grades[c].get('message', ''))})"
                                                 if r.grades.get(c, {}).get("message") else "")
               for c in cols if _status(r, c) in ("fail", "error")]
        if bad:
            failed.append(f"{n}: " + "; ".join(bad))
    section("Failed:", failed)
    for st, title in (("timed out", "Timed out:"), ("crashed", "Crashed:"), ("rejected", "Rejected:"),
                      ("cell errors", "Errors in cells (the rest of the notebook still ran):")):
        section(title, [f"{n}: {r.detail}" for r, n in zip(rows, names) if r.status == st])
    section("Notes:", [f"{n}: {show(x)}" for r, n in zip(rows, names) for x in r.notes])
    section(f"Skipped files ({len(skipped)}):", [f"{show(s.path)}: {s.reason}" for s in skipped])
    return "\n".join(lines) + "\n"
