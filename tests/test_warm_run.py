"""Warm workers under `paratrain run` (launcher/_warm_run.py): a forked worker is the process the agent would
have spawned — same command line, exit status, signals — and it never outlives its client."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import ROOT, cli_env, kept_template, paratrain

from paratrain.launcher import _lifeline, _warm_run

SCRIPT = """
import os, sys
import torch.distributed as dist
dist.init_process_group("gloo")
total = __import__("torch").ones(1) * (dist.get_rank() + 1)
dist.all_reduce(total)
os.write(1, f"rank {dist.get_rank()} sum {total.item():g} argv {sys.argv[1:]} name {__name__} "
         f"path0 {sys.path[0]} cwd {os.getcwd()} mine {os.environ.get('MINE')}\\n".encode())  # one write a line
rank = dist.get_rank()
dist.destroy_process_group()
if rank == 1 and os.environ.get("HOW") == "exit":
    sys.exit(3)
if rank == 1 and os.environ.get("HOW") == "raise":
    raise ValueError("bad value in the script")
if rank == 1 and os.environ.get("HOW") == "kill":
    os.kill(os.getpid(), 9)
"""


def _run(tmp: Path, how: str = "", kept: bool = False) -> subprocess.CompletedProcess[str]:
    script = tmp / "job" / "job.py"
    script.parent.mkdir(exist_ok=True)
    script.write_text(SCRIPT)
    env = cli_env(PARATRAIN_WARM_WORKERS="torch", HOW=how, MINE="x")
    if kept:  # forked from the test process's template (helpers.kept_template) instead of one of the run's own
        env["PARATRAIN_WARM_TEMPLATE"] = kept_template()
    return paratrain("run", "--nproc", "2", str(script), "a", "--b", timeout=90, env=env)


def _lines(out: str) -> list[str]:
    return sorted(line for line in out.splitlines() if line.startswith("rank "))


@pytest.mark.timeout(240)
def test_a_forked_worker_is_the_process_the_agent_would_have_spawned(tmp_path: Path) -> None:
    warm = _run(tmp_path)  # a spawned worker's lines (test_launcher runs `paratrain run` cold)
    assert warm.returncode == 0, warm.stdout[-2000:]
    assert _lines(warm.stdout) == [f"rank {r} sum 3 argv ['a', '--b'] name __main__ path0 {tmp_path / 'job'} "
                                   f"cwd {ROOT} mine x" for r in (0, 1)], warm.stdout[-2000:]
    assert "no warm worker" not in warm.stdout
    # a failing rank is reported as a spawned one is: sys.exit's status, an exception's traceback from the
    # script's own frames, a signal (forked from a kept template: the same fork, without a template per run)
    for how, said in (("exit", "exited with code 3"), ("raise", 'job.py", line 14, in <module>'),
                      ("kill", "ended by signal SIGKILL")):
        warm = _run(tmp_path, how, kept=True)
        assert warm.returncode == 1 and said in warm.stdout, f"{how}:\n{warm.stdout[-3000:]}"
        assert "_warm_run.py" not in warm.stdout and "runpy" not in warm.stdout


def _gone(pid: int, within: float) -> bool:
    """Ended within `within` seconds: no such process, or a zombie (an orphan that nobody has reaped yet)."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


