"""The plan as a person and a program read it: a ranked table, `plan.json`, and a scaling plot."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .cluster import GIB, Cluster
from .costs import Profile
from .predict import Prediction

SCHEMA = "paratrain-plan/1"


def _gib(n: float) -> str:
    return f"{n / GIB:.2f}" if n < 10 * GIB else f"{n / GIB:.1f}"


def _rate(p: Prediction, profile: Profile) -> str:
    value = p.tokens_per_s if profile.tokens_per_sample > 1 else p.samples_per_s
    return f"{value:,.0f}" if value >= 100 else f"{value:.2f}"


def table(predictions: Sequence[Prediction], profile: Profile, top: int) -> str:
    """Ranked layouts that fit (at most `top`), then the ones that do not, each with its reason."""
    unit = "tokens/s" if profile.tokens_per_sample > 1 else "samples/s"
    head = (f"  {'#':>2} {'layout':<44} {'dev':>4} {'step s':>9} {unit:>11} {'MFU':>5} {'GiB/worker':>10} "
            f"{'params':>6} {'grads':>6} {'optim.':>6} {'activ.':>6} {'build':>6} {'in fl.':>6} {'bubble':>6} "
            f"{'exp. comm s':>11}")
    lines = [head]
    fitting = [p for p in predictions if p.fits]
    for i, p in enumerate(fitting[:top], 1):
        m = p.memory
        lines.append(
            f"  {i:>2} {p.layout.label:<44} {p.layout.devices:>4} {p.step_s:>9.4f} {_rate(p, profile):>11} "
            f"{p.mfu:>5.1%} {_gib(m.total):>10} {_gib(m.params):>6} {_gib(m.grads):>6} {_gib(m.optimizer):>6} "
            f"{_gib(m.activations):>6} {_gib(m.build):>6} {m.in_flight:>6} {p.bubble:>6.1%} {p.exposed_comm_s:>11.4f}")
    if len(fitting) > top:
        lines.append(f"  ... {len(fitting) - top} more that fit (all in plan.json)")
    refused = [p for p in predictions if not p.fits]
    if refused:
        lines.append("  does not fit or cannot run:")
        lines += [f"     {p.layout.label:<44} {p.reason}" for p in refused]
    return "\n".join(lines)


def breakdown(p: Prediction) -> str:
    """Where the best layout's step goes."""
    parts = [("compute (busiest worker)", p.compute_s), ("exposed communication", p.exposed_comm_s),
             ("optimizer step", p.optimizer_s), ("per-call overhead", p.overhead_s)]
    text = ", ".join(f"{name} {seconds:.4f} s" for name, seconds in parts)
    if p.bubble:
        text += f"; pipeline bubble {p.bubble:.1%} of the step"
    if p.balance:
        text += f"; layers per stage {p.balance}"
    return text


def how_to_run(p: Prediction, cluster: Cluster) -> str:
    lines = [f"  run = {p.layout.setup_call(cluster)}"]
    lines += [f"  $ {c}" for c in p.layout.commands(cluster)]
    return "\n".join(lines)


def scaling_rows(scaling: dict[int, dict[str, Prediction]]) -> dict[str, dict[str, Any]]:
    return {str(n): {s: {"label": p.layout.label, "step_s": p.step_s, "samples_per_s": p.samples_per_s,
                         "tokens_per_s": p.tokens_per_s} for s, p in best.items()} for n, best in scaling.items()}


def document(predictions: Sequence[Prediction], profile: Profile, cluster: Cluster, batch: int, precision: str,
             optimizer: str, command: str, created: str,
             scaling: dict[int, dict[str, Prediction]] | None = None) -> dict[str, Any]:
    best = next((p for p in predictions if p.fits), None)
    return {
        "schema": SCHEMA, "created": created, "command": command,
        "model": {"name": profile.name, "source": profile.source, "params": profile.params,
                  "tokens_per_sample": profile.tokens_per_sample, "flops_per_sample": profile.flops_per_sample()},
        "cluster": cluster.as_spec(), "global_batch": batch, "precision": precision, "optimizer": optimizer,
        "best": None if best is None else {**best.as_dict(), "setup": best.layout.setup_kwargs(cluster),
                                           "commands": best.layout.commands(cluster)},
        "layouts": [p.as_dict() for p in predictions],
        "scaling": scaling_rows(scaling) if scaling else None,
        "profile": profile.as_dict(),
    }


def write_json(doc: dict[str, Any], path: Path) -> Path:
    path.write_text(json.dumps(doc, indent=1, default=str) + "\n")
    return path


def scaling_plot(scaling: dict[int, dict[str, Prediction]], profile: Profile, title: str, path: Path,
                 lines: int = 4) -> Path | None:
    """Predicted throughput against device count for the strategies that are best somewhere (None without
    matplotlib, which comes with `pip install 'paratrain[bench]'`)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    tokens = profile.tokens_per_sample > 1
    peak: dict[str, float] = {}
    for best in scaling.values():
        for strategy, p in best.items():
            peak[strategy] = max(peak.get(strategy, 0.0), p.tokens_per_s if tokens else p.samples_per_s)
    shown = sorted(peak, key=peak.__getitem__, reverse=True)[:lines]
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for strategy in shown:
        points = [(n, best[strategy]) for n, best in sorted(scaling.items()) if strategy in best]
        ax.plot([n for n, _ in points], [p.tokens_per_s if tokens else p.samples_per_s for _, p in points],
                marker="o", label=strategy)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("devices")
    ax.set_ylabel("predicted tokens/s" if tokens else "predicted samples/s")
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
