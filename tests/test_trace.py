"""flashlab.viz.trace: the recorded loads and stores are the ones the kernel makes.

Kernels whose accesses are known by construction (one row per program, a tile per program, a
causal forward that skips the tiles above the diagonal, kernels that run off their tensors), each
checked element by element, with the kernel's results checked against PyTorch too.
"""
import math
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from flashlab import device

pytestmark = pytest.mark.skipif(not device.TRITON, reason="needs Triton")

if device.TRITON:
    import triton
    import triton.language as tl

    from flashlab import viz
    from flashlab.kernels import primer
    from flashlab.kernels.common import LOG2E
    from flashlab.kernels.forward import flash_fwd_kernel

    @triton.jit
    def copy_unmasked(X, Y, BLOCK: tl.constexpr):
        """No mask: the last program runs past the end of X and Y."""
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(Y + offs, tl.load(X + offs))

    @triton.jit
    def wild_store(Y, FAR: tl.constexpr):
        """Stores one element FAR elements past Y's start."""
        tl.store(Y + FAR + tl.arange(0, 4), tl.zeros([4], dtype=tl.float32))

    @triton.jit
    def rows_without_column_mask(X, Y, N, stride, BLOCK: tl.constexpr):
        """Masks nothing: lanes past a row's end read the next row (inside the allocation) or past it."""
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        tl.store(Y + row * stride + cols, tl.load(X + row * stride + cols), mask=cols < N)

ROOT = Path(__file__).resolve().parents[1]


def _row(r, cols):
    return {(r, j) for j in cols}


def test_softmax_reads_one_row_per_program(rng):
    M, N = int(rng.integers(3, 7)), int(rng.integers(20, 60))
    block = triton.next_power_of_2(N)
    x = torch.randn(M, N) * 10
    y = torch.empty_like(x)
    t = viz.trace(primer.softmax_kernel, (M,), x, y, N, *x.stride(), *y.stride(), BLOCK_N=block)
    torch.testing.assert_close(y, torch.softmax(x, 1), atol=1e-6, rtol=1e-5)      # it ran the kernel
    assert t.programs == [(r,) for r in range(M)]
    for r in range(M):
        assert t.reads((r,), "X") == _row(r, range(N))
        assert t.writes(r, "Y") == _row(r, range(N))                          # int program ids work too
        assert t.writes(r, "X") == set() and t.reads(r, "Y") == set()
        assert t.masked(r, "X") == _row(r, range(N, block)) == t.masked(r, "Y")  # past the row's end
        assert t.bytes(r, "X") == N * 4 and t.accesses(r) == 2
    assert t.out_of_bounds == []


def test_strided_views_map_to_their_own_indices(rng):
    """A transposed input: the index tuples are of the view, through its strides."""
    M, N = 5, 24
    base = torch.randn(N, M)
    x = base.t()                                       # (M, N), strides (1, M)
    y = torch.empty(M, N)
    t = viz.trace(primer.softmax_kernel, (M,), x, y, N, *x.stride(), *y.stride(), BLOCK_N=32)
    torch.testing.assert_close(y, torch.softmax(x, 1), atol=1e-6, rtol=1e-5)
    assert t.reads(3, "X") == _row(3, range(N))
    assert t.masked(3, "X") == _row(3, range(N, 32))


def test_matmul_records_its_tiles(rng):
    M, N, K = 40, 36, 24
    bm, bn, bk = 16, 16, 16
    a, b = torch.randn(M, K), torch.randn(K, N)
    c = torch.empty(M, N)
    grid = (math.ceil(M / bm), math.ceil(N / bn))
    t = viz.trace(primer.matmul_kernel, grid, a, b, c, M, N, K, *a.stride(), *b.stride(), *c.stride(),
                  BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, DOT_PRECISION="ieee", num_warps=4)
    torch.testing.assert_close(c, a @ b, atol=1e-4, rtol=1e-4)
    assert len(t.programs) == grid[0] * grid[1]
    for (i, j) in t.programs:
        rows, cols = range(i * bm, min((i + 1) * bm, M)), range(j * bn, min((j + 1) * bn, N))
        assert t.reads((i, j), "A") == {(r, k) for r in rows for k in range(K)}
        assert t.reads((i, j), "B") == {(k, n) for k in range(K) for n in cols}
        assert t.writes((i, j), "C") == {(r, n) for r in rows for n in cols}
        assert t.loads_per_tile((i, j), "A") == [1, 1]           # two steps along K (16 + a tail of 8)
        assert t.loads_per_tile((i, j), "B") == [1, 1]
        # the K tail: columns 24..31 of A and rows 24..31 of B are masked lanes, as are C's ragged edges
        assert {(r, k) for r in range(i * bm, (i + 1) * bm) for k in range(K, 32)} <= t.masked((i, j), "A")
        assert all(not (0 <= r < M and 0 <= n < N) for r, n in t.masked((i, j), "C"))
    assert t.out_of_bounds == []
    text = str(t.table())
    assert "A tiles loaded" in text and "(2, 2)" in text


