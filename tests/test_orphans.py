"""Nothing outlives its launcher: SIGKILL `paratrain run` or `paratrain.launch` (the launcher alone, or its whole
process group, as a shell, a scheduler or the OOM killer does) and every worker it started is gone within 10 s,
its heartbeat file still (launcher/_lifeline.py). An elastic restart, where the agent itself ends and restarts
its workers, still works."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from helpers import ROOT, alive, cli_env, kept_template_pids, paratrain

from paratrain.launcher import _lifeline

WITHIN_S = 10.0
"""How soon a dead launcher's workers must be gone."""

HEARTBEAT = """
import os, sys, time
rank = os.environ["RANK"]
os.write(1, f"worker {rank} pid {os.getpid()} restart {os.environ.get('TORCHELASTIC_RESTART_COUNT')}\\n".encode())
path = os.path.join(sys.argv[1], f"beat-{rank}")
while True:  # what a training loop that checkpoints does to the folder it writes
    with open(path, "a") as f:
        f.write(f"{os.getpid()} {os.getppid()}\\n")
    time.sleep(0.05)
"""

LAUNCH = """
import os, sys, time
import paratrain

def beat(folder):
    path = os.path.join(folder, f"beat-{os.environ['RANK']}")
    while True:
        with open(path, "a") as f:
            f.write(f"{os.getpid()} {os.getppid()}\\n")
        time.sleep(0.05)

paratrain.launch(beat, sys.argv[1], nproc=2, timeout=300)
"""

MARK = "PARATRAIN_TEST_ORPHANS"
"""An environment variable each test's launcher gets, inherited by what it starts: a leftover is found by it."""


def _marked(mark: str) -> set[int]:
    """Live processes started with MARK=mark in their environment."""
    found = set()
    needle = f"{MARK}={mark}".encode()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    if needle in f.read().split(b"\0"):
                        found.add(int(entry))
            except OSError:
                pass
    return {pid for pid in found if alive(pid)}


def _beats(folder: Path) -> dict[str, tuple[int, int]]:
    """Each heartbeat file's writer (pid, parent pid), from its first line."""
    out = {}
    for path in folder.glob("beat-*"):
        first = path.read_text().split("\n", 1)[0].split()
        if len(first) == 2:
            out[path.name] = (int(first[0]), int(first[1]))
    return out


def _within(seconds: float, ok: Callable[[], bool]) -> bool:
    """Whether `ok()` comes true within `seconds` (polled)."""
    deadline = time.monotonic() + seconds
    while not ok():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


class Launcher:
    """A launcher command in its own process group, started with a mark; whatever carries the mark when the
    test ends is killed, so a failing test leaves nothing behind either."""

    def __init__(self, args: list[str], env: dict[str, str], folder: Path) -> None:
        self.mark = uuid.uuid4().hex
        self.folder = folder
        self.proc = subprocess.Popen(args, env={**env, MARK: self.mark}, cwd=ROOT, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, start_new_session=True)

    def output(self) -> str:
        if self.proc.poll() is None:
            return "(still running)"
        assert self.proc.stdout is not None
        return self.proc.stdout.read()[-3000:]

    def wait_for_workers(self, n: int, within: float = 180) -> dict[str, tuple[int, int]]:
        _within(within, lambda: len(_beats(self.folder)) == n or self.proc.poll() is not None)
        assert len(_beats(self.folder)) == n, f"{n} heartbeats not written:\n{self.output()}"
        return _beats(self.folder)

    def cleanup(self) -> None:
        for pid in _marked(self.mark) | {self.proc.pid}:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait(10)


@pytest.fixture
def launcher() -> Iterator[list[Launcher]]:
    started: list[Launcher] = []
    yield started
    for one in started:
        one.cleanup()


def _kill_and_check(launcher: Launcher, how: str, keep: frozenset[int] = frozenset()) -> None:
    """SIGKILL the launcher (`group` or `alone`); then every process it started, every heartbeat's writer and
    (but for `keep`) its parent are gone within WITHIN_S, and the heartbeat files no longer grow."""
    beats = launcher.wait_for_workers(2)
    started = _marked(launcher.mark) - {launcher.proc.pid}
    assert started, "the launcher started nothing"
    if how == "group":
        os.killpg(launcher.proc.pid, signal.SIGKILL)
    else:
        os.kill(launcher.proc.pid, signal.SIGKILL)
    launcher.proc.wait(10)
    pids = {pid for pair in beats.values() for pid in pair} - keep - {launcher.proc.pid}
    assert _within(WITHIN_S, lambda: not any(alive(p) for p in pids) and not _marked(launcher.mark)), \
        f"still running {WITHIN_S:g}s later: {sorted(p for p in pids | _marked(launcher.mark) if alive(p))}"
    sizes = {p.name: p.stat().st_size for p in launcher.folder.glob("beat-*")}
    time.sleep(0.5)  # several heartbeats' time: a writer left anywhere would have grown its file
    assert {p.name: p.stat().st_size for p in launcher.folder.glob("beat-*")} == sizes
    assert all(alive(pid) for pid in keep)


