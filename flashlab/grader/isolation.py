"""Run one submission isolated from the grader, the machine and the other submissions.

Two setups, chosen by :func:`choose`:

``sandbox`` (the grader runs as root, Linux, util-linux ``unshare``): the submission
runs in fresh mount, PID, network, IPC and UTS namespaces (``unshare``), in a new
root built from a tmpfs with read-only bind mounts of the system directories, the
Python installation and the ``flashlab`` package only (not its checkout: no
solutions, no other submissions, no grades, no home directories), a private
size-capped tmpfs home, ``/tmp`` and ``/dev/shm``, and a read-only control folder
holding the notebook, the kernel spec and the grader's socket.  It runs as an
unused unprivileged uid (one per parallel slot), with no capabilities,
``no_new_privs``, resource limits (address space, processes, CPU time, file size,
open files, no core dumps), no network (only its own loopback), stdout and stderr
into a capped log file.  Its init process is the namespace's PID 1: when the
notebook's runner exits, or the grader kills it, or the grader dies
(``setpriv --pdeathsig`` and ``unshare --kill-child``), the kernel kills every
process of the submission.

``weak`` (not root, or asked for): a private folder, a scrubbed environment,
resource limits (``prlimit``), its own session killed at the end.  Student code runs
as the instructor and can read and write what the instructor can, and a process
that leaves the session can outlive the run.  Only for trusted notebooks; for
untrusted ones run the grader as root on a Linux machine or VM, or use a container
or VM per submission.

This file also runs as a script (the sandbox's init, as root inside the new
namespaces): it imports nothing from flashlab.
"""
from __future__ import annotations

import ctypes
import json
import os
import platform
import pwd
import resource
import shutil
import signal
import socket
import stat
import struct
import subprocess
import sys
from dataclasses import asdict, dataclass, field

HOME = "/home/student"
CTL = "/run/flashlab"                    # read-only: notebook, kernel spec, socket
SOCKET_NAME = "grader.sock"              # the grader's socket, in CTL
PKG = "/opt/flashlab"                    # read-only: the flashlab package, on PYTHONPATH
KERNEL_NAME = "flashlab-batch"
UID_BASE = 2_100_000_000                 # slot k runs as UID_BASE + k: a uid that owns nothing here
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc")
DEVICES = ("null", "zero", "full", "random", "urandom")


@dataclass
class Limits:
    memory: int = 4 << 30          # address space per process (RLIMIT_AS), bytes; RLIM_INFINITY (-1): none
    processes: int = 256           # processes and threads of the submission's uid (RLIMIT_NPROC)
    cpu: int = 900                 # CPU seconds per process (RLIMIT_CPU)
    file_size: int = 64 << 20      # largest file it can write, the log included (RLIMIT_FSIZE)
    open_files: int = 1024
    home: int = 512 << 20          # tmpfs sizes
    tmp: int = 512 << 20
    shm: int = 256 << 20


@dataclass
class Plan:
    """Everything the sandbox's init needs; written as JSON by the grader (root-owned, read-only)."""
    root: str                      # an empty folder to build the new root on
    ctl: str                       # host folder mounted read-only at CTL
    pkg: str                       # the flashlab package folder, mounted read-only at PKG/flashlab
    python: str                    # the interpreter, as the run names it (a venv's bin/python: not resolved)
    trees: list                    # host folders mounted read-only at the same path (Python installation),
                                   # or [host folder, path inside] pairs
    argv: list                     # the runner's command line (inside the sandbox)
    env: dict
    uid: int
    gid: int
    limits: dict = field(default_factory=lambda: asdict(Limits()))
    devices: list = field(default_factory=list)   # extra device nodes (GPU)
    cgroups: list = field(default_factory=list)   # cgroup folders the sandbox joins first
    listen_fd: int = -1            # a socket to the grader: the sandbox makes the grader's listening socket
                                   # at CTL/grader.sock (on its own tmpfs) and sends it back through this


class IsolationError(RuntimeError):
    """The isolation asked for is not available here; the message says why and what to do."""


# ----------------------------------------------------------------------------
# the grader's side: what can be had here, and the command that starts a sandbox
# ----------------------------------------------------------------------------

