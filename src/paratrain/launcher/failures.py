"""Worker failures told once: ranks that failed with the same error share one copy of it.

Both launchers collect a report per failed rank (torchrun's error files for `paratrain run`, the
workers' own reports for `paratrain.launch`). A global batch that does not split over 3 workers
raises the same ParatrainError on every rank, and printing it once per rank buried the line that
names the fix under three copies of one traceback. Errors that differ by rank each keep theirs.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class Failure:
    rank: int
    error: str
    """The exception's last line ("ParatrainError: ..."), or how the process ended."""
    detail: str
    """The traceback, or the same as `error` when there is none."""
    time: float = 0.0


def grouped(failures: Iterable[Failure]) -> list[list[Failure]]:
    """Failures with the same error together, each group in order of failure, the first failure's group first."""
    groups: dict[str, list[Failure]] = {}
    for failure in sorted(failures, key=lambda f: (f.time, f.rank)):
        groups.setdefault(failure.error, []).append(failure)
    return list(groups.values())


def ranks_text(ranks: Iterable[int]) -> str:
    ranks = sorted(ranks)
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def describe(failures: Iterable[Failure], world: int | None = None) -> str:
    """Every distinct error once, with its ranks and its first traceback; the first failure first."""
    parts = []
    for i, group in enumerate(grouped(failures)):
        who, same, first = ranks_text(f.rank for f in group), len(group) > 1, group[0]
        if i == 0:
            of = f" of {world}" if world else ""
            parts.append(f"worker {who}{of} failed" + (" with the same error" if same else "") + ":")
        elif first.detail == first.error:  # no traceback: how the process ended, on one line
            parts.append(f"then {who}: {first.error}")
            continue
        else:
            parts.append(f"then {who} failed" + (" with the same error" if same else "") + ":")
        parts.append(first.detail.rstrip())
    return "\n".join(parts)
