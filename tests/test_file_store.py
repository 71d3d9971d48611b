"""File-store initialisation (`init="file:///path"`): two workers meeting through a shared file reach the
weights of a plain PyTorch loop in one process (`setup(init=...)` under `paratrain.launch`), `paratrain run
--init` hands the file to every worker, a finished run leaves no store file behind, and an unwritable path or a
crashed run's file is refused at once, naming the fix, while the same file in use by live workers is joined."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import helpers
import pytest
import torch.distributed as dist
from helpers import EXAMPLES, max_diff, plain_toy, train_toy

import paratrain
from paratrain import ParatrainError, cli, file_store
from paratrain.launcher import cli_run
from paratrain.launcher.checks import LaunchSpec


def _crashed_run_file(path: Path) -> dist.FileStore:
    """The file a worker killed mid-run leaves: torch's own keys and reference count, written just now (so no
    age heuristic would call it stale). The caller keeps the returned store object alive: its destructor,
    which a killed process never runs, would tidy the file up."""
    store = dist.FileStore(str(path), 2)
    store.set("paratrain/from-an-earlier-run", "1")
    assert path.stat().st_size > 0
    return store


def _as_rank(monkeypatch: pytest.MonkeyPatch, rank: int, world: int) -> None:
    for key, value in {"RANK": rank, "WORLD_SIZE": world, "LOCAL_RANK": rank, "LOCAL_WORLD_SIZE": world}.items():
        monkeypatch.setenv(key, str(value))


def _refused(match: str, fn, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
    start = time.monotonic()
    with pytest.raises(ParatrainError, match=match):
        fn(*args, **kwargs)
    # the slow way is the 120 s rendezvous timeout these calls set: a quarter of it cannot be load on the machine
    assert time.monotonic() - start < 30, "a bad store path must fail at once, not after a rendezvous timeout"


def test_bad_store_paths_are_refused_with_the_fix(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _as_rank(monkeypatch, 0, 2)  # as a worker of a two-process job: a good path would wait for its peer
    setup = paratrain.setup

    _refused(r"directory '.*/missing' does not exist; create it", setup, strategy="ddp", timeout_s=120,
             init=f"file://{tmp_path}/missing/store")
    (tmp_path / "a-file").write_text("")
    _refused(r"directory '.*/a-file' does not exist", setup, strategy="ddp", timeout_s=120, init=f"file://{tmp_path}/a-file/store")
    _refused("is a directory; give a file path inside it", setup, strategy="ddp", timeout_s=120, init=f"file://{tmp_path}")
    if os.geteuid() == 0:
        unwritable = Path("/sys")  # permissions do not stop root; sysfs refuses new files to everyone
    else:
        unwritable = tmp_path / "read-only"
        unwritable.mkdir(mode=0o500)
    _refused(rf"cannot write in '{unwritable}' \(Permission denied\); use a path on a writable filesystem",
             setup, strategy="ddp", timeout_s=120, init=f"file://{unwritable}/store")


HOLDER = """
import fcntl, os, sys
fd = os.open(sys.argv[1] + ".lock", os.O_RDWR | os.O_CREAT)
fcntl.lockf(fd, fcntl.LOCK_SH)  # what a live worker of a running job holds
print("holding", flush=True)
sys.stdin.read()
"""


@pytest.mark.procs
def test_a_crashed_runs_file_is_told_from_a_live_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same bytes on disk are joined while a live worker holds the lock, and refused once it is gone."""
    path = tmp_path / "store"
    crashed = _crashed_run_file(path)
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(path)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "holding\n"
        store = file_store.open_store(str(path), 2)  # a peer joining a running job: not stale
        store.set("joined", "1")
        file_store.release(str(path))
        del store
        _refused(r"is in use by another running job \(it holds .*store.lock.\); give each job its own path",
                 paratrain.launch, print, nproc=2, init=f"file://{path}")
        assert not file_store.remove_if_unused(str(path))  # what launch does after its run: not while in use
    finally:
        holder.communicate("", timeout=30)  # the live worker goes away; the kernel drops its lock

    _as_rank(monkeypatch, 0, 2)
    fix = rf"left over from an earlier run \(\d+ bytes, last written .*\) that did not shut down cleanly.*rm {path}"
    _refused(fix, paratrain.setup, strategy="ddp", timeout_s=120, init=f"file://{path}")
    _refused(fix, paratrain.launch, print, nproc=2, init=f"file://{path}")
    assert path.exists(), "a refused file is the user's to inspect and delete"
    assert file_store.remove_if_unused(str(path)) and not path.exists()  # launch tidies up its own failed run
    del crashed


@pytest.mark.procs
def test_launch_with_file_store_matches_a_plain_loop(tmp_path: Path) -> None:
    reference = plain_toy()
    store = tmp_path / "store"
    results = paratrain.launch(train_toy, "ddp", nproc=2, all_ranks=True, timeout=120, init=f"file://{store}")
    assert [r["world"] for r in results] == [2, 2]
    for r in results:
        assert max_diff(r["weights"], reference["weights"]) < 1e-6
        assert r["losses"] == pytest.approx(reference["losses"], abs=1e-6)
    assert not store.exists(), "a finished run leaves no store file to be mistaken for a stale one"


WORKER_SCRIPT = """
import os, sys, torch, paratrain
run = paratrain.setup(strategy="ddp")
total = run.all_reduce(torch.tensor(float(run.rank + 1)), op="sum")
print(f"rank {run.rank} of {run.world_size}: total {total.item():g}, store file present {os.path.exists(sys.argv[1])}")
# no run.close(): the last worker to exit still removes the store file
"""


@pytest.mark.procs
def test_paratrain_run_with_file_init(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Weights are compared in the launch test above; here: `--init` reaches every worker of torchrun's agent,
    which meet through the file (present while they run, gone after, although the script never closes)."""
    store = tmp_path / "store"
    script = tmp_path / "allreduce.py"
    script.write_text(WORKER_SCRIPT)
    res = helpers.paratrain("run", "--nproc", "2", "--init", f"file://{store}", str(script), str(store),
                            timeout=180)
    assert res.returncode == 0, res.stdout[-3000:]
    for rank in (0, 1):
        assert f"rank {rank} of 2: total 3, store file present True" in res.stdout, res.stdout[-3000:]
    assert not store.exists()

    crashed = _crashed_run_file(store)
    start = time.monotonic()
    assert cli.main(["run", "--nproc", "2", "--init", f"file://{store}", str(EXAMPLES / "toy.py")]) == 2
    assert time.monotonic() - start < 30  # refused before any worker starts or waits (the join timeout is 60 s)
    err = capsys.readouterr().err
    assert "paratrain: error: file store" in err and "left over from an earlier run" in err and f"rm {store}" in err
    with pytest.raises(ParatrainError, match="cannot be combined with --max-restarts 1"):
        cli_run.check_init(LaunchSpec(nproc=2, init=f"file://{tmp_path}/other", max_restarts=1))
    del crashed


def test_store_paths() -> None:
    assert file_store.path_of("file:///tmp/x") == "/tmp/x"
    assert file_store.path_of("file://rel/x") == os.path.abspath("rel/x")
    assert file_store.path_of("tcp://h:1") is None
