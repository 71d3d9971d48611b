"""`run.log(step, **metrics)`: numbers reduced over ranks in one small all-reduce, then written by rank 0.

Every rank packs what it logs into one float64 vector and the vector is summed over the world once:

    [ checksum | metric 1 .. metric n | rank 0's phase times | rank 1's | ... ]   (phase times: profiling only)

A mean is the sum divided by the world size; per-rank values travel in slots that are zero on every
other rank, so the same sum gathers them. The checksum (of the names and whether phases are timed)
must come back `world size` times itself: a rank that logged other names is an error, not a silently
mixed-up average. Nothing is packed, reduced or opened until the first `run.log`; a run that never
logs pays nothing (but for a slow-rank event, stragglers.py, which rank 0 appends to metrics.jsonl too).

`samples=` and `tokens=` are counts, not averages: what this rank processed since its previous
`run.log`, summed over data-parallel replicas (the stages of one pipeline replica count once) and
turned into a rate. Without them the rate is samples/s from the micro-steps run since the previous
`run.log` times the global batch of the training loader from `run.prepare_loader`.
"""

from __future__ import annotations

import numbers
import time
import zlib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from ..errors import ParatrainError
from .breakdown import PHASES, Breakdown, RankTimes, per_step, rank_times, slow_ranks
from .progress import Bar
from .sinks import INSTALL_HINT, JsonLines, TensorBoard, default_log_dir, notice

REDUCE_MODES = ("mean", "sum")
COUNTS = ("samples", "tokens")
AUTOMATIC = ("step", "time", "event", "step_time_s", "samples_per_s", "tokens_per_s", "per_rank", "slow_ranks",
             *(f"{p}_s" for p in (*PHASES, "other")))
"""Fields paratrain writes itself; a metric may not take one of these names."""

Reduce = str | Mapping[str, str]