@contextlib.contextmanager
def _client(tmp: Path, code: str, ready: str = "") -> Iterator[tuple[subprocess.Popen[str], int, _warm_run.WarmRun]]:
    """A template and one client running `ready`, then printing its pid, then `code`; both ended on the way out."""
    script = tmp / "job.py"
    script.write_text(f"import os\n{ready}print(os.getpid(), flush=True)\n{code}")
    warm = _warm_run.WarmRun(("json",))
    env = {**os.environ, _warm_run.SOCKET_VARIABLE: warm.path}
    env.pop(_lifeline.AGENT_VARIABLE, None)  # the client's agent is this process
    client = subprocess.Popen([sys.executable, "-u", _warm_run.CLIENT, str(script)], env=env,
                              stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert client.stdout is not None
        yield client, int(client.stdout.readline()), warm
    finally:
        if client.poll() is None:
            client.kill()
        warm.close()


@pytest.mark.timeout(120)
def test_a_worker_ends_with_its_client_and_the_template_with_the_agent(tmp_path: Path) -> None:
    with _client(tmp_path, "import time\ntime.sleep(600)\n") as (client, worker, warm):
        assert worker != client.pid and not _gone(worker, 0.2)
        client.kill()  # SIGKILL: nothing runs in the client, only its connection closes
        client.wait(10)
        assert _gone(worker, 10), "the worker outlived its client"
    assert warm.proc.poll() is not None, "the template outlived the agent's lifeline"
    assert not os.path.exists(warm.folder)


@pytest.mark.timeout(120)
def test_a_worker_ends_with_the_template_that_forked_it(tmp_path: Path) -> None:
    with _client(tmp_path, "import time\ntime.sleep(600)\n") as (client, worker, warm):
        warm.proc.kill()  # SIGKILL: the template cannot kill its workers itself
        assert _gone(worker, 10), "the worker outlived its template"
        assert client.wait(10) == 1


@pytest.mark.timeout(60)
def test_a_signal_to_the_client_reaches_the_worker(tmp_path: Path) -> None:
    handler = ("import signal, sys, time\n"
               "signal.signal(signal.SIGTERM, lambda *_: (print('saved', flush=True), sys.exit(7)))\n")
    with _client(tmp_path, "time.sleep(600)\n", ready=handler) as (client, _, _):
        os.killpg(client.pid, signal.SIGTERM)  # as torchrun's agent ends a worker
        assert client.wait(60) == 7
        assert client.stdout is not None and client.stdout.read().strip() == "saved"


@pytest.mark.timeout(60)
def test_a_client_without_its_template_starts_the_script_as_a_new_process(tmp_path: Path) -> None:
    script = tmp_path / "hello.py"
    script.write_text("import sys\nprint('hello', sys.argv[1:])\nsys.exit(4)\n")
    env = {**os.environ, _warm_run.SOCKET_VARIABLE: str(tmp_path / "no-such-socket")}
    res = subprocess.run([sys.executable, "-u", _warm_run.CLIENT, str(script), "x"], env=env, text=True,
                         capture_output=True, timeout=30)
    assert res.returncode == 4 and "hello ['x']" in res.stdout
    assert "no warm worker" in res.stderr and "as a new process" in res.stderr


@pytest.mark.timeout(180)
def test_runs_fork_from_a_template_their_caller_keeps_and_leave_it_as_they_found_it(tmp_path: Path) -> None:
    """PARATRAIN_WARM_TEMPLATE: every run's workers are forks of the caller's template (one import for many
    runs), a run does not end it, and what one run's worker changes is not in the next run's."""
    script = tmp_path / "job.py"
    # one write per line: the two workers share one stdout, and print() writes word by word unbuffered
    script.write_text("import json, os\n"
                      "os.write(1, f'parent {os.getppid()} marked {hasattr(json, \"MARK\")}\\n'.encode())\n"
                      "json.MARK = 1\n")
    kept = _warm_run.keep(("json",))
    try:
        env = cli_env(PARATRAIN_WARM_WORKERS="", PARATRAIN_WARM_TEMPLATE=kept.path)
        for nproc in (2, 1):
            res = paratrain("run", "--nproc", str(nproc), str(script), timeout=90, env=env)
            assert res.returncode == 0, res.stdout[-2000:]
            lines = [line for line in res.stdout.splitlines() if line.startswith("parent ")]
            assert lines == [f"parent {kept.proc.pid} marked False"] * nproc, res.stdout[-2000:]
            assert kept.proc.poll() is None, "a run ended its caller's template"
    finally:
        kept.close()
    assert kept.proc.poll() is not None and not os.path.exists(kept.folder)
