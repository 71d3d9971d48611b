"""On a real two-node Slurm (slurmctld and two slurmd on loopback, started by tests/cluster/slurm_up.sh):
`srun python` with one task per worker and `srun paratrain run` with no node flag train one job that reaches
the weights of a plain PyTorch loop (helpers.plain_example_toy); the elastic form keeps working; several
launchers per node and a launcher in a multi-node batch script are refused; the sbatch script users copy from
docs/launchers.md runs as it is. A machine that cannot have the cluster skips, with the reason.

A cluster these tests start (and munged, if they started it) is stopped when the test run ends, by
`slurm_up.sh --down` from tests/conftest.py (under pytest-xdist, once every test process has ended);
PARATRAIN_KEEP_SLURM=1 keeps it running for the next run. One that was already up is left as it was."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from helpers import ROOT, cli_env, doc_block, max_diff, plain_example_toy, run_cmd

SLURM_UP = ROOT / "tests" / "cluster" / "slurm_up.sh"
TRAIN = ROOT / "tests" / "cluster" / "train.py"
VENV_BIN = Path(sys.executable).parent
SLURM_STARTED = "PARATRAIN_TEST_SLURM_STARTED"  # a file the suite's end reads (tests/conftest.py)
LIMIT = "3"  # minutes: Slurm itself ends a job step that a broken test would leave running
pytestmark = pytest.mark.timeout(420)  # the first test also installs and starts Slurm on a fresh machine


@pytest.fixture(scope="module")
def slurm_env() -> dict[str, str]:
    """The environment for srun/sbatch against the two-node test cluster, installed and started if need be.
    Exit 2 means this machine cannot have it (not root, no apt mirror, daemons refused for lack of permission):
    a skip with the script's reason, in CI too, since no test ran; any other failure is a failure."""
    try:
        res = subprocess.run(["bash", str(SLURM_UP)], capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired as exc:
        _started(str(exc.stderr or ""))
        pytest.fail(f"{SLURM_UP} did not finish in 300 s: {exc.stderr!r}")
    _started(res.stderr)
    if res.returncode == 2:
        reason = " | ".join(line.strip() for line in res.stderr.splitlines() if line.strip())
        pytest.skip(f"no Slurm cluster can be started here: {reason}")  # one line: pytest -rs shows one
    assert res.returncode == 0, f"{SLURM_UP} failed ({res.returncode}):\n{res.stdout}\n{res.stderr}"
    conf = res.stdout.strip().splitlines()[-1]
    # srun passes the environment on: each `paratrain run` in a job step forks its workers from the template this
    # test process keeps (helpers.kept_template); the agents, their rendezvous and the node flags are Slurm's
    return cli_env(SLURM_CONF=conf, PATH=f"{VENV_BIN}{os.pathsep}{os.environ['PATH']}")


def _started(stderr: str | bytes) -> None:
    """Note the daemons slurm_up.sh says it started, for the suite's end to stop (tests/conftest.py)."""
    text = stderr.decode() if isinstance(stderr, bytes) else stderr
    names = [line.split("started ", 1)[1] for line in text.splitlines() if line.startswith("slurm_up: started ")]
    if names:
        with open(os.environ[SLURM_STARTED], "a") as f:
            f.write("".join(f"{name}\n" for name in names))


@pytest.fixture
def job(slurm_env: dict[str, str]) -> Iterator[str]:
    """A job name for one test; whatever still runs under it afterwards is cancelled."""
    name = f"paratrain-test-{uuid.uuid4().hex[:8]}"
    yield name
    subprocess.run(["scancel", "--name", name], env=slurm_env, capture_output=True, timeout=30)


@pytest.fixture(scope="module")
def plain_weights() -> dict[str, torch.Tensor]:
    """train.py's run (examples/toy.py at its defaults) as a plain PyTorch loop (no paratrain code)."""
    return plain_example_toy()


def _srun(job: str, env: dict[str, str], cwd: Path, *args: str, timeout: float = 120) -> str:
    res = run_cmd(["srun", f"--job-name={job}", f"--time={LIMIT}", *args], env=env, cwd=cwd, timeout=timeout)
    assert res.returncode == 0, res.stdout[-4000:]
    return res.stdout


def _sbatch(job: str, env: dict[str, str], cwd: Path, *args: str, timeout: float = 120) -> tuple[str, str]:
    """Submit a batch job and wait for its end (polling: `sbatch --wait` backs off to tens of seconds);
    returns its final state and the text it wrote."""
    res = run_cmd(["sbatch", "--parsable", f"--job-name={job}", f"--time={LIMIT}", *args], env=env, cwd=cwd)
    assert res.returncode == 0, res.stdout
    job_id = res.stdout.strip().split(";")[0]
    deadline = time.monotonic() + timeout
    state = ""
    while time.monotonic() < deadline:
        shown = run_cmd(["scontrol", "-o", "show", "job", job_id], env=env, cwd=cwd, timeout=30).stdout
        state = shown.split("JobState=")[1].split()[0] if "JobState=" in shown else "GONE"
        if state not in ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING"):
            break
        time.sleep(0.25)
    else:
        raise AssertionError(f"batch job {job_id} still {state} after {timeout}s")
    return state, (cwd / f"slurm-{job_id}.out").read_text()  # where a job's output goes by default


def _places(folder: Path) -> list[dict]:  # type: ignore[type-arg]
    return sorted((json.loads(p.read_text()) for p in (folder / "places").glob("*.json")), key=lambda p: p["rank"])


def _one_job(folder: Path, world: int) -> None:
    """Every rank of one job of `world` workers spread over both nodes ran: not one job per node."""
    places = _places(folder)
    assert [p["rank"] for p in places] == list(range(world)), places
    assert {p["world"] for p in places} == {world}, places
    assert {p["node"] for p in places} == {"n1", "n2"}, places


def test_srun_one_task_per_worker(slurm_env: dict, job: str, tmp_path: Path, plain_weights: dict) -> None:
    # one task per node: two tasks per node, and so local ranks, are the next test's (and test_runtime's)
    _srun(job, slurm_env, tmp_path, "-N2", "-n2", sys.executable, str(TRAIN))
    _one_job(tmp_path, 2)
    assert max_diff(torch.load(tmp_path / "weights.pt"), plain_weights) < 1e-6


def test_paratrain_run_needs_no_node_flags(slurm_env: dict, job: str, tmp_path: Path, plain_weights: dict) -> None:
    out = _srun(job, slurm_env, tmp_path, "-N2", "paratrain", "run", "--nproc", "2", str(TRAIN))
    _one_job(tmp_path, 4)
    assert out.count("epoch 1 loss") == 1, out  # one job prints once; two separate jobs would print twice
    assert "node_rank is only used" not in out and "will be ignored" not in out, out
    assert max_diff(torch.load(tmp_path / "weights.pt"), plain_weights) < 1e-6


def test_dry_run_shows_what_each_node_derived(slurm_env: dict, job: str, tmp_path: Path) -> None:
    out = _srun(job, slurm_env, tmp_path, "-N2", "-l", "paratrain", "run", "--dry-run", "--nproc", "2", str(TRAIN))
    commands = [line.split(": ", 1)[1] for line in out.splitlines() if "torch.distributed.run" in line]
    assert len(commands) == 2, out
    endpoints = {a for c in commands for a in c.split() if a.startswith(("--rdzv-endpoint", "--rdzv-id"))}
    assert len(endpoints) == 2 and any(e.startswith("--rdzv-endpoint=n1:") for e in endpoints), out
    assert sorted("is_host=true" in c for c in commands) == [False, True], out
    assert all("--nnodes=2" in c and "--nproc-per-node=2" in c and "--node-rank" not in c for c in commands), out
    assert not (tmp_path / "places").exists()  # nothing was started


def test_elastic_run_under_srun(slurm_env: dict, job: str, tmp_path: Path, plain_weights: dict) -> None:
    _srun(job, slurm_env, tmp_path, "-N2", "paratrain", "run", "--nnodes", "1:2", "--max-restarts", "1",
          "--nproc", "1", str(TRAIN))
    _one_job(tmp_path, 2)
    assert max_diff(torch.load(tmp_path / "weights.pt"), plain_weights) < 1e-6


def test_launchers_that_would_split_the_job_are_refused(slurm_env: dict, job: str, tmp_path: Path) -> None:
    res = run_cmd(["srun", f"--job-name={job}", f"--time={LIMIT}", "-N2", "-n4", "paratrain", "run", "--nproc", "2",
                   str(TRAIN)], env=slurm_env, cwd=tmp_path, timeout=120)
    assert res.returncode != 0, res.stdout
    assert "srun started 4 copies of paratrain run on 2 node(s)" in res.stdout, res.stdout
    assert "srun --ntasks-per-node=1 paratrain run" in res.stdout
    state, out = _sbatch(job, slurm_env, tmp_path, "-N2", f"--wrap=paratrain run --nproc 1 {TRAIN}")
    assert state == "FAILED", out
    assert "is running in the batch script of Slurm job" in out and "first of its 2 nodes only" in out, out
    assert not (tmp_path / "places").exists()  # no worker started anywhere


def test_sbatch_script_from_the_docs(slurm_env: dict, job: str, tmp_path: Path, plain_weights: dict) -> None:
    script = doc_block("sbatch: tested by tests/test_slurm.py")
    assert "srun paratrain run train.py" in script  # the doc's script, not a look-alike
    (tmp_path / "train.sbatch").write_text(script)
    (tmp_path / "train.py").symlink_to(TRAIN)
    state, out = _sbatch(job, slurm_env, tmp_path, "train.sbatch")
    assert state == "COMPLETED", out
    _one_job(tmp_path, 2)  # two nodes, one CPU worker each by default
    assert out.count("epoch 1 loss") == 1, out
    assert max_diff(torch.load(tmp_path / "weights.pt"), plain_weights) < 1e-6