class MetricLog:
    """One rank's side of `run.log`: packs and reduces on every rank; rank 0 also writes and draws the bar."""

    def __init__(self, *, rank: int, world_size: int, ranks_per_replica: int, device: torch.device,
                 timing: Breakdown, all_reduce_sum: Callable[[torch.Tensor], torch.Tensor],
                 log_dir: str | None, checkpoint_dir: str | None, progress: bool | None) -> None:
        self.rank, self.world_size, self.ranks_per_replica = rank, world_size, ranks_per_replica
        self.device = device
        self.timing = timing
        self._sum = all_reduce_sum
        self._log_dir, self._checkpoint_dir = log_dir, checkpoint_dir
        self._progress = progress
        self._folder: Path | None = None
        self._jsonl: JsonLines | None = None
        self._tensorboard: TensorBoard | None = None
        self._bar: Bar | None = None
        self._total: int | None = None
        self._shown: dict[str, str] = {}
        """The bar's text: the latest value of everything logged so far (a validation line keeps the loss)."""
        self._step = 0
        """The step the current interval starts after (the last one logged, or the checkpoint's)."""
        self.start(0, 0)

    @property
    def folder(self) -> Path:
        """The log directory (resolved once; only rank 0 writes there)."""
        if self._folder is None:
            self._folder = Path(self._log_dir) if self._log_dir else default_log_dir(self._checkpoint_dir)
        return self._folder

    def start(self, step: int | None, micro: int, snapshot: list[float] | None = None) -> None:
        """The next interval (step time, rates, phases) starts now, after `step` (None: keep the last one)."""
        self._step = self._step if step is None else step
        self._micro = micro
        self._since = snapshot or self.timing.snapshot()
        """Phase totals and this rank's clock when the interval began: intervals tile the run, logging included."""

    def log(self, step: int, values: Mapping[str, Any], reduce: Reduce, total_steps: int | None, micro: int,
            global_batch: int | None) -> dict[str, Any]:
        """Reduce `values` over every rank, write them on rank 0, and return the record (on every rank)."""
        names = list(values)
        modes = _modes(names, reduce)
        steps = step - self._step
        timed = self.timing.profiling and steps > 0  # a line at the same step (validation) has no steps to time
        now = self.timing.snapshot()
        mine = per_step(self._since, now, steps) if timed else []
        slot = len(mine)
        check = float(zlib.crc32(repr((names, modes, timed)).encode()))
        parts = [torch.tensor([check], dtype=torch.float64, device=self.device)]
        parts += [_number(name, values[name], self.device) for name in names]
        if timed:
            block = torch.zeros(self.world_size * slot, dtype=torch.float64, device=self.device)
            block[self.rank * slot:(self.rank + 1) * slot] = torch.tensor(mine, dtype=torch.float64)
            parts.append(block)
        summed = self._sum(torch.cat(parts)).tolist()  # the one collective, and the one device-to-host copy
        if summed[0] != check * self.world_size:
            raise ParatrainError(
                f"run.log(step={step}) was called with different metric names on different ranks (this rank: "
                f"{names}, reduce {modes}, profiling {timed}); every rank must log the same names at the same steps"
            )
        record: dict[str, Any] = {"step": step, "time": round(time.time(), 3)}
        for i, name in enumerate(names):
            value = summed[1 + i]
            if modes[name] == "count":
                value /= self.ranks_per_replica
            elif modes[name] == "mean":
                value /= self.world_size
            record[name] = value
        elapsed = now[-1] - self._since[-1]
        if steps > 0 and elapsed > 0:
            record["step_time_s"] = elapsed / steps
            counted = [c for c in COUNTS if c in values]
            if counted:
                record[f"{counted[-1]}_per_s"] = record[counted[-1]] / elapsed
            elif global_batch and micro > self._micro:
                record["samples_per_s"] = (micro - self._micro) * global_batch / elapsed
        ranks: list[RankTimes] = []
        if timed:
            flat = summed[1 + len(names):]
            ranks = [rank_times(flat[r * slot:(r + 1) * slot]) for r in range(self.world_size)]
            _add_breakdown(record, ranks)
        if total_steps is not None:
            self._total = total_steps
        if self.rank == 0:
            self._write(step, record)
        if steps > 0:  # else the interval goes on: the next step's time includes what ran at this one
            self.start(step, micro, now)
        return record

    # -- rank 0 ---------------------------------------------------------------------------------
    def _write(self, step: int, record: dict[str, Any]) -> None:
        if self._bar is None:
            self._open(step)
        assert self._jsonl is not None and self._bar is not None
        self._jsonl.write(record)
        if self._tensorboard is not None:
            self._tensorboard.write(step, _scalars(record))
        self._shown.update(_shown(record))
        self._bar.advance(to=step, total=self._total,
                          postfix=", ".join(f"{k}={v}" for k, v in self._shown.items() if v))

    def event(self, record: dict[str, Any], text: str) -> None:
        """Print `text` (above the bar) and append `record`, which carries its own "step" and "event", to
        metrics.jsonl: a thing that happened, not a logged step (a slow rank). Opens the file if no `run.log` has,
        dropping what a crashed process wrote after the step this one resumed from, as the first `run.log` would."""
        with self.outside():
            notice(text)
        if self._jsonl is None:
            self._jsonl = JsonLines(self.folder / "metrics.jsonl", first_step=self._step + 1)
        self._jsonl.write({"step": record["step"], "time": round(time.time(), 3), **record})

    def _open(self, step: int) -> None:
        folder = self.folder
        if self._jsonl is None:  # else opened for an event before the first run.log
            self._jsonl = JsonLines(folder / "metrics.jsonl", first_step=step)
        self._tensorboard = TensorBoard.open(folder, first_step=step)
        self._bar = Bar(self._progress, total=self._total, initial=self._step, unit="step")
        if self._tensorboard is None:
            with self._bar.outside():
                notice(f"tensorboard is not installed, so metrics go to {folder / 'metrics.jsonl'} only; "
                       f"{INSTALL_HINT} adds TensorBoard event files")

    def outside(self) -> Any:
        """A context for printing without breaking the progress bar."""
        return self._bar.outside() if self._bar is not None else Bar(False).outside()

    def close(self) -> None:
        for sink in (self._bar, self._jsonl, self._tensorboard):
            if sink is not None:
                sink.close()
        self._bar = self._jsonl = self._tensorboard = None


