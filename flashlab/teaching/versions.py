"""Which kernel versions ``flashlab.flash_attention`` runs, said from the launch plan, never by hand.

The notebooks state which forward and backward version a call runs, and whether its gradient is
bitwise repeatable.  Those sentences come from here, and this module asks
:mod:`flashlab.kernels.plan` (the op's own choice), so a change to the plan changes the prose:

    >>> from flashlab.teaching import versions
    >>> print(versions.table("h200"))                 # every (D, causal, N) of the protocol on an H200
    >>> print(versions.sentence(64, False, 16384, "h200"))
    >>> print(versions.determinism(64, False, 16384, "h200"))

``facts``: a :class:`flashlab.kernels.plan.DeviceFacts`, a name of ``plan.SIMULATED`` ("t4", "l4",
"a100", "h200"), or None for this process's device (the interpreter on a CPU).  Plans for a simulated
GPU are made on any machine; nothing is launched.

The calls are the benchmark protocol's (16k tokens: B = 16384 / N, H = 2048 / D) unless ``B`` and ``H`` are
given: the batch and the heads matter only through the plan's small-problem rule (backward v4 from
``plan.ONE_PASS_MIN_ROWS`` K/V rows, B * H * N, on), which a one-head call of a few thousand keys falls under.
"""
from __future__ import annotations

import torch

from ..kernels import plan as P

# versions whose dQ is a sum of adds that arrive in any order (not bitwise repeatable on a GPU)
ATOMIC_DQ = ("v3", "v4")
NS = (512, 1024, 2048, 4096, 16384)


def _facts(facts):
    if facts is None:
        return P.device_facts()
    if isinstance(facts, str):
        try:
            return P.SIMULATED[facts.lower()]
        except KeyError:
            raise ValueError(f"facts must be one of {sorted(P.SIMULATED)} or a DeviceFacts, got {facts!r}") from None
    return facts


def protocol_shape(D: int, N: int) -> tuple:
    """(B, H) of the benchmark protocol's call at this head dim and length: 16k tokens, 2048 / D heads."""
    return max(1, 16384 // N), max(1, 2048 // D)


def plan_of(D: int, causal: bool, N: int, facts=None, dtype=torch.float16, deterministic: bool = False,
            B: int | None = None, H: int | None = None):
    """The op's plan for a call of this kind (B, H: the protocol's unless given)."""
    pb, ph = protocol_shape(D, N)
    return P.plan(pb if B is None else B, ph if H is None else H, N, N, D, dtype, causal,
                  deterministic=deterministic, facts=_facts(facts))


def versions(D: int, causal: bool, N: int, facts=None, dtype=torch.float16, deterministic: bool = False,
             B: int | None = None, H: int | None = None) -> tuple:
    """(forward version, backward version) the op runs."""
    p = plan_of(D, causal, N, facts, dtype, deterministic, B, H)
    return p.fwd_version, p.bwd_version


def repeatable(bwd_version: str, facts=None) -> bool:
    """Whether this backward gives the same dQ bits in every run on this device (the interpreter runs
    programs one after another, in one order, so there every version repeats)."""
    return _facts(facts).interpret or bwd_version not in ATOMIC_DQ


def _where(facts, dtype) -> str:
    f = _facts(facts)
    return f"{f.name.replace(' (simulated)', '')}, {str(dtype).replace('torch.', '')}"


def sentence(D: int, causal: bool, N: int, facts=None, dtype=torch.float16, B: int | None = None,
             H: int | None = None) -> str:
    """One sentence: what runs for this call, and why (the plan's reasons)."""
    p = plan_of(D, causal, N, facts, dtype, B=B, H=H)
    mode = "causal" if causal else "non-causal"
    return (f"{_where(facts, dtype)}, D = {D}, {mode}, N = {N}: forward {p.fwd_version} ({p.reasons['fwd']}); "
            f"backward {p.bwd_version} ({p.reasons['bwd']}).")


def determinism(D: int, causal: bool, N: int, facts=None, dtype=torch.float16, B: int | None = None,
                H: int | None = None) -> str:
    """Whether the default backward repeats bit for bit, and what ``torch.use_deterministic_algorithms(True)``
    changes, for this call."""
    f = _facts(facts)
    bwd = versions(D, causal, N, f, dtype, B=B, H=H)[1]
    det = versions(D, causal, N, f, dtype, deterministic=True, B=B, H=H)[1]
    head = f"{_where(f, dtype)}, D = {D}, {'causal' if causal else 'non-causal'}, N = {N}: the backward is {bwd}"
    if f.interpret:
        return head + " (the interpreter runs one program at a time, in one order: every version repeats here)."
    if repeatable(bwd, f):
        return head + ", which writes every dQ row from one program: bitwise repeatable, nothing to switch on."
    return (head + f", whose dQ is a sum of adds that arrive in any order: not bitwise repeatable. "
            f"With torch.use_deterministic_algorithms(True) the plan picks {det} instead, which is.")


def table(facts=None, dtype=torch.float16, Ds=(64, 128), Ns=NS) -> str:
    """The versions the op runs for each head dim, mask and length (and in deterministic mode)."""
    f = _facts(facts)
    star = False
    lines = [f"flashlab.flash_attention on {_where(f, dtype)} (from flashlab.kernels.plan; 16k tokens a call)",
             f"{'D':>4} {'causal':>7} " + " ".join(f"{'N=' + str(n):>9}" for n in Ns)
             + "   (forward/backward; deterministic backward)"]
    for D in Ds:
        for causal in (False, True):
            cells, dets = [], []
            for n in Ns:
                fv, bv = versions(D, causal, n, f, dtype)
                star |= not repeatable(bv, f)
                cells.append(f"{fv}/{bv}{'*' if not repeatable(bv, f) else ''}")
                dets.append(versions(D, causal, n, f, dtype, deterministic=True)[1])
            lines.append(f"{D:>4} {causal!s:>7} " + " ".join(f"{c:>9}" for c in cells)
                         + "   " + "/".join(sorted(set(dets))))
    if star:
        lines.append("* dQ not bitwise repeatable (adds in any order); "
                     "torch.use_deterministic_algorithms(True) gives the backward in the last column")
    return "\n".join(lines)


__all__ = ["protocol_shape", "plan_of", "versions", "repeatable", "sentence", "determinism", "table", "ATOMIC_DQ", "NS"]
