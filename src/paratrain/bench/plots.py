"""The tutorials' figures, from results.json: time per strategy with error bars, the micro-batch
(`split_size`) trade-off curve, speedup against workers when several worker counts were run, for
token workloads tokens/s per strategy with each bar's model FLOPs utilisation, and the comparisons with their
intervals: each paratrain / hand-written ratio and each speedup beside its bound.

Error bars on step times span the interquartile range of the timed steps, around the median (what the table
quotes); error bars on ratios and speedups span their 95% intervals (`stats.py`).
"""

from __future__ import annotations

import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from .jobs import CEILING  # noqa: E402
from .report import name  # noqa: E402
from .schema import RunRecord, pipelined, quantile  # noqa: E402

PARATRAIN_COLOR, TORCH_COLOR, CEILING_COLOR = "tab:blue", "tab:orange", "tab:gray"


def _ok(runs: list[RunRecord]) -> list[RunRecord]:
    return [r for r in runs if r.status == "ok"]


def _iqr_bars(runs: list[RunRecord]) -> list[list[float]]:
    low = [r.median - quantile(r.step_times_s, 0.25) for r in runs]
    high = [quantile(r.step_times_s, 0.75) - r.median for r in runs]
    return [low, high]


def best_per_configuration(runs: list[RunRecord]) -> list[RunRecord]:
    """Each (strategy and options, workers) once; for pipelines the fastest micro-batch count."""
    best: dict[tuple[str, int], RunRecord] = {}
    for r in _ok(runs):
        key = (name(r), r.workers)
        if key not in best or r.median < best[key].median:
            best[key] = r
    return list(best.values())


def _colors(runs: list[RunRecord]) -> list[str]:
    return [TORCH_COLOR if r.strategy.startswith("torch-") else CEILING_COLOR if r.strategy == CEILING
            else PARATRAIN_COLOR for r in runs]


def _workers(n: int) -> str:
    return f"{n} worker{'s' if n > 1 else ''}"


def _label(r: RunRecord) -> str:
    text = f"{name(r)}\n{_workers(r.workers)}"
    return text + (f"\nM={r.microbatches}" if r.microbatches is not None else "")


def _title(results: dict[str, Any]) -> str:
    return f"{results['workload']['name']}, global batch {results['global_batch']}"


