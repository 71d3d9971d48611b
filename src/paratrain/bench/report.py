"""The table `paratrain bench` prints (row by row as jobs finish, then whole) and writes as Markdown."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..measure import stats
from .jobs import CEILING, REFERENCE
from .schema import RunRecord

Column = tuple[str, int, Callable[[RunRecord], str]]

COLUMNS: list[Column] = [
    ("strategy", 16, lambda r: name(r)),
    ("workers", 7, lambda r: str(r.workers)),
    ("micro", 5, lambda r: _opt(r.microbatches)),
    ("sched", 5, lambda r: _opt(r.schedule)),
    ("median s", 9, lambda r: _num(r.median_step_s, ".4f")),
    ("IQR s", 7, lambda r: _num(r.spread_s, ".4f")),
    ("samples/s", 9, lambda r: _num(r.samples_per_s, ".1f")),
    ("speedup (95% CI)", 16, lambda r: _with_ci(r.interval("speedup"), ".2f", "x")),
    ("effic.", 6, lambda r: _num(None if r.scaling_efficiency is None else 100 * r.scaling_efficiency,
                                 ".0f", "%")),
    ("bound", 6, lambda r: _num(r.bound, ".2f", "x") if r.status == "ok" else "-"),
    ("vs torch (95% CI)", 17, lambda r: _with_ci(r.interval("ratio"), ".3f")),
    ("peak MB", 8, lambda r: _num(r.peak_memory_mb, ".0f")),
    ("status", 14, lambda r: r.status),
]
LOSS: Column = ("final loss", 10, lambda r: _num(r.final_loss, ".5f"))
"""Shown when runs differ in options: a lossy option's effect on the loss beside the exact run's."""
"""The columns of every table; `columns` adds tokens/s and MFU after samples/s where a run has them."""
TOKENS: Column = ("tokens/s", 9, lambda r: _num(r.tokens_per_s, ".0f"))
MFU: Column = ("MFU", 6, lambda r: _percent(r.mfu))


_NOT_PARATRAIN = (*REFERENCE.values(), CEILING)
_SHORT = {"comm_hook": "", "stages_per_worker": "V="}
"""How the strategy column names an option: `ddp auto` (comm_hook), `pp V=2` (stages per worker)."""


def name(r: RunRecord) -> str:
    """The run's strategy with the options it was given: `ddp auto`, `pp V=2`."""
    return r.strategy + "".join(f" {_SHORT.get(k, k + '=')}{v}" for k, v in r.options.items())


def _opt(value: Any) -> str:
    return "-" if value is None else str(value)


def _num(value: float | None, fmt: str, unit: str = "") -> str:
    return "-" if value is None else f"{value:{fmt}}{unit}"


def _with_ci(ratio: stats.Ratio | None, fmt: str, unit: str = "") -> str:
    """`1.64x 1.55-1.73`: the value and its interval, or the value alone where there is none."""
    if ratio is None:
        return "-"
    if ratio.low is None or ratio.high is None:
        return f"{ratio.value:{fmt}}{unit}"
    return f"{ratio.value:{fmt}}{unit} {ratio.low:{fmt}}-{ratio.high:{fmt}}"


def _times(ratio: stats.Ratio) -> str:
    """`1.64x (95% CI 1.55-1.73)`."""
    if ratio.low is None or ratio.high is None:
        return f"{ratio.value:.2f}x"
    return f"{ratio.value:.2f}x ({stats.LEVEL:.0%} CI {ratio.low:.2f}-{ratio.high:.2f})"


def columns(tokens: bool = False, mfu: bool = False, loss: bool = False) -> list[Column]:
    at = [name for name, _, _ in COLUMNS].index("samples/s") + 1
    return [*COLUMNS[:at], *([TOKENS] if tokens else []), *([MFU] if mfu else []), *COLUMNS[at:-1],
            *([LOSS] if loss else []), COLUMNS[-1]]


def columns_for(runs: list[RunRecord]) -> list[Column]:
    return columns(tokens=any(r.tokens_per_s is not None for r in runs), mfu=any(r.mfu is not None for r in runs),
                   loss=any(r.options for r in runs))


