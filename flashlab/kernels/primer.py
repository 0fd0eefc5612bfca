"""Notebook 04's kernels: a fused row softmax and a tiled matmul, the canonical versions.

Both follow the grader's contracts (``softmax_kernel``, ``matmul_kernel``): the
launcher writes into an output the caller allocated, and every tensor may have
any strides.  The notebook shows them only after the exercises.
"""
import triton
import triton.language as tl

from .. import device  # noqa: F401  (settles TRITON_INTERPRET before the kernels are defined)


@triton.jit
def softmax_kernel(X, Y, N, stride_xm, stride_xn, stride_ym, stride_yn, BLOCK_N: tl.constexpr):
    """One program per row: read the row once, write its softmax once (2 * N * e bytes per row)."""
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)                      # BLOCK_N >= N, a power of two
    mask = cols < N                                   # lanes past the row's end
    x = tl.load(X + row * stride_xm + cols * stride_xn, mask=mask, other=float("-inf"))  # -inf: e^-inf = 0
    x = x.to(tl.float32)
    e = tl.exp(x - tl.max(x, axis=0))                 # subtract the row max: no overflow
    y = e / tl.sum(e, axis=0)
    tl.store(Y + row * stride_ym + cols * stride_yn, y.to(Y.dtype.element_ty), mask=mask)


def softmax(x, y):
    """y = softmax(x, dim=-1) for x (M, N); one program per row (N up to a few tens of thousands)."""
    M, N = x.shape
    block = triton.next_power_of_2(N)
    softmax_kernel[(M,)](x, y, N, x.stride(0), x.stride(1), y.stride(0), y.stride(1), BLOCK_N=block,
                         num_warps=4 if block <= 2048 else 8 if block <= 8192 else 16)


@triton.jit
def matmul_kernel(A, B, C, M, N, K, stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  DOT_PRECISION: tl.constexpr):
    """One program per (BLOCK_M, BLOCK_N) tile of C; it walks K in steps of BLOCK_K."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)      # rows of C (and A) of this tile
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)      # columns of C (and B)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)   # the accumulator: float32 whatever the inputs
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk                                  # the last step may stick out past K: mask it
        a = tl.load(A + rm[:, None] * stride_am + kk[None, :] * stride_ak,
                    mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)      # (BLOCK_M, BLOCK_K)
        b = tl.load(B + kk[:, None] * stride_bk + rn[None, :] * stride_bn,
                    mask=(kk[:, None] < K) & (rn[None, :] < N), other=0.0)      # (BLOCK_K, BLOCK_N)
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)                 # acc += a @ b
    tl.store(C + rm[:, None] * stride_cm + rn[None, :] * stride_cn, acc.to(C.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


def matmul(a, b, c, block_m=None, block_n=None, block_k=None, allow_tf32=False):
    """c = a @ b for a (M, K), b (K, N); fp32 inputs in true fp32 unless ``allow_tf32``."""
    M, K = a.shape
    N = b.shape[1]
    big = not device.INTERPRET
    bm, bn, bk = block_m or (128 if big else 32), block_n or (128 if big else 32), block_k or (32 if big else 16)
    prec = "tf32" if allow_tf32 else "ieee"          # ignored for fp16/bf16 inputs
    grid = (triton.cdiv(M, bm), triton.cdiv(N, bn))
    matmul_kernel[grid](a, b, c, M, N, K, a.stride(0), a.stride(1), b.stride(0), b.stride(1),
                        c.stride(0), c.stride(1), BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, DOT_PRECISION=prec,
                        num_warps=8 if big else 4, num_stages=3 if big else 1)
