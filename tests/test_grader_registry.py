"""One seam for an exercise: every exercise is declared once, in its part's module of
flashlab.grader.exercises, and grade(), exercises(), batch grading and the CLI read only that registry."""
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from flashlab.grader import exercises, grade
from flashlab.grader.core import Exercise

ROOT = Path(__file__).resolve().parents[1]
GRADER = ROOT / "flashlab" / "grader"


def test_each_exercise_is_declared_once_in_its_parts_module():
    from flashlab.grader.exercises import EXERCISES
    where = {name: ex.module.rsplit(".", 1)[-1] for name, ex in EXERCISES.items()}
    assert where == {"attention_naive": "part1", "online_softmax_update": "part1", "online_softmax": "part1",
                     "attention_tiled": "part1", "softmax_kernel": "part2", "matmul_kernel": "part2",
                     "flash_forward": "part2", "causal_loop_bounds": "part2", "flash_forward_tails": "part2",
                     "flash_forward_causal": "part2", "flash_backward": "part3",
                     "window_tile_bounds": "variants", "gqa_head_map": "variants", "varlen_program_map": "variants",
                     "dropout_backward": "variants",
                     "merge_partials": "beyond", "zigzag_indices": "beyond", "ring_step": "beyond"}
    assert {n for n, ex in EXERCISES.items() if ex.needs_triton} == {
        "softmax_kernel", "matmul_kernel", "flash_forward", "flash_forward_tails", "flash_forward_causal",
        "flash_backward"}
    assert all(ex.notebook and ex.contract for ex in EXERCISES.values())
    assert exercises() == {n: ex.contract for n, ex in EXERCISES.items()}
    # nothing else keeps a list of exercises: no names in grade(), batch or the CLI, no contracts apart
    for f in ("__init__.py", "batch.py", "cli.py", "core.py", "protocol.py", "ranking.py"):
        text = (GRADER / f).read_text()
        for name in ("softmax_kernel", "matmul_kernel", "flash_forward", "flash_backward", "causal_loop_bounds",
                     "attention_tiled"):
            assert f'"{name}"' not in text, (f, name)
    assert "_CONTRACTS" not in "".join(p.read_text() for p in GRADER.rglob("*.py"))


def test_a_new_module_adds_its_exercises_in_one_place(tmp_path):
    """A module dropped into flashlab/grader/exercises/ (as notebook 08's variants.py will be) is loaded and
    its exercise graded, with no other change; a name registered twice is refused."""
    pkg = tmp_path / "flashlab"
    import shutil
    shutil.copytree(ROOT / "flashlab", pkg, ignore=shutil.ignore_patterns("__pycache__", "data"))
    (pkg / "grader" / "exercises" / "variants.py").write_text(textwrap.dedent('''
        import numpy as np
        from ..core import Case, Exercise
        from . import register

        register(Exercise(
            "double_it", "f(x) -> y = 2 x. NumPy float64; x (N,).",
            lambda rng: [Case({"N": 5}, {"x": rng.standard_normal(5)}, visible=True)],
            lambda f, case: {"y": np.asarray(f(case.inputs["x"].copy()))},
            lambda case: {"y": 2 * case.inputs["x"]}, lambda case, name, ref: 1e-12,
            lambda case, name, idx: f"element {idx[0]}", notebook="08"))
        '''))
    code = textwrap.dedent('''
        from flashlab.grader import grade, exercises
        from flashlab.grader.exercises import EXERCISES, register
        assert "double_it" in EXERCISES and EXERCISES["double_it"].module.endswith("variants")
        assert grade("double_it", lambda x: 2 * x).passed and not grade("double_it", lambda x: x).passed
        try:
            register(EXERCISES["double_it"])
        except ValueError as e:
            assert "registered twice" in str(e)
        else:
            raise AssertionError("a second registration was accepted")
        print("ok")
        ''')
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": str(tmp_path)})
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stdout + r.stderr


def test_causal_loop_bounds_is_graded_without_triton(tmp_path):
    """Plain Python: graded on a machine without Triton; the kernel exercises say what is missing."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text('import sys\nsys.modules["triton"] = None\n')
    code = textwrap.dedent('''
        from flashlab.grader import grade
        def bounds(start_m, block_m, block_n, nq, nk):
            end = min((start_m + 1) * block_m, nk)
            return min(start_m * block_m // block_n * block_n, nk // block_n * block_n), end
        r = grade("causal_loop_bounds", bounds)
        assert r.passed, r
        assert not grade("causal_loop_bounds", lambda s, bm, bn, nq, nk: (s * bm, nk)).passed
        try:
            grade("flash_forward", lambda *a: None)
        except Exception as e:
            print("ok", type(e).__name__)
        ''')
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(ROOT)])}
    env.pop("TRITON_INTERPRET", None)
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0 and r.stdout.startswith("ok TritonMissing"), r.stdout + r.stderr


def test_registering_checks_the_declaration():
    from flashlab.grader.exercises import register
    ex = Exercise("not a name", "f(x) -> y", None, None, None, None, None)
    with pytest.raises(ValueError, match="identifier"):
        register(ex)
    with pytest.raises(TypeError):
        register("online_softmax")
    assert grade  # the public entry stays where it was