WARM = {  # how `paratrain run` starts its workers: new processes, forks of its own template, or of the caller's
    "spawned": {"PARATRAIN_WARM_WORKERS": ""},
    "warm": {"PARATRAIN_WARM_WORKERS": "json"},
    "kept": {},  # helpers.cli_env: forks of this test process's template, which must outlive the run
}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("how", ["group", "alone"])
@pytest.mark.parametrize("warm", list(WARM))
def test_paratrain_run_killed_leaves_no_worker(tmp_path: Path, launcher: list[Launcher], warm: str, how: str) -> None:
    script = tmp_path / "beat.py"
    script.write_text(HEARTBEAT)
    env = cli_env(**WARM[warm])
    launcher.append(Launcher([sys.executable, "-m", "paratrain.cli", "run", "--nproc", "2", str(script),
                              str(tmp_path)], env, tmp_path))
    keep = frozenset(kept_template_pids() if warm == "kept" else ())
    _kill_and_check(launcher[0], how, keep)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("how", ["group", "alone"])
@pytest.mark.parametrize("warm", ["", "json,cloudpickle"], ids=["spawned", "warm"])
def test_launch_killed_leaves_no_worker(tmp_path: Path, launcher: list[Launcher], warm: str, how: str) -> None:
    env = cli_env(PARATRAIN_WARM_WORKERS=warm)
    launcher.append(Launcher([sys.executable, "-c", LAUNCH, str(tmp_path)], env, tmp_path))
    _kill_and_check(launcher[0], how)


RESTARTED = """
import os, sys
import torch.distributed as dist
dist.init_process_group("gloo")
restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
os.write(1, f"worker {dist.get_rank()} restart {restart} agent {os.environ['PARATRAIN_AGENT_PID']}\\n".encode())
dist.barrier()
if restart == 0 and dist.get_rank() == 1:
    os._exit(3)
dist.destroy_process_group()
"""


@pytest.mark.timeout(240)
def test_an_elastic_restart_is_not_the_agent_dying(tmp_path: Path) -> None:
    """Workers started as new processes (warm ones restart in test_resume.py's kill test)."""
    script = tmp_path / "restarted.py"
    script.write_text(RESTARTED)
    res = paratrain("run", "--nproc", "2", "--max-restarts", "1", str(script), timeout=180,
                    env=cli_env(**WARM["spawned"]))
    assert res.returncode == 0, res.stdout[-3000:]
    lines = sorted(line.rsplit(" agent", 1)[0] for line in res.stdout.splitlines() if line.startswith("worker "))
    assert lines == [f"worker {r} restart {g}" for r in (0, 1) for g in (0, 1)], res.stdout[-3000:]


ORPHANED = """
import os, subprocess, sys
child = subprocess.Popen([sys.executable, "-u", sys.argv[1], sys.argv[2]], start_new_session=True,
                         env={**os.environ, "PARATRAIN_AGENT_PID": str(os.getpid())})
print(child.pid, flush=True)
os._exit(0)  # before the child's interpreter is up: it finds itself orphaned, or is killed when it ties itself
"""


@pytest.mark.timeout(60)
def test_a_worker_whose_agent_died_before_it_started_ends(tmp_path: Path) -> None:
    """The race `_lifeline` checks: the agent dies between starting a worker and the worker's tie."""
    script = tmp_path / "forever.py"
    script.write_text("import time\nopen(__file__ + '.ran', 'w').close()\ntime.sleep(600)\n")
    res = subprocess.run([sys.executable, "-c", ORPHANED, _lifeline.ENTRY, str(script)], capture_output=True,
                         text=True, timeout=30, env=cli_env(**WARM["spawned"]))
    worker = int(res.stdout.split()[0])
    try:
        assert _within(WITHIN_S, lambda: not alive(worker)), "the orphaned worker still runs"
    finally:
        if alive(worker):
            os.kill(worker, signal.SIGKILL)
