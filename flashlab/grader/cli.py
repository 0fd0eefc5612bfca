"""The grader's commands for ``python -m flashlab``: assign and grade."""
from __future__ import annotations


def _assign(args):
    from .assign import assign
    return assign(args.solutions, args.exercises, check=args.check, force=args.force)


def _grade(args):
    from .batch import grade_all
    rows = grade_all(args.submissions, args.out, args.timeout, progress=not args.quiet)
    from .batch import format_summary
    print(format_summary(rows))
    print(f"wrote {args.out}/grades.csv and {args.out}/summary.txt")
    return 0


def add_commands(sub) -> None:
    p = sub.add_parser("assign", help="generate exercises/ from solutions/ (or --check that it is up to date)")
    p.add_argument("--solutions", default="solutions")
    p.add_argument("--exercises", default="exercises")
    p.add_argument("--check", action="store_true", help="only verify; exit 1 if exercises/ is out of date")
    p.add_argument("--force", action="store_true", help="overwrite exercise notebooks a learner has edited")
    p.set_defaults(func=_assign)

    p = sub.add_parser("grade", help="grade submitted exercise notebooks, one process each")
    p.add_argument("submissions", nargs="+", help="notebooks or folders of notebooks")
    p.add_argument("--out", default="grades", help="folder for grades.csv and summary.txt")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per notebook (and per cell)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_grade)