def _percent(fraction: float | None) -> str:
    """MFU as a percentage: one decimal, or two significant digits below 1% (a toy model's is tiny, not 0)."""
    if fraction is None:
        return "-"
    return f"{100 * fraction:.1f}%" if fraction >= 0.01 else f"{100 * fraction:.2g}%"


def header(cols: list[Column] = COLUMNS) -> str:
    return "  ".join(f"{name:>{width}}" if i else f"{name:<{width}}"
                     for i, (name, width, _) in enumerate(cols))


def row(run: RunRecord, cols: list[Column] = COLUMNS) -> str:
    cells = [f"{get(run):>{width}}" if i else f"{get(run):<{width}}" for i, (_, width, get) in enumerate(cols)]
    line = "  ".join(cells).rstrip()
    return line + (f"\n    reason: {run.reason}" if run.reason else "")


def table(runs: list[RunRecord]) -> str:
    cols = columns_for(runs)
    return "\n".join([header(cols), "-" * len(header(cols)), *(row(r, cols) for r in runs)])


def _label(r: RunRecord) -> str:
    m = f", {r.microbatches} micro-batches" if r.microbatches is not None else ""
    return f"{name(r)} on {r.workers} worker(s){m}"


def comparisons(runs: list[RunRecord]) -> list[str]:
    """One line per paratrain run that has a hand-written twin: the median of their paired step ratios, its 95%
    interval, and a verdict only where the interval excludes 1.0."""
    out = []
    for r in runs:
        ratio = r.interval("ratio")
        if ratio is not None:
            out.append(f"{_label(r)} / {r.reference}: {stats.verdict(ratio)}")
    return out


def speedup_text(r: RunRecord) -> str:
    """`1.64x single (95% CI 1.55-1.73), 82% of its bound 2.00x`, or at its bound within noise."""
    speedup = r.interval("speedup")
    if speedup is None:
        return "no speedup (single did not run)"
    ci = "" if speedup.low is None or speedup.high is None else \
        f" ({stats.LEVEL:.0%} CI {speedup.low:.2f}-{speedup.high:.2f})"
    return f"{speedup.value:.2f}x single{ci}, {stats.against_bound(speedup, r.bound)}"


def summary(runs: list[RunRecord]) -> list[str]:
    """The fastest configuration of each paratrain strategy and worker count, against its bound, the
    no-communication ceiling and its hand-written twin, each with its interval."""
    best: dict[tuple[str, int, str | None, tuple[tuple[str, Any], ...]], RunRecord] = {}
    for r in runs:
        if r.status == "ok" and r.speedup_vs_single is not None and r.strategy not in _NOT_PARATRAIN:
            key = (r.strategy, r.workers, r.schedule, tuple(r.options.items()))
            if key not in best or r.median < best[key].median:
                best[key] = r
    ceilings = {r.workers: r for r in runs if r.strategy == CEILING and r.speedup_vs_single is not None}
    out = []
    for (strategy, workers, _, _), r in best.items():
        if strategy == "single":
            continue
        m = f", M={r.microbatches}" if r.microbatches is not None else ""
        m += f", {r.schedule}" if r.schedule is not None else ""
        line = f"{strategy} on {workers} worker(s){m}: {speedup_text(r)}"
        if workers in ceilings:
            ceiling = ceilings[workers].interval("speedup")
            assert ceiling is not None
            line += f"; no-communication ceiling here {_times(ceiling)}"
        ratio = r.interval("ratio")
        if ratio is not None:
            line += f"; vs {r.reference}: {stats.verdict(ratio)}"
        if r.options:
            line += f"; with {', '.join(f'{k}={v}' for k, v in r.options.items())}"
        if r.tokens_per_s is not None:
            line += f"; {r.tokens_per_s:.0f} tokens/s"
        if r.mfu is not None:
            line += f", MFU {_percent(r.mfu)}"
        out.append(line)
    return out


def markdown(runs: list[RunRecord]) -> str:
    cols = columns_for(runs)
    names = [name for name, _, _ in cols]
    lines = ["| " + " | ".join(names) + " |", "|" + "|".join("---" for _ in names) + "|"]
    for r in runs:
        cells = [get(r) for _, _, get in cols]
        if r.reason:
            cells[-1] += f": {r.reason}".replace("|", "/")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
