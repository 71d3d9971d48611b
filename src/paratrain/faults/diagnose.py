"""Turning "a collective failed" into "which rank is missing and where it is".

Each rank's heartbeat (see `watch.py`) says which paratrain collective it is in (name and sequence
number: the n-th collective call of this rank) and the file and line its main thread is at. When a
collective fails on one rank, comparing its (name, number) with every peer's sorts the peers into:

    arrived      same collective, same number: waiting like us
    diverged     a different collective at the same number: the ranks took different code paths
    behind/ahead the same kind of call but another number: out of step
    elsewhere    not in a collective at all (computing, sleeping, stuck in user code)
    exited       its process is gone (checked when it ran on this host)
    silent       no heartbeat for a while: dead, or stuck outside Python
"""

from __future__ import annotations

import functools
import linecache
import os
import socket
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

import torch

_SKIP_DIRS = tuple(
    str(Path(p).resolve()) + os.sep
    for p in {Path(__file__).resolve().parents[1], Path(torch.__file__).resolve().parent,
              Path(sysconfig.get_paths()["stdlib"])}
)
@functools.lru_cache(maxsize=1024)
def _is_user(filename: str) -> bool:
    try:
        path = str(Path(filename).resolve())
    except (OSError, ValueError):
        return False
    return not filename.startswith("<") and not path.startswith(_SKIP_DIRS)


def where(frame: FrameType | None) -> str:
    """'file:line in function: code' of the innermost frame outside paratrain, torch and the stdlib."""
    innermost = frame
    while frame is not None and not _is_user(frame.f_code.co_filename):
        frame = frame.f_back
    frame = frame or innermost
    if frame is None:
        return "unknown"
    name, line = frame.f_code.co_filename, frame.f_lineno
    try:
        shown = os.path.relpath(name)
    except ValueError:
        shown = name
    if shown.startswith(".." + os.sep + ".."):
        shown = name
    code = linecache.getline(name, line).strip()
    return f"{shown}:{line} in {frame.f_code.co_name}" + (f": {code}" if code else "")


def main_thread_where() -> str:
    import threading

    ident = threading.main_thread().ident
    return where(sys._current_frames().get(ident or -1))


@dataclass(frozen=True)
class Beat:
    """One rank's heartbeat as published to the store."""

    rank: int
    time: float
    seq: int
    op: str
    where: str
    pid: int
    host: str

    @classmethod
    def from_dict(cls, rank: int, d: dict[str, Any]) -> Beat:
        return cls(rank, float(d["t"]), int(d["seq"]), str(d["op"]), str(d["where"]), int(d["pid"]), str(d["host"]))


def exited(beat: Beat) -> bool:
    """True when the peer ran on this host and its process is gone (or a zombie not yet reaped)."""
    if beat.host != socket.gethostname():
        return False
    try:
        with open(f"/proc/{beat.pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        pass
    try:
        os.kill(beat.pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def describe(beat: Beat | None, op: str, seq: int, silent_after: float, now: float | None = None,
             store_gone: bool = False) -> tuple[bool, str]:
    """(arrived, one line about this peer) relative to collective `op` number `seq`."""
    if beat is None and store_gone:
        return False, "unknown: the job's store went away with rank 0"
    if beat is None:
        return False, "no heartbeat ever published (it never reached setup(), or cannot reach the store)"
    now = time.time() if now is None else now
    at = f"at {beat.where}"
    age = now - beat.time
    if exited(beat):
        doing = f"in {beat.op} #{beat.seq}" if beat.op else f"after collective #{beat.seq}"
        return False, f"its process (pid {beat.pid}) has exited (last known heartbeat, {age:.1f} s ago: {doing} {at})"
    if age > silent_after:
        return False, f"no heartbeat for {age:.1f} s (dead, or stuck outside Python); last {at}"
    if beat.op == op and beat.seq == seq:
        return True, f"waiting in {op} #{seq} too, {at}"
    if beat.op and beat.seq == seq:
        return False, f"in a different collective, {beat.op} #{seq} (the ranks took different code paths), {at}"
    if beat.op:
        order = "behind" if beat.seq < seq else "ahead"
        return False, f"in {beat.op} #{beat.seq}, {order} of this rank (out of step), {at}"
    return False, f"not in a collective (finished #{beat.seq}), {at}"


def report(rank: int, op: str, seq: int, beats: dict[int, Beat | None], cause: BaseException, waited: float,
           silent_after: float, here: str, store_gone: bool = False) -> tuple[list[int], str]:
    """(ranks that did not arrive, the message of the CollectiveTimeout this rank raises)."""
    lines, missing = [], []
    for peer in sorted(beats):
        if peer == rank:
            lines.append(f"  rank {peer}: in {op} #{seq} at {here} (this rank)")
            continue
        arrived, text = describe(beats[peer], op, seq, silent_after, store_gone=store_gone)
        if not arrived:
            missing.append(peer)
        lines.append(f"  rank {peer}: {text}")
    first = str(cause).strip().splitlines()[0] if str(cause).strip() else type(cause).__name__
    if missing:
        head = (f"{op} (collective #{seq} of rank {rank}) failed after {waited:.1f} s: "
                f"rank(s) {missing} did not arrive.")
    else:
        head = (f"{op} (collective #{seq} of rank {rank}) failed after {waited:.1f} s although every rank "
                "reached it: the communication backend failed.")
    hint = ("Fix the rank named above; the limit is setup(timeout_s=...) / paratrain run --timeout "
            "(a rank that dies makes its peers fail at once).")
    return missing, "\n".join([head, *lines, f"  cause: {first[:300]}", hint])
