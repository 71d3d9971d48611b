"""`paratrain.launch` from a script and from an interactive interpreter: results come back, a failing rank is
named with its traceback while its blocked peer is ended, and no worker outlives its launcher: not on a
failure, a timeout, Ctrl-C, or when the launching process itself is SIGKILLed."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from helpers import alive

import paratrain
from paratrain import ParatrainError, runtime

DRIVER = '''
import json, os, sys, threading
import torch
import paratrain
from paratrain.launcher._zygote import template_pids
from paratrain.launcher.spawn import WorkerFailed


def report(tag, **data):
    print(f"@{tag} " + json.dumps(data), flush=True)


def children():
    """Live child processes of this script (a launch must leave none but a warm workers' template)."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[0] != "Z" and int(fields[1]) == os.getpid() and int(entry) not in template_pids():
            found.append(int(entry))
    return found


def train(scale, *, offset):
    run = paratrain.setup(strategy="ddp")
    total = run.all_reduce(torch.tensor((run.rank + 1) * scale + offset), op="sum")
    out = {"rank": run.rank, "world": run.world_size, "threads": torch.get_num_threads(),
           "total": float(total), "pid": os.getpid()}
    run.close()
    return out


def fails_on_rank_1():
    run = paratrain.setup(strategy="ddp")
    print(f"PID {os.getpid()}", flush=True)
    if run.rank == 1:
        raise ValueError("rank 1 cannot go on")
    threading.Event().wait()  # rank 0 would wait forever: only the launcher can end it


def block(tag):
    print(f"{tag} {os.getpid()}", flush=True)
    threading.Event().wait()


results = paratrain.launch(train, 10.0, nproc=2, all_ranks=True, timeout=120, offset=0.5)
report("results", results=results, children=children(), templates=sorted(template_pids()))

try:
    paratrain.launch(fails_on_rank_1, nproc=2, timeout=120)
except WorkerFailed as err:
    report("failed", rank=err.rank, detail=err.detail, message=str(err), children=children())

try:
    paratrain.launch(block, "SLOW", nproc=2, timeout=1)
except paratrain.ParatrainError as err:
    report("timeout", message=str(err), children=children())

try:
    paratrain.launch(block, "INTERRUPT_ME", nproc=2)
except KeyboardInterrupt:
    report("interrupted", children=children())

paratrain.launch(block, "KILL_ME", nproc=2)
'''


class Lines:
    """A process's stdout, read line by line in the background so the test can wait for a line to appear."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.seen: list[str] = []
        self._queue: queue.Queue[str | None] = queue.Queue()
        self._thread = threading.Thread(target=self._read, args=(proc,), daemon=True)
        self._thread.start()

    def _read(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            self._queue.put(line.rstrip("\n"))
        self._queue.put(None)

    def wait_for(self, done: Callable[[list[str]], bool], timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while not done(self.seen):
            try:
                line = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                line = None
            if line is None:
                raise AssertionError("expected output never came; got:\n" + "\n".join(self.seen[-60:]))
            self.seen.append(line)

    def report(self, tag: str) -> dict:  # type: ignore[type-arg]
        self.wait_for(lambda seen: any(s.startswith(f"@{tag} ") for s in seen))
        return json.loads(next(s for s in self.seen if s.startswith(f"@{tag} ")).split(" ", 1)[1])

    def pids(self, tag: str) -> list[int]:
        return [int(s.rsplit(" ", 1)[1]) for s in self.seen if s.split("] ", 1)[-1].startswith(f"{tag} ")]


def _describe(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return f"{pid} (gone)"
    return f"{pid}: {cmd} | {stat}"


def _workers_under(tmp: Path) -> list[int]:
    """Live worker processes whose command line names `tmp` (their launch folder is made inside it)."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read().decode(errors="replace")
        except OSError:
            continue
        if "paratrain.launcher._worker" in cmd and str(tmp) in cmd and alive(int(entry)):
            found.append(int(entry))
    return found


def _interruptible() -> None:
    """In the child: Ctrl-C as at a terminal. A suite started in the background of a non-interactive shell
    (`make test &`) inherits SIGINT ignored, and Python then leaves it ignored in every child."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _start(args: list[str], tmp: Path, warm: str = "", **kw: object) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if k != "PARATRAIN_WARM_WORKERS"}
    env.update({"TMPDIR": str(tmp), "PYTHONUNBUFFERED": "1", **({"PARATRAIN_WARM_WORKERS": warm} if warm else {})})
    return subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, preexec_fn=_interruptible, **kw)  # type: ignore[call-overload]


@pytest.mark.procs
@pytest.mark.parametrize("warm", ["", "torch,paratrain"], ids=["spawned", "warm"])
def test_launch_from_a_script(tmp_path: Path, warm: str) -> None:
    """The same promises for workers started as new processes and for workers forked from a warm template
    (PARATRAIN_WARM_WORKERS), whose only extra process is the template, gone with its launcher."""
    script = tmp_path / "driver.py"
    script.write_text(textwrap.dedent(DRIVER))
    proc = _start([sys.executable, str(script)], tmp_path, warm)
    out = Lines(proc)
    try:
        # Every rank's return value; setup() found world size 2; one thread per CPU worker; kwargs passed.
        res = out.report("results")
        assert len(res["templates"]) == (1 if warm else 0)
        assert [r["rank"] for r in res["results"]] == [0, 1]
        assert all(r["world"] == 2 and r["threads"] == 1 and r["total"] == 31.0 for r in res["results"])
        assert res["children"] == []

        # Rank 1 raises, rank 0 blocks forever: the caller gets rank 1's traceback; both are gone.
        failed = out.report("failed")
        assert failed["rank"] == 1
        assert "ValueError: rank 1 cannot go on" in failed["detail"]
        assert 'driver.py", line' in failed["detail"] and "in fails_on_rank_1" in failed["detail"]
        assert failed["message"].startswith("worker rank 1 of 2 failed; all workers were stopped:\nTraceback")
        assert failed["message"].endswith("ValueError: rank 1 cannot go on")  # the reason stays the last line
        assert failed["children"] == []

        timeout = out.report("timeout")
        assert "still running after timeout=1s and were stopped" in timeout["message"]
        assert timeout["children"] == []

        # Ctrl-C reaches only the launching process (workers run in their own sessions); it ends them.
        out.wait_for(lambda _: len(out.pids("INTERRUPT_ME")) == 2)
        proc.send_signal(signal.SIGINT)
        assert out.report("interrupted")["children"] == []

        # The launching process is SIGKILLed (a notebook kernel restarted): its workers end themselves.
        out.wait_for(lambda _: len(out.pids("KILL_ME")) == 2)
        proc.kill()
        proc.wait(timeout=30)
        pids = [r["pid"] for r in res["results"]] + out.pids("PID") + out.pids("INTERRUPT_ME")
        pids += out.pids("KILL_ME")
        assert len(pids) == 8
        deadline = time.monotonic() + 30  # a SIGKILLed process takes a moment to be torn down
        while (_workers_under(tmp_path) or any(map(alive, pids))) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _workers_under(tmp_path) == []
        assert [_describe(pid) for pid in pids if alive(pid)] == []
        deadline = time.monotonic() + 30
        while any(map(alive, res["templates"])) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert [_describe(pid) for pid in res["templates"] if alive(pid)] == []
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@pytest.mark.procs
def test_launch_from_an_interactive_interpreter(tmp_path: Path) -> None:
    """A function typed at the `>>>` prompt has no source file and lives in `__main__`; it still reaches the
    workers. It starts its process group the tutorials' way, with plain `init_process_group`, which works
    inside launch too; by default rank 0's result comes back."""
    session = textwrap.dedent('''
        import paratrain
        import torch.distributed as dist
        def who(x):
            dist.init_process_group("gloo")
            return "rank", dist.get_rank(), "of", dist.get_world_size(), "says", x * x

        print("RESULT", paratrain.launch(who, 7, nproc=2, timeout=120))
    ''')
    proc = _start([sys.executable, "-i", "-q"], tmp_path, stdin=subprocess.PIPE)
    out, _ = proc.communicate(session, timeout=120)
    assert proc.returncode == 0, out
    assert "RESULT ('rank', 0, 'of', 2, 'says', 49)" in out
    assert _workers_under(tmp_path) == []


def test_bad_launch_input_is_refused_before_anything_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(runtime, "cuda_count", lambda: 2)
    with pytest.raises(ParatrainError, match=r"nproc=3 but only 2 GPU\(s\) are visible.*nproc<=2.*accelerator='cpu'"):
        paratrain.launch(print, nproc=3)
    assert runtime.worker_count(None, "auto") == 2  # one worker per GPU by default
    assert runtime.worker_count(3, "cpu") == 3  # CPU workers on a GPU machine: any number
    with pytest.raises(ParatrainError, match="nproc must be >= 1, got 0"):
        paratrain.launch(print, nproc=0)
    monkeypatch.setattr(runtime, "cuda_count", lambda: 0)
    assert runtime.worker_count(None, "auto") == 1
    with pytest.raises(ParatrainError, match="accelerator='cuda' but no CUDA GPU is visible"):
        paratrain.launch(print, accelerator="cuda")
    lock = threading.Lock()
    with pytest.raises(ParatrainError, match="cannot be sent to the workers .*lock.*create such objects inside"):
        paratrain.launch(lambda: lock.locked(), nproc=2)


def _split_one_sample() -> None:
    run = paratrain.setup(strategy="ddp")
    run.per_worker_batch(1)  # one sample over two workers: every rank raises the same ParatrainError


@pytest.mark.procs
def test_an_error_every_rank_raises_is_told_once(capfd: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(paratrain.WorkerFailed) as failed:
        paratrain.launch(_split_one_sample, nproc=2, timeout=120)
    message = str(failed.value)
    assert message.startswith("worker ranks 0, 1 of 2 failed with the same error; all workers were stopped:\n"
                              "Traceback"), message
    assert message.count("global batch 1 cannot be split evenly over 2") == 1, message
    assert message.endswith("use a global batch that is a multiple of 2 (e.g. 2)")  # the reason stays last
    output = capfd.readouterr()
    assert "global batch 1" not in output.out + output.err  # the workers leave it to the launcher