def choose(requested: str = "auto") -> str:
    """``sandbox`` or ``weak``; raises IsolationError where ``sandbox`` is asked (or implied
    by ``auto``) and cannot be had.  ``auto`` never falls back silently."""
    if requested == "weak":
        return "weak"
    missing = []
    if not sys.platform.startswith("linux"):
        missing.append("Linux")
    if os.geteuid() != 0:
        missing.append("root (the grader switches each submission to an unprivileged uid)")
    for tool in ("unshare", "setpriv"):
        if shutil.which(tool) is None:
            missing.append(f"`{tool}` (util-linux)")
    if missing:
        raise IsolationError(
            "cannot sandbox submissions here: needs " + ", ".join(missing) + ". Run the grader as root on a "
            "Linux machine or VM (sudo \"$(which python)\" -m flashlab grade ...), or grade each submission "
            "in its own container or VM. `--isolation weak` runs student code as you, with your files and "
            "network: only for notebooks you trust.")
    return "sandbox"


def interpreter() -> str:
    """The interpreter this run uses, as it was started (not its real path): a virtual
    environment's ``bin/python`` is a link to the base interpreter, and only started through
    the link does Python find the environment's ``pyvenv.cfg``, and so its packages."""
    return os.path.abspath(sys.executable)


def python_trees() -> list:
    """The folders the interpreter and its packages live in: each a host folder (real path,
    outermost only) mounted read-only at the same path, or a pair [real path, path] where the
    interpreter is reached through a link (a virtual environment found through a linked folder)."""
    import site
    cands = {sys.prefix, sys.base_prefix, sys.exec_prefix, os.path.dirname(os.path.realpath(sys.executable))}
    try:
        cands.update(site.getsitepackages())
    except AttributeError:   # pragma: no cover - old virtualenv
        pass
    real = sorted({os.path.realpath(p) for p in cands if os.path.isdir(p)})
    out = []
    for p in real:
        if p in ("/", "/usr", "/etc") or any(p == q or p.startswith(q.rstrip("/") + "/") for q in out):
            continue
        if any(p == s or p.startswith(s + "/") for s in SYSTEM_DIRS):
            continue                      # already mounted with the system folders
        out.append(p)
    # the interpreter's own folder as the run names it (a venv's bin/ reached through a linked folder)
    named = os.path.dirname(os.path.dirname(interpreter()))
    if os.path.realpath(named) != named and not any(named == s or named.startswith(s + "/") for s in SYSTEM_DIRS):
        out.append([os.path.realpath(named), named])
    return out


def gpu_devices() -> list:
    return sorted(os.path.join("/dev", n) for n in os.listdir("/dev") if n.startswith("nvidia")) \
        if os.path.isdir("/dev") else []


def uid_for(slot: int) -> int:
    uid = UID_BASE + slot
    try:
        pwd.getpwuid(uid)
    except KeyError:
        return uid
    raise IsolationError(f"uid {uid} belongs to a user here; the sandbox needs an unused uid")


