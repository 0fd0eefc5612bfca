"""The grader's commands for ``python -m flashlab``: assign and grade."""
from __future__ import annotations

import sys


def _assign(args):
    from .assign import assign
    return assign(args.solutions, args.exercises, check=args.check, force=args.force)


def _size(text: str) -> int:
    """Bytes from "4G", "512M", ...; "unlimited" is no limit (RLIM_INFINITY: CUDA reserves far more
    address space than it uses, so a GPU run may need it)."""
    import resource
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
    if text.strip().lower() in ("unlimited", "infinity", "none"):
        return resource.RLIM_INFINITY
    t = text.strip().lower().rstrip("b")
    return int(float(t[:-1]) * units[t[-1]]) if t and t[-1] in units else int(t)


def _grade(args):
    from .batch import grade_all
    from .isolation import IsolationError, Limits
    exercises = args.exercises.split(",") if args.exercises else None
    if exercises:
        from .exercises import EXERCISES
        unknown = [e for e in exercises if e not in EXERCISES]
        if unknown:
            print(f"error: unknown exercises {unknown}; they are: {', '.join(EXERCISES)}", file=sys.stderr)
            return 2
    limits = Limits(memory=_size(args.memory), processes=args.processes, cpu=int(args.cpu or args.timeout + 60))
    shape_list = None
    if args.leaderboard:
        from .ranking import shapes
        shape_list = shapes(args.leaderboard_seqlens, args.leaderboard_dims)
    try:
        rows = grade_all(args.submissions, args.out, args.timeout, progress=not args.quiet,
                         isolation=args.isolation, jobs=args.jobs, resume=args.resume,
                         student_pattern=args.student_pattern,
                         exercises=exercises, limits=limits, leaderboard=args.leaderboard,
                         leaderboard_shapes=shape_list)
    except (IsolationError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"stopped; the rows graded so far are in {args.out}/", file=sys.stderr)
        return 130
    with open_summary(args.out) as f:
        print(f.read(), end="")
    print(f"wrote {args.out}/grades.csv, {args.out}/summary.txt and {args.out}/results.jsonl")
    return 0 if rows is not None else 1


def open_summary(out):
    import os
    fd = os.open(os.path.join(out, "summary.txt"), os.O_RDONLY | os.O_NOFOLLOW)
    return os.fdopen(fd, encoding="utf-8")


def add_commands(sub) -> None:
    p = sub.add_parser("assign", help="generate exercises/ from solutions/ (or --check that it is up to date)")
    p.add_argument("--solutions", default="solutions")
    p.add_argument("--exercises", default="exercises")
    p.add_argument("--check", action="store_true", help="only verify; exit 1 if exercises/ is out of date")
    p.add_argument("--force", action="store_true", help="overwrite exercise notebooks a learner has edited")
    p.set_defaults(func=_assign)

    p = sub.add_parser("grade", help="grade submitted exercise notebooks, each in its own sandbox")
    p.add_argument("submissions", nargs="+", help="class folders (one folder or notebook per student) or notebooks")
    p.add_argument("--out", default="grades", help="folder for results.jsonl, grades.csv and summary.txt")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per notebook, kernel start included")
    p.add_argument("--resume", action="store_true",
                   help="keep the rows of notebooks already graded in --out with the same content")
    p.add_argument("--jobs", type=int, default=1, help="notebooks graded at once (each in its own sandbox)")
    p.add_argument("--student-pattern", default=None,
                   help="regular expression on the notebook's relative path; its group 'student' names the "
                        "student (default: the first folder, or the file name)")
    p.add_argument("--exercises", default=None, help="comma-separated exercises that count (default: all graded)")
    p.add_argument("--isolation", choices=("auto", "sandbox", "weak"), default="auto",
                   help="auto/sandbox: namespaces and an unprivileged uid (needs root; fails loudly "
                        "otherwise); weak: student code runs as you (trusted notebooks only)")
    p.add_argument("--memory", default="4G",
                   help="memory per process, and per notebook where a cgroup is available (e.g. 4G)")
    p.add_argument("--processes", type=int, default=256, help="processes and threads per submission")
    p.add_argument("--cpu", type=int, default=None, help="CPU seconds per process (default: timeout + 60)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--leaderboard", action="store_true",
                   help="on a GPU, also time every kernel that passes flash_forward / flash_backward in its sandbox, "
                        "beside SDPA and flashlab's op, and write leaderboard.csv and leaderboard.png (on a CPU: "
                        "grading only, and a message)")
    p.add_argument("--leaderboard-seqlens", type=int, nargs="+", default=[1024, 4096, 16384],
                   help="sequence lengths timed (16k tokens per batch)")
    p.add_argument("--leaderboard-dims", type=int, nargs="+", default=[64, 128], choices=(16, 32, 64, 128),
                   help="head dims timed")
    p.set_defaults(func=_grade)
