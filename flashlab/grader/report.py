"""What a learner sees: a Result with one line per case, details and a hint for failures.

A Result renders as HTML in a notebook (a table of cases, an error heatmap for
the first failure) and as plain text anywhere else.
"""
from __future__ import annotations

import base64
import html
import io
from dataclasses import dataclass, field

import numpy as np

WRONG_ALGORITHM = "right answer, wrong algorithm"   # a case whose values are right but a requirement is missed

ICON = {"pass": "✅", "fail": "❌", "error": "💥", "crash": "💥", "timeout": "⏱️", "not implemented": "⬜",
        "not run": "⏭️"}
NOT_RUN = "not run"                  # a case grading stopped before (out of time): never a pass


@dataclass
class CaseResult:
    label: str                          # "visible case", "hidden case 3"
    params: str                         # e.g. "causal, Nq=37, Nk=37, D=16, fp16"
    status: str                         # a key of ICON
    message: str = ""                   # one line
    details: list = field(default_factory=list)   # more lines: where, how many, ...
    max_err: float = 0.0
    heatmap: np.ndarray | None = None   # |error| over (query block x key block)
    heat_labels: tuple = ("query block", "key block")

    @property
    def passed(self) -> bool:
        return self.status == "pass"


@dataclass
class Result:
    name: str
    cases: list = field(default_factory=list)
    hints: list = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return bool(self.cases) and all(c.passed for c in self.cases)

    @property
    def not_implemented(self) -> bool:
        return any(c.status == "not implemented" for c in self.cases)

    @property
    def incomplete(self):
        """(cases run, cases drawn) when grading stopped before the last case, else None."""
        skipped = sum(c.status == NOT_RUN for c in self.cases)
        return (len(self.cases) - skipped, len(self.cases)) if skipped else None

    def summary(self) -> str:
        if self.not_implemented:
            return f"{self.name}: not implemented yet — write your code where it says YOUR CODE HERE"
        n_ok = sum(c.passed for c in self.cases)
        verdict = "all cases pass" if self.passed else f"{n_ok}/{len(self.cases)} cases pass"
        if self.incomplete:
            verdict += f" (incomplete: {self.incomplete[0]} of {self.incomplete[1]} cases ran)"
        return f"{self.name}: {verdict}"

    def first_failure(self):
        return next((c for c in self.cases if not c.passed), None)

    def first_wrong_answer(self):
        """The first case with wrong values, when the first failure was only a missed requirement."""
        first = self.first_failure()
        if first is None or first.message != WRONG_ALGORITHM:
            return None
        return next((c for c in self.cases if c.status != "pass" and c.message != WRONG_ALGORITHM), None)

    def _failures(self):
        return [c for c in (self.first_failure(), self.first_wrong_answer()) if c is not None]

    def trace_hint(self) -> str:
        """For a kernel exercise that failed on a case it ran: how to see what the kernel read and wrote
        (flashlab.viz.trace), else ''."""
        fail = self.first_failure()
        if fail is None or fail.status not in ("fail", "error", "crash"):
            return ""
        from .exercises import EXERCISES
        ex = EXERCISES.get(self.name)
        if ex is None or not ex.needs_triton:
            return ""
        from ..viz.trace import trace_hint
        return trace_hint(self.name)

    # ---- plain text -------------------------------------------------------
    def __str__(self) -> str:
        if self.not_implemented:
            return "TODO    " + self.summary()
        lines = [("PASSED  " if self.passed else "FAILED  ") + self.summary()]
        for c in self.cases:
            lines.append(f"  {ICON[c.status]} {c.label:<14} {c.params:<42} {c.message}")
        for n, fail in enumerate(self._failures()):
            lines.append("")
            lines.append(f"{'First failure' if n == 0 else 'First wrong answer'}, {fail.label} ({fail.params}):")
            lines += ["  " + d for d in fail.details]
            if fail.heatmap is not None:
                lines.append("  |error| by tile (rows: %s, columns: %s):" % fail.heat_labels)
                lines += ["    " + " ".join(_cell(x) for x in row) for row in fail.heatmap]
        for h in self.hints:
            lines.append("Hint: " + h)
        trace = self.trace_hint()
        if trace:
            lines += [""] + trace.splitlines()
        return "\n".join(lines)

    __repr__ = __str__

    # ---- notebook ----------------------------------------------------------
    def _repr_html_(self) -> str:
        color = "#1a7f37" if self.passed else ("#6e7781" if self.not_implemented else "#cf222e")
        out = [f"<div style='font-family:sans-serif'><b style='color:{color}'>{html.escape(self.summary())}</b>"]
        if self.not_implemented:
            return out[0] + "</div>"
        out.append("<table style='border-collapse:collapse;margin-top:4px'>")
        for c in self.cases:
            out.append(f"<tr><td>{ICON[c.status]}</td><td style='padding:0 8px'>{html.escape(c.label)}</td>"
                       f"<td style='padding:0 8px;color:#57606a'>{html.escape(c.params)}</td>"
                       f"<td>{html.escape(c.message)}</td></tr>")
        out.append("</table>")
        for n, fail in enumerate(self._failures()):
            out.append(f"<p><b>{'First failure' if n == 0 else 'First wrong answer'}</b>, "
                       f"{html.escape(fail.label)} ({html.escape(fail.params)}):</p>")
            if fail.details:
                out.append("<pre style='margin:0'>" + html.escape("\n".join(fail.details)) + "</pre>")
            if fail.heatmap is not None:
                out.append(_heatmap_img(fail.heatmap, fail.heat_labels))
        for h in self.hints:
            out.append(f"<p>💡 {html.escape(h)}</p>")
        trace = self.trace_hint()
        if trace:
            out.append("<pre style='margin:4px 0 0 0;color:#57606a'>" + html.escape(trace) + "</pre>")
        out.append("</div>")
        return "\n".join(out)


def _cell(x: float) -> str:
    if not np.isfinite(x):
        return "  nan  "
    return f"{x:7.1e}" if x > 0 else "   .   "


def _heatmap_img(heat: np.ndarray, labels) -> str:
    from matplotlib.figure import Figure  # no pyplot: works headless and leaves the notebook's state alone
    fig = Figure(figsize=(3.8, 2.9), dpi=90)
    ax = fig.add_subplot()
    shown = np.where(np.isfinite(heat), heat, np.nanmax(np.where(np.isfinite(heat), heat, 0)) * 2 + 1)
    im = ax.imshow(shown, cmap="Reds", aspect="auto", vmin=0)
    ax.set_ylabel(labels[0])
    ax.set_xlabel(labels[1])
    ax.set_title("|error| per tile", fontsize=9)
    fig.colorbar(im, ax=ax)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return f"<img src='data:image/png;base64,{base64.b64encode(buf.getvalue()).decode()}'/>"