def _bars(runs: list[RunRecord], heights: list[float], notes: list[str | None], ylabel: str,
          **style: Any) -> tuple[Any, Any]:
    """One bar per run in the strategy colours, each with its note above it and its label below."""
    fig, ax = plt.subplots(figsize=(max(5.0, 1.1 * len(runs) + 1), 4.2))
    bars = ax.bar(range(len(runs)), heights, align="center", alpha=0.6, width=0.6, color=_colors(runs), **style)
    for bar, note in zip(bars, notes):
        if note is not None:
            ax.annotate(note, (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                        xytext=(0, 3), textcoords="offset points", ha="center", va="bottom", fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_xticks(range(len(runs)))
    ax.set_xticklabels([_label(r) for r in runs], fontsize=8)
    ax.yaxis.grid(True)
    return fig, ax


def _speedup_note(r: RunRecord) -> str | None:
    if r.speedup_vs_single is None:
        return None
    return f"{r.speedup:.2f}x" + (f"\n{r.speedup_ci[0]:.2f}-{r.speedup_ci[1]:.2f}" if r.speedup_ci else "")


def _ci_bars(values: list[float], intervals: Sequence[list[float] | None]) -> list[list[float]]:
    """matplotlib's yerr from [low, high] intervals (no bar where there is none)."""
    return [[v - ci[0] if ci else 0.0 for v, ci in zip(values, intervals)],
            [ci[1] - v if ci else 0.0 for v, ci in zip(values, intervals)]]


def bar_chart(results: dict[str, Any], path: Path) -> Path:
    runs = best_per_configuration(results["runs"])
    fig, ax = _bars(runs, [r.median for r in runs],
                    [_speedup_note(r) for r in runs],
                    "time per training step (s), median", yerr=_iqr_bars(runs), ecolor="red", capsize=8)
    ax.set_title(f"{_title(results)}\nblue: paratrain, orange: hand-written PyTorch, gray: no-communication "
                 "ceiling", fontsize=9)
    return _save(fig, path)


def throughput(results: dict[str, Any], path: Path) -> Path | None:
    """Tokens/s per strategy (the fastest micro-batch count of each pipeline), MFU on each bar."""
    runs = [r for r in best_per_configuration(results["runs"]) if r.tokens_per_s is not None]
    if not runs:
        return None
    fig, ax = _bars(runs, [r.tokens_per_s or 0.0 for r in runs],
                    [f"MFU {100 * r.mfu:.3g}%" if r.mfu is not None else None for r in runs],
                    "tokens per second (median step)")
    ax.set_ylim(0, 1.12 * max(r.tokens_per_s or 0.0 for r in runs))  # room for the labels
    peak = results.get("machine", {}).get("peak") or {}
    note = f"MFU against {peak['dtype']} peak: {peak['source']}" if peak.get("flops_per_s") else "MFU: peak unknown"
    ax.set_title(f"{_title(results)}\n" + "\n".join(textwrap.wrap(note, 90)), fontsize=8)
    return _save(fig, path)


def microbatch_curve(results: dict[str, Any], path: Path) -> Path | None:
    runs = [r for r in _ok(results["runs"]) if pipelined(r.strategy)]
    if not runs:
        return None
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    groups: dict[tuple[str, int], list[RunRecord]] = {}
    for r in runs:  # one line per schedule asked for (1F1B's GPipe fallback at M=1 stays on its line)
        line = name(r) + (f" {r.schedule}" if r.schedule not in (None, "gpipe", "1f1b") else "")
        groups.setdefault((line, r.workers), []).append(r)
    counts = sorted({r.micro for r in runs})
    for (line, workers), group in groups.items():
        group.sort(key=lambda r: r.micro)
        style = "--" if line.startswith("torch-") else "-"
        ax.errorbar([r.micro for r in group], [r.median for r in group],
                    yerr=_iqr_bars(group), fmt="o" + style, capsize=4, label=f"{line}, {_workers(workers)}")
    single = next((r for r in _ok(results["runs"]) if r.strategy == "single"), None)
    if single is not None:
        ax.axhline(single.median, color="gray", linestyle=":", label="single, 1 worker")
        pp = [r for r in runs if r.strategy == "pp"]
        if pp:
            k = pp[0].workers
            ax.plot(counts, [single.median * (m + k - 1) / (k * m) for m in counts], color="gray",
                    linestyle="-.", linewidth=1, label=f"{k}-stage 1F1B bound")
    batch = results["global_batch"]
    ax.set_xscale("log", base=2)
    ax.set_xticks(counts)
    ax.set_xticklabels([f"{m}\n({batch // m})" for m in counts])
    ax.set_xlabel("micro-batches M (split_size = batch / M)")
    ax.set_ylabel("time per training step (s), median")
    ax.yaxis.grid(True)
    ax.legend(fontsize=8)
    ax.set_title(f"micro-batch trade-off: {_title(results)}", fontsize=9)
    return _save(fig, path)


def scaling(results: dict[str, Any], path: Path) -> Path | None:
    runs = [r for r in best_per_configuration(results["runs"]) if r.speedup_vs_single is not None]
    counts = {r.workers for r in runs if r.strategy not in ("single", "mp", "torch-pipeline")}
    if len(counts) < 2:
        return None
    fig, ax = plt.subplots(figsize=(6.0, 4.2))
    top = max(counts)
    ax.plot([1, top], [1, top], color="gray", linestyle=":", label="ideal")
    for strategy in sorted({r.strategy for r in runs} - {"single", "mp", "torch-pipeline"}):
        group = sorted((r for r in runs if r.strategy == strategy), key=lambda r: r.workers)
        style = "--" if strategy.startswith("torch-") else ":" if strategy == CEILING else "-"
        color = CEILING_COLOR if strategy == CEILING else None
        ax.errorbar([1] + [r.workers for r in group], [1.0] + [r.speedup for r in group],
                    yerr=_ci_bars([1.0] + [r.speedup for r in group], [None, *(r.speedup_ci for r in group)]),
                    fmt="o" + style, capsize=4, label=strategy if strategy != CEILING else "no-comm (ceiling)",
                    color=color)
    ax.set_xlabel("workers")
    ax.set_ylabel("speedup over one worker (95% CI)")
    ax.set_xticks(sorted(counts | {1}))
    ax.grid(True)
    ax.legend(fontsize=8)
    ax.set_title(f"scaling: {_title(results)}", fontsize=9)
    return _save(fig, path)


def intervals(results: dict[str, Any], path: Path) -> Path | None:
    """Left: each paratrain / hand-written ratio with its 95% interval, against 1.0 (no difference). Right: each
    paratrain run's speedup with its interval, its bound as a tick beside it."""
    ratios = [r for r in _ok(results["runs"]) if r.vs_reference is not None]
    speedups = [r for r in _ok(results["runs"]) if r.speedup_vs_single is not None and r.strategy != "single"
                and not r.strategy.startswith("torch-")]
    if not ratios and not speedups:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(11.0, 0.45 * max(len(ratios), len(speedups), 4) + 1.6))
    left, right = axes
    for ax, runs, title in ((left, ratios, "paratrain / hand-written (median of paired steps)"),
                            (right, speedups, "speedup over one worker; | its bound")):
        ax.set_yticks(range(len(runs)))
        ax.set_yticklabels([_label(r).replace("\n", ", ") for r in runs], fontsize=7)
        ax.invert_yaxis()
        ax.xaxis.grid(True)
        ax.set_title(title, fontsize=9)
    if ratios:
        values = [r.vs_reference or 0.0 for r in ratios]
        left.errorbar(values, range(len(ratios)), xerr=_ci_bars(values, [r.ratio_ci for r in ratios]), fmt="o",
                      capsize=4, color=PARATRAIN_COLOR)
        left.axvline(1.0, color="gray", linestyle=":")
        left.set_xlabel("ratio of step times, 95% CI (right of 1: paratrain slower)")
    if speedups:
        values = [r.speedup for r in speedups]
        right.errorbar(values, range(len(speedups)), xerr=_ci_bars(values, [r.speedup_ci for r in speedups]),
                       fmt="o", capsize=4, color=PARATRAIN_COLOR)
        right.scatter([r.bound for r in speedups], range(len(speedups)), marker="|", s=200, color="black")
        right.set_xlabel("speedup, 95% CI")
    fig.suptitle(_title(results), fontsize=9)
    return _save(fig, path)


def _save(fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_all(results: dict[str, Any], out: Path) -> list[Path]:
    """Every plot that the results support; returns the files written."""
    if not _ok(results["runs"]):
        return []
    made = [bar_chart(results, out / "strategy_times.png"), microbatch_curve(results, out / "microbatch_tradeoff.png"),
            scaling(results, out / "scaling.png"), throughput(results, out / "throughput.png"),
            intervals(results, out / "intervals.png")]
    return [p for p in made if p is not None]
