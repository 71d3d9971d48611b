"""The architecture sweep's verdicts: each cell (architecture x layout) trains like the plain loop (`match`), is
refused by a ParatrainError (`refused`, with its reason), or fails (`FAIL`: a raw error, a hang, a crash, a
mismatch, or work not divided as the layout says). A model drawing randomness the reference cannot restate yet
(zoo.dropout_rule.COVERS) that trains but differs is `differs`: expected until the rule covers that kind, never
counted as a match.

    verdicts = sweep({"qwen2": zoo.ARCHS["qwen2"]}, ["tp", "pp"])   # -> [Verdict, ...]

Cells run as few launches as there are worker counts (every 2-worker cell in one launch), each cell under the
workers' time limit (archs_cells.run_cells); a launch that ends early (a hang, a crash, a raw error) is started
again after the cell it ended in, so the rest of the sweep still runs.
"""

from __future__ import annotations

import re
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from archs_cells import (
    BY_NAME,
    ENDS_WORKER,
    LIMIT_S,
    SIZES,
    ArchCell,
    ArchLayout,
    case_for,
    record_path,
    run_cells,
)
from matrix_cells import spread
from zoo import randomness
from zoo.case import ZooCase
from zoo.compare import mismatches
from zoo.dropout_rule import COVERS, covers, layout_rule
from zoo.reference import Record, global_batches, run_reference, torch_rng

import paratrain

MATCH, REFUSED, DIFFERS, FAIL = "match", "refused", "differs", "FAIL"
STATUSES = (MATCH, REFUSED, DIFFERS, FAIL)


@dataclass(frozen=True)
class Verdict:
    arch: str
    layout: str
    status: str
    """One of STATUSES."""
    short: str
    """What the table shows: `match`, `refused: <reason>`, `differs: ...` or `FAIL: <what>`."""
    detail: str = ""
    """The whole refusal, error or first mismatches."""
    seconds: float = 0.0
    strategy: str = ""
    """The strategy that ran (what `auto` chose)."""

    @property
    def label(self) -> str:
        return ArchCell(self.arch, self.layout).label

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


REASONS = (
    (r"forward fails on .*?`([^`]{1,120})`", r"its forward fails on a shard at `\1`"),
    (r"draws (\w+) while training", r"draws \1, which a stage would draw from its own generator"),
    (r"in training mode computes other values sharded", "a draw it cannot place on a slice"),
    (r"fused projection", "fused projection"),
    (r"view\(b, t, -1, head_dim\)|full head count|hard-codes", "reshape by the full head count"),
    (r"the style '([^']+)'[^.]*does not map", r"tp plan style '\1' not mapped"),
    (r"key/value heads.*cannot split", "key/value heads the degree does not divide"),
    (r"did not take part in the previous backward|find_unused_parameters", "parameters the forward leaves unused"),
    (r"batchnorm='local'|BatchNorm", "BatchNorm over a split batch"),
    (r"dropout.*(function|F\.dropout)|F\.dropout|dropout_p", "dropout called as a function"),
    (r"bernoulli", "bernoulli_ (stochastic depth)"),
    (r"not an nn\.Linear|Conv1D", "layer not an nn.Linear"),
    (r"no recognisable blocks|found no|no tensor-parallel plan|nothing to shard", "no tensor-parallel plan"),
    (r"does not divide|not divisible|cannot be split", "a size the degree does not divide"),
    (r"Cache'> in output", "a cache object in the output (use_cache)"),
    (r"torch\.export|cannot trace|could not trace|data-dependent", "torch.export cannot trace it"),
    (r"fewer than two layers|layers to cut", "fewer than two layers to cut"),
)
"""Short reasons for the table, by what a refusal's message says (the first pattern found; \\1 is its group);
the JSON keeps the whole message."""


