"""No hangs, and the cause named: a missing or diverged rank makes its peers fail within the timeout with
the collective, the missing rank(s) and each rank's file and line; SIGTERM becomes a checkpoint.

Tier 1: the report's classification and the SIGTERM flag (forked children stand in for workers).
Tier 3: two ranks calling different collectives. Tier 4: `paratrain run` with one rank asleep forever.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from typing import Any

import pytest
from helpers import EXAMPLES, paratrain

import paratrain as pt
from paratrain.faults import StopRequest
from paratrain.faults.diagnose import Beat, report

EXAMPLE = str(EXAMPLES / "resumable.py")


# -- tier 1 -------------------------------------------------------------------------------------------
def _beat(rank: int, op: str, seq: int, age: float = 0.0, pid: int | None = None) -> Beat:
    return Beat(rank, time.time() - age, seq, op, f"train.py:{10 + rank} in main", pid or os.getpid(),
                socket.gethostname())


def test_the_report_sorts_peers_into_arrived_missing_diverged_and_dead() -> None:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    beats = {
        0: _beat(0, "all_reduce", 7),
        1: _beat(1, "all_reduce", 7),  # arrived
        2: _beat(2, "barrier", 7),  # another collective at the same point: diverged code paths
        3: _beat(3, "", 6),  # computing / sleeping in user code
        4: _beat(4, "all_reduce", 5),  # out of step
        5: _beat(5, "all_reduce", 6, pid=gone.pid),  # its process has exited
        6: _beat(6, "", 6, age=30.0),  # silent
        7: None,  # never started
    }
    missing, text = report(0, "all_reduce", 7, beats, RuntimeError("Timed out waiting 3000ms"), 3.0, 5.0,
                           "train.py:10 in main")
    assert missing == [2, 3, 4, 5, 6, 7]
    lines = text.splitlines()
    assert lines[0].startswith("all_reduce (collective #7 of rank 0) failed after 3.0 s: rank(s) [2, 3, 4, 5, 6, 7]")
    assert "rank 1: waiting in all_reduce #7 too, at train.py:11 in main" in text
    assert "rank 2: in a different collective, barrier #7 (the ranks took different code paths)" in text
    assert "rank 3: not in a collective (finished #6), at train.py:13 in main" in text
    assert "rank 4: in all_reduce #5, behind of this rank (out of step)" in text
    assert f"rank 5: its process (pid {gone.pid}) has exited" in text
    assert "rank 6: no heartbeat for 30" in text and "rank 7: no heartbeat ever published" in text
    assert "cause: Timed out waiting 3000ms" in text and "--timeout" in text


def _in_child(fn: Any) -> int:
    """Run fn in a forked child; its exit status as subprocess reports it (negative: killed by a signal)."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            code = fn()
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def test_sigterm_waits_for_a_step_boundary_only_in_a_loop_that_polls_it() -> None:
    def polled() -> int:
        stop = StopRequest(grace_s=60)
        stop.install()
        stop.polled = True
        os.kill(os.getpid(), signal.SIGTERM)
        return 0 if stop.requested else 1

    def not_polled() -> int:
        StopRequest().install()
        os.kill(os.getpid(), signal.SIGTERM)
        return 0  # not reached: SIGTERM keeps its usual meaning

    def stuck() -> int:
        stop = StopRequest(grace_s=0.2)
        stop.install()
        stop.polled = True
        os.kill(os.getpid(), signal.SIGTERM)
        while True:  # never reaches a step boundary
            signal.pause()

    assert _in_child(polled) == 0
    assert _in_child(not_polled) == -signal.SIGTERM
    assert _in_child(stuck) == 128 + signal.SIGTERM


def test_sigterm_keeps_its_meaning_after_runs_closed_out_of_order() -> None:
    """Two runs closed first-made-first leave the first run's handler installed; SIGTERM in a loop that does not
    poll still ends the process by the signal (it recursed through the stale handler and raised before)."""
    import paratrain

    before = signal.getsignal(signal.SIGTERM)
    first, other = paratrain.setup(strategy="single"), paratrain.setup(strategy="single")
    first.close()
    other.close()

    def not_polled() -> int:
        StopRequest().install()
        os.kill(os.getpid(), signal.SIGTERM)
        return 0  # not reached

    try:
        assert _in_child(not_polled) == -signal.SIGTERM
    finally:
        signal.signal(signal.SIGTERM, before if before is not None else signal.SIG_DFL)


# -- tier 3 -------------------------------------------------------------------------------------------
def _diverge() -> str:
    run = pt.setup(strategy="ddp", timeout_s=2)
    run.barrier()  # collective #1 on both ranks
    try:
        if run.rank == 0:
            run.all_reduce(1.0)
        else:
            run.barrier()
    except pt.CollectiveTimeout as exc:
        return str(exc)
    finally:
        run.close()
    return "no error"


@pytest.mark.timeout(90)
def test_ranks_in_different_collectives_fail_within_the_timeout_naming_each_other() -> None:
    msgs = pt.launch(_diverge, nproc=2, timeout=80, all_ranks=True)
    assert msgs[0].startswith("all_reduce (collective #2 of rank 0) failed after"), msgs[0]
    assert "rank(s) [1] did not arrive" in msgs[0]
    assert "rank 1: in a different collective, barrier #2 (the ranks took different code paths)" in msgs[0]
    assert "test_faults.py" in msgs[0] and "in _diverge: run.barrier()" in msgs[0]  # where rank 1 is
    assert "rank 0: in a different collective, all_reduce #2" in msgs[1]
    assert "in _diverge: run.all_reduce(1.0)" in msgs[1]


# -- tier 4 -------------------------------------------------------------------------------------------
@pytest.mark.timeout(120)
def test_a_rank_asleep_before_a_collective_fails_the_job_naming_it_and_its_line(tmp_path: Any) -> None:
    out = paratrain("run", "--nproc", "2", "--timeout", "3", EXAMPLE, "--checkpoint-dir", str(tmp_path / "ckpt"),
                    "--ledger", str(tmp_path / "ledger"), "--fault", "hang:1@3", timeout=100)
    text = out.stdout
    assert out.returncode != 0, text[-3000:]
    assert "then rank 1: stopped by the launcher" in text  # the sleeper was stopped too: nothing is left hanging
    root_cause = text[text.index("paratrain run: worker rank 0 of 2 failed:"):]
    assert "CollectiveTimeout" in root_cause  # the traceback reached the launcher
    assert "should_stop (collective #" in root_cause and "rank(s) [1] did not arrive" in root_cause
    sleep_line = next(i for i, line in enumerate(open(EXAMPLE), 1) if "time.sleep(3600)" in line)
    assert "rank 1: not in a collective (finished #" in root_cause
    assert f"resumable.py:{sleep_line} in after_step: time.sleep(3600)" in root_cause