def _cgroup_v1_base(controller: str):
    """This process's cgroup folder for a v1 controller, if the grader may create children there."""
    try:
        with open("/proc/self/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:
        _, ctrls, path = line.split(":", 2)
        if controller in ctrls.split(","):
            base = f"/sys/fs/cgroup/{controller}{path}"
            return base if os.path.isdir(base) and os.access(base, os.W_OK) else None
    return None


def make_cgroups(name: str, limits: Limits) -> list:
    """A memory cgroup (the whole submission's memory) and a pids cgroup, where cgroup v1 is writable.
    Returns the folders made ([] where there is none: then only the per-process limits hold)."""
    made = []
    for ctrl, settings in (("memory", {"memory.limit_in_bytes": limits.memory}),
                           ("pids", {"pids.max": limits.processes})):
        base = _cgroup_v1_base(ctrl)
        if base is None:
            continue
        d = os.path.join(base, name)
        try:
            os.mkdir(d)
            for k, v in settings.items():
                with open(os.path.join(d, k), "w") as f:
                    f.write(str(v))
        except OSError:
            remove_cgroups([d])
            continue
        made.append(d)
    return made


def cgroup_hit_limit(dirs: list) -> bool:
    for d in dirs:
        for name in ("memory.failcnt",):
            try:
                with open(os.path.join(d, name)) as f:
                    if int(f.read().strip() or 0) > 0:
                        return True
            except (OSError, ValueError):
                pass
    return False


def remove_cgroups(dirs: list) -> None:
    import time
    for d in dirs:
        for _ in range(50):
            try:
                os.rmdir(d)
                break
            except FileNotFoundError:
                break
            except OSError:                     # processes still leaving
                time.sleep(0.05)


def sandbox_command(plan_path: str) -> list:
    """The command that builds the sandbox from ``plan_path`` and runs the runner in it."""
    return [shutil.which("setpriv"), "--pdeathsig", "KILL", "--",
            shutil.which("unshare"), "--mount", "--pid", "--net", "--ipc", "--uts", "--fork", "--kill-child",
            "--propagation", "private", "--",
            os.path.realpath(sys.executable), "-I", "-S", os.path.abspath(__file__), "init", plan_path]


def weak_command(argv: list, limits: Limits) -> list:
    """The runner under resource limits (``prlimit``) and parent-death kill (``setpriv``), where present."""
    cmd = []
    if shutil.which("setpriv"):
        cmd += ["setpriv", "--pdeathsig", "KILL", "--"]
    if shutil.which("prlimit"):
        cmd += ["prlimit", f"--as={limits.memory if limits.memory >= 0 else 'unlimited'}", f"--cpu={limits.cpu}", f"--fsize={limits.file_size}",
                f"--nofile={limits.open_files}", "--core=0", "--"]
    return cmd + argv


# ----------------------------------------------------------------------------
# the sandbox's init (root inside the new namespaces; PID 1)
# ----------------------------------------------------------------------------

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
MNT_DETACH = 2
PR_SET_NO_NEW_PRIVS = 38
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}

_libc = None


def _c():
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    return _libc


def _b(s):
    return None if s is None else os.fsencode(s)


def _mount(src, dst, fstype=None, flags=0, data=None):
    if _c().mount(_b(src), _b(dst), _b(fstype), ctypes.c_ulong(flags), _b(data)) != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"mount {src} on {dst}: {os.strerror(e)}")