def short_reason(message: str) -> str:
    for pattern, reason in REASONS:
        found = re.search(pattern, message, re.IGNORECASE | re.DOTALL)
        if found:
            return found.expand(reason)
    first = re.split(r"(?<=[.;:])\s", message.strip(), maxsplit=1)[0]
    return first[:70].rstrip(" .;:") + ("..." if len(first) > 70 else "")


_DRAWN: dict[str, frozenset[str]] = {}


def drawn(case: ZooCase) -> frozenset[str]:
    """The kinds of randomness the case's model draws in training (zoo.randomness)."""
    if case.name not in _DRAWN:
        _DRAWN[case.name] = randomness.kinds(case.build(0), case.batch(0, SIZES[0])[0])
    return _DRAWN[case.name]


_REFERENCES: dict[tuple[str, bool, int], Record] = {}
KEPT_REFERENCES = 6
"""References kept for the cells to come (a sweep runs an architecture's layouts one after the other): the newest
few, since a hundred causal LMs' weights at every step would not fit in memory."""


def reference(case: ZooCase, layout: ArchLayout) -> Record:
    """The plain loop on the same global batches: the layout's masks where the rule covers the model's
    randomness, the same partial sums as a pipeline (`accumulate`) where no BatchNorm makes them differ."""
    key = (case.name, layout.held, layout.chunks)
    if key not in _REFERENCES:
        trained = case_for(case, layout)
        has_batchnorm = any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in trained.build(0).modules())
        rule = layout_rule if drawn(case) and covers(drawn(case)) else torch_rng
        _REFERENCES[key] = run_reference(trained, global_batches(trained, 0, SIZES), dropout=rule,
                                         accumulate=1 if has_batchnorm else layout.chunks)
        while len(_REFERENCES) > KEPT_REFERENCES:
            del _REFERENCES[next(iter(_REFERENCES))]
    return _REFERENCES[key]



def _lost_peer(message: str) -> bool:
    return bool(re.search(r"gloo|Connection (closed|reset)|peer|timed out", message, re.IGNORECASE))


def judge(cell: ArchCell, case: ZooCase, records: list[dict[str, Any]]) -> Verdict:
    """The verdict on one cell from every rank's record (archs_cells.run_cells)."""
    layout = BY_NAME[cell.layout]
    seconds = max((r.get("seconds", 0.0) for r in records), default=0.0)
    kinds = [r["kind"] for r in records]

    def verdict(status: str, short: str, detail: str = "", strategy: str = "") -> Verdict:
        return Verdict(cell.arch, cell.layout, status, short, detail, round(seconds, 2), strategy)

    if "timeout" in kinds:
        return verdict(FAIL, f"FAIL: timed out after {records[kinds.index('timeout')]['seconds']:g} s",
                       records[kinds.index("timeout")].get("message", ""))
    failed = [r for r in records if r["kind"] in ("error", "collective", "died")]
    if failed:  # the first to fail caused it: a peer's lost connection or a collective that timed out follows
        first = min(failed, key=lambda r: (r["kind"] != "error" or _lost_peer(r["message"]), r["seconds"]))
        said = first["message"].strip().splitlines() or [""]  # a launch's error ends with the worker's own
        what = f"worker died: {said[-1]}" if first["kind"] == "died" else said[0]
        return verdict(FAIL, f"FAIL: {what[:100]}",
                       "\n".join(r["message"] + "\n" + r.get("traceback", "") for r in failed).strip())
    if set(kinds) == {"refused"}:
        message = records[0]["message"]
        return verdict(REFUSED, f"refused: {short_reason(message)}", message)
    if "refused" in kinds:
        message = records[kinds.index("refused")]["message"]
        return verdict(FAIL, "FAIL: ranks disagree: " + ", ".join(f"rank {r} {k}" for r, k in enumerate(kinds)),
                       message)
    results = [r["result"] for r in records]
    strategy = results[0]["strategy"]
    want = reference(case, layout)
    misses = [f"rank {rank}: {p}" for rank, result in enumerate(results)
              for p in mismatches(result["losses"], result["weights"], want, case.tolerances["fp32"])]
    lost = sorted(set(want.weights[-1]) - set().union(*(r["weights"][-1].keys() for r in results if r["weights"])))
    divided = spread(strategy, [r["where"] for r in results]) + ([f"no rank holds {lost}"] if lost else [])
    if divided:
        return verdict(FAIL, f"FAIL: {divided[0][:90]}", "\n".join(divided + misses), strategy)
    if not misses:
        return verdict(MATCH, "match", strategy=strategy)
    if not covers(drawn(case)):
        outside = ", ".join(sorted(drawn(case) - COVERS))
        return verdict(DIFFERS, f"differs: {outside} outside the rule", "\n".join(misses[:6]), strategy)
    return verdict(FAIL, f"FAIL: {misses[0][:90]}", "\n".join(misses[:6]), strategy)