def test_out_of_bounds_is_recorded_and_memory_is_safe():
    n, block = 20, 8
    big = torch.full((n + 16,), -7.0)
    x = torch.arange(float(n))
    y = big[:n]                                        # past y's end: the rest of big, on a GPU
    with pytest.warns(RuntimeWarning, match="out of bounds"):
        t = viz.trace(copy_unmasked, (3,), x, y, BLOCK=block)
    torch.testing.assert_close(y, x)                   # the in-bounds part ran
    assert torch.all(big[n:] == -7.0)                  # the stores past the end were not made
    bad = {(o.program, o.arg, o.index, o.op) for o in t.out_of_bounds}
    want = {((2,), "X", (i,), "load") for i in range(n, 24)} | {((2,), "Y", (i,), "store") for i in range(n, 24)}
    assert bad == want
    assert not any(o.ran for o in t.out_of_bounds)             # outside the allocation: skipped
    assert t.reads(2, "X") == {(i,) for i in range(16, n)}
    p, arg, index = t.out_of_bounds[0]                # unpacks as (program, arg, index)
    assert (p, arg, index) == ((2,), "X", (20,))


def test_a_wild_store_is_skipped_and_the_process_survives():
    y = torch.zeros(8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t = viz.trace(wild_store, (1,), y, FAR=1 << 22)
    assert [o.index for o in t.out_of_bounds] == [((1 << 22) + i,) for i in range(4)]
    assert torch.all(y == 0)


def test_past_the_row_end_inside_the_allocation():
    """A missing column mask on a contiguous matrix: lanes meant for (r, N..) read row r + 1 (as on a GPU);
    the last row's run past the end of the tensor is skipped."""
    M, N, block = 3, 6, 8
    x = torch.arange(float(M * N)).reshape(M, N)
    y = torch.zeros(M, N)
    with pytest.warns(RuntimeWarning):
        t = viz.trace(rows_without_column_mask, (M,), x, y, N, N, BLOCK=block)
    torch.testing.assert_close(y, x)
    oob = {(o.program, o.index): (o.ran, o.lands_at) for o in t.out_of_bounds}
    assert oob[((0,), (0, 6))] == (True, (1, 0)) and oob[((1,), (1, 7))] == (True, (2, 1))   # made: the next row
    assert oob[((2,), (2, 6))] == (False, None)                               # past the tensor: skipped
    assert set(oob) == {((r,), (r, j)) for r in range(M) for j in range(N, block)}
    assert t.reads(0, "X") == _row(0, range(N)) | _row(1, range(2))           # what memory was really read
    assert t.masked(0, "Y") == _row(0, range(N, block))


def test_a_view_with_gaps():
    """x = big[:, :N]: lanes past a row's end land in the gap between rows (big's memory, not x's):
    the access is made, as on a GPU, and reported; the gap's bytes come back unchanged."""
    M, N, W = 3, 6, 10
    big = torch.arange(float(M * W)).reshape(M, W)
    x, y = big[:, :N], torch.zeros(M, W)[:, :N]         # the kernel takes one row stride for both
    with pytest.warns(RuntimeWarning):
        t = viz.trace(rows_without_column_mask, (M,), x, y, N, W, BLOCK=8)
    torch.testing.assert_close(y, x)
    assert torch.equal(big, torch.arange(float(M * W)).reshape(M, W))
    oob = {(o.program, o.index): (o.ran, o.lands_at) for o in t.out_of_bounds if o.arg == "X"}
    assert oob[((0,), (0, 6))] == (True, None) and oob[((2,), (2, 6))] == (False, None)
    assert t.reads(0, "X") == _row(0, range(N))


def _forward(B, H, N, D, causal, block):
    q, k, v = (torch.randn(B, H, N, D) for _ in range(3))
    o, lse = torch.empty_like(q), torch.empty(B, H, N)
    tiles = math.ceil(N / block)
    t = viz.trace(flash_fwd_kernel, (tiles * B * H,), q, k, v, o, lse, *q.stride(), *k.stride(), *v.stride(),
                  *o.stride(), *lse.stride(), H, N, N, D ** -0.5 * LOG2E,
                  CAUSAL=causal, BLOCK_M=block, BLOCK_N=block, HEAD_DIM=D, DOT_PRECISION="ieee")
    ref = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=causal)
    torch.testing.assert_close(o.double(), ref, atol=1e-5, rtol=1e-5)
    return t, tiles