def _bind(src, dst, readonly=True, extra=MS_NOSUID | MS_NODEV, recursive=False):
    """Bind ``src`` at ``dst``.  ``recursive``: with the mounts below ``src`` too (a container's runtime mounts
    the GPU driver's libraries file by file into /usr/lib: without them the sandbox sees empty files and
    CUDA does not start), each of them made read-only as well."""
    if os.path.isdir(src):
        os.makedirs(dst, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        if not os.path.exists(dst):
            open(dst, "w").close()
    _mount(src, dst, None, MS_BIND | (MS_REC if recursive else 0))
    if readonly:
        for point in (_mounts_under(dst) if recursive else [dst]):
            _mount(None, point, None, MS_BIND | MS_REMOUNT | MS_RDONLY | extra)


def _unescape_mountinfo(field: str) -> str:
    """/proc/self/mountinfo writes space, tab, newline and backslash in paths as octal escapes (\\040 ...)."""
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and i + 3 < len(field) and field[i + 1:i + 4].isdigit():
            out.append(chr(int(field[i + 1:i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def _mounts_under(path: str) -> list:
    """The mount points at ``path`` and below it, in the order they were mounted (parents first)."""
    with open("/proc/self/mountinfo") as f:
        points = [_unescape_mountinfo(line.split()[4]) for line in f if line.strip()]
    seen, out = set(), []
    for p in points:
        if (p == path or p.startswith(path.rstrip("/") + "/")) and p not in seen:
            seen.add(p)
            out.append(p)
    return out


def _pivot(new_root):
    os.chdir(new_root)
    nr = SYS_PIVOT_ROOT.get(platform.machine())
    if nr is not None:
        if _c().syscall(ctypes.c_long(nr), b".", b".") != 0:
            e = ctypes.get_errno()
            raise OSError(e, f"pivot_root: {os.strerror(e)}")
    else:                               # pragma: no cover - other architectures
        subprocess.run(["pivot_root", ".", "."], check=True)
    if _c().umount2(b".", MNT_DETACH) != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"detaching the old root: {os.strerror(e)}")
    os.chdir("/")


def _loopback_up():
    """Bring up `lo` in the new network namespace (the kernel and its client talk over it)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        import fcntl
        ifr = struct.pack("16sH", b"lo", 0)
        flags = struct.unpack("16sH", fcntl.ioctl(s, 0x8913, ifr)[:18])[1]          # SIOCGIFFLAGS
        fcntl.ioctl(s, 0x8914, struct.pack("16sH", b"lo", flags | 1))                # SIOCSIFFLAGS, IFF_UP
    finally:
        s.close()


def _build_root(plan: Plan):
    lim = Limits(**plan.limits)
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    new = plan.root
    _mount("tmpfs", new, "tmpfs", MS_NOSUID | MS_NODEV, "size=64m,mode=0755")
    for d in SYSTEM_DIRS:
        if os.path.islink(d):
            os.symlink(os.readlink(d), new + d)
        elif os.path.isdir(d):
            _bind(d, new + d, recursive=True)
    # /dev: a few harmless nodes, a private /dev/shm
    os.makedirs(new + "/dev")
    _mount("tmpfs", new + "/dev", "tmpfs", MS_NOSUID | MS_NOEXEC, "size=64k,mode=0755")
    for n in DEVICES:
        if os.path.exists("/dev/" + n):
            _bind("/dev/" + n, new + "/dev/" + n, readonly=False)
    for d in plan.devices:
        _bind(d, new + d, readonly=False)
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
                         ("stderr", "/proc/self/fd/2")):
        os.symlink(target, f"{new}/dev/{name}")
    os.makedirs(new + "/dev/shm")
    _mount("tmpfs", new + "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV, f"size={lim.shm},mode=1777")
    os.makedirs(new + "/proc")
    _mount("proc", new + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    os.makedirs(new + "/tmp")
    _mount("tmpfs", new + "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, f"size={lim.tmp},mode=1777")
    os.makedirs(new + HOME)
    _mount("tmpfs", new + HOME, "tmpfs", MS_NOSUID | MS_NODEV,
           f"size={lim.home},mode=0700,uid={plan.uid},gid={plan.gid}")
    for t in plan.trees:                # after the tmpfs mounts, so that none of them hides a tree
        src, dst = (t, t) if isinstance(t, str) else t
        _bind(src, new + dst, recursive=True)
    # flashlab and the control files are copies on tmpfs, not binds: the sandbox's mountinfo then names
    # no folder of the host for them (only the socket is a bind, of one file)
    shutil.copytree(plan.pkg, new + PKG + "/flashlab", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(plan.ctl) for f in fs
               if not stat.S_ISSOCK(os.lstat(os.path.join(d, f)).st_mode))
    os.makedirs(new + CTL)
    _mount("tmpfs", new + CTL, "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, f"size={size + (1 << 20)},mode=0755")
    for d, dirs, files in os.walk(plan.ctl):
        rel = os.path.relpath(d, plan.ctl)
        inside = os.path.normpath(os.path.join(new + CTL, rel))
        os.makedirs(inside, exist_ok=True)
        os.chmod(inside, 0o755)
        for f in files:
            src = os.path.join(d, f)
            if stat.S_ISSOCK(os.lstat(src).st_mode):
                _bind(src, os.path.join(inside, f), extra=MS_NOSUID | MS_NODEV | MS_NOEXEC)
            elif stat.S_ISREG(os.lstat(src).st_mode):
                shutil.copyfile(src, os.path.join(inside, f), follow_symlinks=False)
                os.chmod(os.path.join(inside, f), 0o644)
    if plan.listen_fd >= 0:
        _listen_for_grader(plan.listen_fd, new + CTL + "/" + SOCKET_NAME)
    _mount(None, new + CTL, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC)
    _pivot(new)
    _mount(None, "/", None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)


def _listen_for_grader(chan_fd: int, path: str):
    """Bind the grader's listening socket at ``path`` (on the sandbox's own tmpfs: the sandbox's mountinfo
    then names no host folder for it) and hand it to the grader through ``chan_fd``; keep no copy."""
    chan = socket.socket(fileno=chan_fd)
    try:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.bind(path)
            os.chmod(path, 0o666)
            s.listen(16)
            socket.send_fds(chan, [b"L"], [s.fileno()])
        finally:
            s.close()
    finally:
        chan.close()


def _drop_and_exec(plan: Plan):
    lim = Limits(**plan.limits)
    os.setsid()
    for res, val in ((resource.RLIMIT_AS, lim.memory), (resource.RLIMIT_NPROC, lim.processes),
                     (resource.RLIMIT_CPU, lim.cpu), (resource.RLIMIT_FSIZE, lim.file_size),
                     (resource.RLIMIT_NOFILE, lim.open_files), (resource.RLIMIT_CORE, 0)):
        resource.setrlimit(res, (val, val))
    os.setgroups([])
    os.setgid(plan.gid)
    os.setuid(plan.uid)
    try:
        os.setuid(0)
    except PermissionError:
        pass
    else:                                                   # pragma: no cover - would be a kernel bug
        raise RuntimeError("could regain root after dropping it")
    _fresh_keyrings()
    if _c().prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(NO_NEW_PRIVS)")
    os.chdir(HOME)
    os.execve(plan.argv[0], plan.argv, plan.env)


SYS_KEYCTL = {"x86_64": 250, "aarch64": 219}
KEYCTL_JOIN_SESSION_KEYRING, KEYCTL_CLEAR = 1, 7
KEY_SPEC_USER_KEYRING, KEY_SPEC_USER_SESSION_KEYRING = -4, -5


def _fresh_keyrings():
    """As the submission's uid: empty the uid's own keyrings (what an earlier notebook run as this uid left
    there) and start a new, empty session keyring: no key crosses from one notebook to the next."""
    nr = SYS_KEYCTL.get(platform.machine())
    if nr is None:                              # pragma: no cover - other architectures
        return
    for ring in (KEY_SPEC_USER_KEYRING, KEY_SPEC_USER_SESSION_KEYRING):
        _c().syscall(ctypes.c_long(nr), ctypes.c_long(KEYCTL_CLEAR), ctypes.c_long(ring))
    if _c().syscall(ctypes.c_long(nr), ctypes.c_long(KEYCTL_JOIN_SESSION_KEYRING), None) < 0:
        e = ctypes.get_errno()
        if e != 38:                             # ENOSYS: a kernel without keyrings has nothing to share
            raise OSError(e, f"a fresh session keyring: {os.strerror(e)}")


def init(plan_path: str) -> int:
    """PID 1 of the sandbox, first stage (host paths still visible): join the cgroups, build the new
    root, then start over inside it, so that PID 1's command line names no host path."""
    with open(plan_path) as f:
        text = f.read()
    plan = Plan(**json.loads(text))
    os.umask(0o022)
    try:
        for d in plan.cgroups:                  # before anything else: every later process inherits it
            with open(os.path.join(d, "cgroup.procs"), "w") as f:
                f.write(str(os.getpid()))
        _build_root(plan)
        r, w = os.pipe()
        os.write(w, text.encode())              # a plan is a few kB: far under a pipe's capacity
        os.close(w)
        os.set_inheritable(r, True)
        py = os.path.realpath(sys.executable)
        os.execv(py, [py, "-I", "-S", PKG + "/flashlab/grader/isolation.py", "inside", str(r)])
    except Exception as e:
        print(f"flashlab sandbox: cannot build the sandbox: {e}", file=sys.stderr, flush=True)
        return 120


def inside(fd: int) -> int:
    """PID 1 of the sandbox, second stage (in the new root): start the runner unprivileged, reap, exit
    with its status."""
    with os.fdopen(fd) as f:
        plan = Plan(**json.loads(f.read()))
    os.umask(0o022)
    try:
        socket.sethostname("sandbox")
        _loopback_up()
    except Exception as e:
        print(f"flashlab sandbox: cannot build the sandbox: {e}", file=sys.stderr, flush=True)
        return 120
    pid = os.fork()
    if pid == 0:
        try:
            _drop_and_exec(plan)
        except BaseException as e:
            print(f"flashlab sandbox: cannot start the runner unprivileged: {e}", file=sys.stderr, flush=True)
        os._exit(121)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    while True:                       # reap orphans until the runner exits; then the kernel kills the rest
        try:
            p, status = os.waitpid(-1, 0)
        except ChildProcessError:
            return 122
        except InterruptedError:      # pragma: no cover
            continue
        if p == pid:
            if os.WIFSIGNALED(status):
                return 128 + os.WTERMSIG(status)
            return os.WEXITSTATUS(status)


def is_regular(path: str) -> bool:
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "init":
    sys.exit(init(sys.argv[2]))
if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "inside":
    sys.exit(inside(int(sys.argv[2])))