def launched(cells: list[tuple[ArchCell, ZooCase]], nproc: int,
             limit_s: float = LIMIT_S) -> Iterator[tuple[ArchCell, list[dict[str, Any]]]]:
    """Every rank's record of every cell, cell by cell as launches end, from as few launches of `nproc` workers as
    the cells allow: a launch that ends inside a cell (a hang, a crash, a raw error) costs that cell, and the next
    launch starts after it. Each record is read once and its file removed (a cell's weights at every step)."""
    pending = list(range(len(cells)))
    with tempfile.TemporaryDirectory(prefix="paratrain-archs-") as folder:
        while pending:
            work = [(i, case_for(cells[i][1], BY_NAME[cells[i][0].layout]), BY_NAME[cells[i][0].layout])
                    for i in pending]
            ended = ""
            try:
                paratrain.launch(run_cells, work, folder, limit_s, nproc=nproc, timeout=limit_s * len(work) + 120,
                                 all_ranks=True, accelerator="cpu")
            except Exception as exc:  # noqa: BLE001 - the launch ended inside a cell; the records say which
                ended = f"{type(exc).__name__}: {str(exc).strip()}"
            left: list[int] = []
            for position, i in enumerate(pending):
                found = [_take(path) for r in range(nproc) if (path := record_path(folder, i, r)).exists()]
                if len(found) < nproc or any(r["kind"] in ENDS_WORKER for r in found):
                    missing = {"kind": "died", "seconds": 0.0, "message": ended or "the launch ended without a record"}
                    yield cells[i][0], found + [missing] * (nproc - len(found))
                    left = pending[position + 1:]
                    break
                yield cells[i][0], found
            pending = left


def _take(path: Path) -> dict[str, Any]:
    record: dict[str, Any] = torch.load(path, weights_only=False)
    path.unlink()
    return record


def sweep_cells(cells: list[tuple[ArchCell, ZooCase]], limit_s: float = LIMIT_S,
                verbose: bool = False) -> list[Verdict]:
    """Each (cell, case) judged, in the order given; the cells of one worker count share launches."""
    by_workers: dict[int, list[tuple[ArchCell, ZooCase]]] = {}
    for cell, case in cells:
        by_workers.setdefault(BY_NAME[cell.layout].nproc, []).append((cell, case))
    cases = dict(cells)
    verdicts: dict[ArchCell, Verdict] = {}
    for nproc, group in sorted(by_workers.items()):
        for cell, records in launched(group, nproc, limit_s):
            verdicts[cell] = v = judge(cell, cases[cell], records)
            if verbose:
                print(f"{time.strftime('%H:%M:%S')} {v.label}: {v.short} ({v.seconds:.1f} s)", file=sys.stderr,
                      flush=True)
    return [verdicts[cell] for cell, _ in cells]


def sweep(cases: dict[str, ZooCase], layouts: Iterable[str], limit_s: float = LIMIT_S,
          verbose: bool = False) -> list[Verdict]:
    """Every case under every named layout, judged, case by case (so each reference is computed once)."""
    return sweep_cells([(ArchCell(name, layout), case) for name, case in cases.items() for layout in layouts],
                       limit_s, verbose)