@pytest.mark.parametrize("causal", [True, False])
def test_forward_v1_skips_the_tiles_above_the_diagonal(causal):
    B, H, N, D, block = 1, 2, 56, 16, 16               # ragged: the last tile has 8 rows
    t, tiles = _forward(B, H, N, D, causal, block)
    for p in t.programs:
        i, bh = p[0] % tiles, p[0] // tiles             # program_tile: tile index fastest
        want = [1] * (i + 1) + [0] * (tiles - i - 1) if causal else [1] * tiles
        assert t.loads_per_tile(p, "K") == want and t.loads_per_tile(p, "V") == want
        b, h = divmod(bh, H)
        rows = range(i * block, min((i + 1) * block, N))
        assert t.reads(p, "Q") == {(b, h, r, d) for r in rows for d in range(D)}
        assert t.writes(p, "O") == {(b, h, r, d) for r in rows for d in range(D)}
        assert t.writes(p, "LSE") == {(b, h, r) for r in rows}
        seen = range(0, min((i + 1) * block, N)) if causal else range(N)
        assert t.reads(p, "K") == {(b, h, r, d) for r in seen for d in range(D)}
    assert t.out_of_bounds == []
    assert "· ·" in str(t.table()) if causal else "·" not in str(t.table())


def test_figures_and_table_headless():
    t, _ = _forward(1, 1, 40, 16, True, 16)
    from matplotlib.figure import Figure
    for fig in (t.figure(1), t.figure(), t.figure([0, 2], args=["K", "LSE"])):
        assert isinstance(fig, Figure)
        assert len(viz._png(fig)) > 5000
    html = t.table()._repr_html_()
    assert html.startswith("<table>") and "K tiles loaded" in html
    with pytest.raises(ValueError, match="program"):
        t.reads((9,), "K")
    with pytest.raises(ValueError, match="arg must name"):
        t.reads(0, "k")
    with pytest.raises(TypeError, match="do not fit"):
        viz.trace(flash_fwd_kernel, (1,), 1, 2)
    pytest.importorskip("ipywidgets")
    w = viz.interact_trace(t)
    assert type(w).__name__ == "VBox"


def test_trace_call_traces_a_launcher_and_the_hint_runs():
    """An exercise's f(x, y) launches a kernel: trace_call traces it; the grader's hint is runnable code."""
    hint = viz.trace_hint("softmax_kernel", (3,))
    assert "t.figure((3,))" in hint and "trace_call(YOUR_FUNCTION" in hint
    code = "\n".join(line[4:] for line in hint.splitlines()[1:]).replace("display(", "(")
    ns = {"YOUR_FUNCTION": primer.softmax, "torch": torch}
    exec(code, ns)
    t = ns["t"]
    assert t.reads(3, "X") == _row(3, range(37)) and t.name == "softmax_kernel"
    assert "flash_forward" in viz.trace_hint("flash_forward", 2)
    with pytest.raises(ValueError, match="launched no Triton kernel"):
        viz.trace_call(lambda: None)


def test_compiled_mode_without_a_gpu_traces_and_restores_triton():
    """On a GPU machine kernels are compiled-mode JITFunctions; trace runs them through the interpreter
    and leaves Triton as it found it (here: TRITON_INTERPRET=0 on a CPU, where launching would fail)."""
    code = textwrap.dedent("""
        import flashlab, torch, triton, triton.language as tl
        from triton.runtime.jit import JITFunction
        from flashlab import viz, device
        from flashlab.kernels import primer
        assert not device.INTERPRET and isinstance(primer.softmax_kernel, JITFunction)
        call, load = JITFunction.__call__, tl.load
        x = torch.randn(4, 20); y = torch.empty_like(x)
        t = viz.trace(primer.softmax_kernel, (4,), x, y, 20, *x.stride(), *y.stride(), BLOCK_N=32)
        torch.testing.assert_close(y, torch.softmax(x, 1))
        assert t.reads(1, "X") == {(1, j) for j in range(20)}
        assert JITFunction.__call__ is call and tl.load is load and not triton.knobs.runtime.interpret
        import os; assert os.environ["TRITON_INTERPRET"] == "0"
        print("ok")
    """)
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]
