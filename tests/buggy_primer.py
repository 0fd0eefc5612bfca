"""Notebook 04's kernels with switchable mistakes, for grading tests (as buggy_kernels.py for the forward)."""
import flashlab  # noqa: F401,I001  (first: it decides GPU vs interpreter before triton is imported)
import triton
import triton.language as tl


@triton.jit
def _softmax(X, Y, N, sxm, sxn, sym, syn, BLOCK: tl.constexpr, OTHER_ZERO: tl.constexpr,
             NO_MAX: tl.constexpr, CONTIGUOUS: tl.constexpr, NO_UPCAST: tl.constexpr = False,
             STORE_PAST: tl.constexpr = False):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    if CONTIGUOUS:                    # strides ignored on the read: x assumed to be a contiguous (M, N)
        sxm = N
        sxn = 1
    if NO_UPCAST:                     # x kept in its dtype: only tl.exp (float32 only) sees float32
        x = tl.load(X + row * sxm + cols * sxn, mask=mask, other=float("-inf"))
        e = tl.exp((x - tl.max(x, axis=0)).to(tl.float32)).to(x.dtype)
        tl.store(Y + row * sym + cols * syn, (e / tl.sum(e, axis=0)).to(Y.dtype.element_ty), mask=mask)
        return
    if OTHER_ZERO:
        x = tl.load(X + row * sxm + cols * sxn, mask=mask, other=0.0).to(tl.float32)
    else:
        x = tl.load(X + row * sxm + cols * sxn, mask=mask, other=float("-inf")).to(tl.float32)
    if NO_MAX:
        e = tl.exp(x)
    else:
        e = tl.exp(x - tl.max(x, axis=0))
    if STORE_PAST:                    # one element past each row stored (a zero, into the padding)
        mask = cols < N + 1
    tl.store(Y + row * sym + cols * syn, (e / tl.sum(e, axis=0)).to(Y.dtype.element_ty), mask=mask)


def make_softmax(other_zero=False, no_max=False, contiguous=False, block_factor=1, y_strides_from_x=False,
                 no_upcast=False, store_past=False):
    def softmax(x, y):
        M, N = x.shape
        ys = x.stride() if y_strides_from_x else y.stride()
        _softmax[(M,)](x, y, N, x.stride(0), x.stride(1), ys[0], ys[1],
                       BLOCK=block_factor * triton.next_power_of_2(N + store_past), OTHER_ZERO=other_zero,
                       NO_MAX=no_max, CONTIGUOUS=contiguous, NO_UPCAST=no_upcast, STORE_PAST=store_past)
    return softmax


@triton.jit
def _matmul(A, B, C, M, N, K, sam, sak, sbk, sbn, scm, scn, BM: tl.constexpr, BN: tl.constexpr,
            BK: tl.constexpr, DROP_TAIL: tl.constexpr, CONTIGUOUS: tl.constexpr, ACC_FP16: tl.constexpr = False):
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    if CONTIGUOUS:
        sam = K
        sak = 1
        sbk = N
        sbn = 1
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    hi = K
    if DROP_TAIL:
        hi = K // BK * BK
    for k0 in range(0, hi, BK):
        kk = k0 + rk
        a = tl.load(A + rm[:, None] * sam + kk[None, :] * sak, mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)
        b = tl.load(B + kk[:, None] * sbk + rn[None, :] * sbn, mask=(kk[:, None] < K) & (rn[None, :] < N), other=0.0)
        if ACC_FP16:   # the accumulator kept in the inputs' dtype: rounded after every chunk
            acc = (acc + tl.dot(a, b, input_precision="ieee")).to(tl.float16).to(tl.float32)
        else:
            acc = tl.dot(a, b, acc, input_precision="ieee")
    tl.store(C + rm[:, None] * scm + rn[None, :] * scn, acc.to(C.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


def make_matmul(BM=16, BN=32, BK=16, drop_tail=False, contiguous=False, acc_fp16=False):
    def matmul(a, b, c):
        M, K = a.shape
        N = b.shape[1]
        _matmul[(triton.cdiv(M, BM), triton.cdiv(N, BN))](a, b, c, M, N, K, *a.stride(), *b.stride(), *c.stride(),
                                                          BM=BM, BN=BN, BK=BK, DROP_TAIL=drop_tail,
                                                          CONTIGUOUS=contiguous, ACC_FP16=acc_fp16)
    return matmul
