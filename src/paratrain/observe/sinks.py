"""Where rank 0 writes logged values: `metrics.jsonl` (always) and TensorBoard event files (when installed).

Both are opened at the first `run.log` of a process and continue what an earlier process of the same
run wrote: a run that resumes from a checkpoint of step N logs steps after N again, so lines (and
TensorBoard events, through `purge_step`) of steps at or after the first step logged now are dropped,
and the files read as one run with no repeated steps. Each JSON line is flushed as it is written, so
the file can be read (`tail -f`, pandas) while training runs.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

INSTALL_HINT = "pip install 'paratrain[tensorboard]'"


def default_log_dir(checkpoint_dir: str | None, now: float | None = None) -> Path:
    """`<checkpoint_dir>/logs` (so a resumed run continues its logs), else a new `runs/<date>-<time>`."""
    if checkpoint_dir is not None:
        return Path(checkpoint_dir) / "logs"
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now))
    path, n = Path("runs") / stamp, 1
    while path.exists():
        n += 1
        path = Path("runs") / f"{stamp}-{n}"
    return path


class JsonLines:
    """Appends one JSON object per `write`, flushed at once; earlier lines at or after `first_step` are dropped."""

    def __init__(self, path: Path, first_step: int) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.exists():
            _drop_from(path, first_step)
        self._file = open(path, "a", encoding="utf-8")  # open for the whole run

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def _drop_from(path: Path, first_step: int) -> None:
    """Rewrite `path` (atomically) without the lines of steps >= first_step and without a torn last line."""
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    kept = [line for line in lines if line.endswith("\n") and _step_of(line) < first_step]
    if len(kept) == len(lines):
        return
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(kept), encoding="utf-8")
    os.replace(tmp, path)


def _step_of(line: str) -> float:
    try:
        return float(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return math.inf  # not a line this module wrote whole (a killed run's last one): dropped


class TensorBoard:
    """Scalars in TensorBoard event files; `None` from `open` when tensorboard is not installed. All the
    scalars of one `run.log` go in one event (a summary per tag, as `add_scalar` writes, costs several times more)."""

    def __init__(self, writer: Any, summary: Any) -> None:
        self._writer = writer
        self._summary = summary

    @classmethod
    def open(cls, folder: Path, first_step: int) -> TensorBoard | None:
        try:
            from tensorboard.compat.proto.summary_pb2 import Summary
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            return None
        return cls(SummaryWriter(str(folder), purge_step=first_step, flush_secs=10), Summary)

    def write(self, step: int, scalars: dict[str, float]) -> None:
        values = [self._summary.Value(tag=tag, simple_value=value) for tag, value in scalars.items()]
        self._writer.file_writer.add_summary(self._summary(value=values), step)

    def close(self) -> None:
        self._writer.close()


def notice(text: str) -> None:
    print(f"paratrain: {text}", file=sys.stderr, flush=True)