def _modes(names: list[str], reduce: Reduce) -> dict[str, str]:
    """How each name is reduced: "count" for samples/tokens, else the caller's "mean"/"sum"; checked here."""
    per_name = dict(reduce) if isinstance(reduce, Mapping) else {}
    default = "mean" if isinstance(reduce, Mapping) else reduce
    for name in names:
        if name in AUTOMATIC:
            raise ParatrainError(f"run.log: {name!r} is a field paratrain writes itself; name the metric differently "
                                 f"(reserved: {', '.join(AUTOMATIC)})")
    for name, mode in [("reduce", default), *per_name.items()]:
        if mode not in REDUCE_MODES:
            raise ParatrainError(f"run.log: reduce {mode!r} for {name!r}: use 'mean' or 'sum'")
    unknown = sorted(set(per_name) - set(names))
    if unknown:
        raise ParatrainError(f"run.log: reduce names {unknown}, which are not logged in this call ({names})")
    return {n: "count" if n in COUNTS else per_name.get(n, default) for n in names}


def _number(name: str, value: Any, device: torch.device) -> torch.Tensor:
    """One float64 element on `device`; a tensor stays on its device (no synchronisation here)."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ParatrainError(f"run.log: {name} is a tensor of shape {tuple(value.shape)}; log one number per "
                                 f"name, e.g. {name}={name}.mean()")
        return value.detach().reshape(1).to(device=device, dtype=torch.float64)
    if isinstance(value, numbers.Real):
        return torch.tensor([float(value)], dtype=torch.float64, device=device)
    raise ParatrainError(f"run.log: {name}={value!r} is not a number; log numbers or one-element tensors")


def _add_breakdown(record: dict[str, Any], ranks: list[RankTimes]) -> None:
    """Mean seconds per step of each phase, every rank's own, and the ranks found slow."""
    fields = (*PHASES, "other")
    for p in fields:
        record[f"{p}_s"] = sum(getattr(t, p) for t in ranks) / len(ranks)
    record["per_rank"] = {f"{p}_s": [getattr(t, p) for t in ranks] for p in fields}
    slow = slow_ranks(ranks)
    if slow:
        record["slow_ranks"] = slow


def _scalars(record: dict[str, Any]) -> dict[str, float]:
    """TensorBoard tags: metrics under their own names, speed under perf/, the phases under breakdown/."""
    out = {}
    for key, value in record.items():
        if key in ("step", "time", "per_rank", "slow_ranks"):
            continue
        if key in ("step_time_s", "samples_per_s", "tokens_per_s"):
            out[f"perf/{key}"] = value
        elif key in AUTOMATIC:
            out[f"breakdown/{key}"] = value
            out[f"breakdown/{key}_max"] = max(record["per_rank"][key])
        else:
            out[key] = value
    return out


def _shown(record: dict[str, Any]) -> dict[str, str]:
    """What a record adds to the bar: its metrics, speed and step time, and which ranks are slow in it."""
    shown = {k: _fmt(v) for k, v in record.items() if k not in AUTOMATIC}
    for key, label in (("tokens_per_s", "tokens/s"), ("samples_per_s", "samples/s")):
        if key in record:
            shown[label] = _fmt(record[key])
    if "step_time_s" in record:
        shown["step"] = f"{record['step_time_s'] * 1e3:.1f}ms"
    if "per_rank" in record:
        shown["slow rank"] = ",".join(map(str, record.get("slow_ranks", [])))  # empty: not shown
    return shown


def _fmt(value: float) -> str:
    return f"{value:.4g}" if abs(value) < 1e4 else f"{value:.3g}"
