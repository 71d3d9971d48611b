"""`paratrain run`, torchrun and plain python run the same example to the weights of a plain PyTorch loop
(helpers.plain_example_toy); bad launch input fails in seconds with the fix named."""

from __future__ import annotations

import re
import socket
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import EXAMPLES, ROOT, cli_env, max_diff, paratrain, plain_example_toy, run_cmd

from paratrain.runtime import free_port

TOY = str(EXAMPLES / "toy.py")
VENV_BIN = Path(sys.executable).parent


@pytest.fixture(scope="module")
def plain_weights() -> dict[str, torch.Tensor]:
    """The example's run as a plain PyTorch loop (no paratrain code)."""
    return plain_example_toy()


def test_same_script_under_python_paratrain_run_and_torchrun(tmp_path: Path, plain_weights: dict) -> None:
    run = [sys.executable, "-m", "paratrain.cli", "run", "--nproc", "2", TOY]
    commands = {  # paratrain run with workers started as new processes (the default); the warm form, which the
        # other launcher tests use (helpers.cli_env), is held to a spawned worker in test_warm_run.py
        "python": ([sys.executable, TOY], cli_env()),
        "paratrain-run": (run, cli_env(PARATRAIN_WARM_WORKERS="")),
        "torchrun": ([str(VENV_BIN / "torchrun"), "--standalone", "--nproc-per-node", "2", TOY], cli_env()),
    }
    for name, (cmd, env) in commands.items():
        out = tmp_path / f"{name}.pt"
        res = run_cmd([*cmd, "--save-weights", str(out)], timeout=90, env=env)
        assert res.returncode == 0, f"{name}:\n{res.stdout[-3000:]}"
        assert "epoch 1 loss" in res.stdout
        assert max_diff(torch.load(out), plain_weights) < 2e-6, name


def test_two_nodes_on_loopback(tmp_path: Path, plain_weights: dict) -> None:
    port = free_port()
    out = tmp_path / "w.pt"
    common = ["--nnodes", "2", "--nproc", "1", "--master-addr", "127.0.0.1", "--master-port", str(port),
              "--run-id", f"t{port}", "--connect-timeout", "60"]
    import subprocess

    procs = [
        subprocess.Popen([sys.executable, "-m", "paratrain.cli", "run", *common, "--node-rank", str(rank), TOY,
                          "--save-weights", str(out)], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True, start_new_session=True, env=cli_env())
        for rank in (0, 1)
    ]
    try:
        outputs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                import os
                import signal

                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    assert all(p.returncode == 0 for p in procs), "\n".join(o[-2000:] for o in outputs)
    assert max_diff(torch.load(out), plain_weights) < 2e-6


def _fast_error(args: list[str], match: str, within: float = 45) -> str:
    """The command fails with `match` without first waiting out a timeout. No duration is asserted: the slow
    way to each of these errors is a wait of at least 60 s (the default --connect-timeout and rendezvous join
    timeout) or a hang in a collective (600 s), so ending within `within` seconds, several times what the
    command takes on a loaded machine, is the proof; `paratrain` fails the test past it."""
    res = paratrain(*args, timeout=within)
    assert res.returncode != 0, res.stdout
    assert match in res.stdout, res.stdout[-3000:]
    return res.stdout


def test_busy_port_is_reported() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        _fast_error(["run", "--nproc", "2", "--master-port", str(port), TOY], f"--master-port {port} is already in use")


def test_unreachable_master_is_bounded() -> None:
    port = free_port()
    args = ["run", "--nnodes", "2", "--node-rank", "1", "--master-port", str(port), "--connect-timeout", "2", TOY]
    _fast_error(args, f"cannot reach the master at 127.0.0.1:{port} within 2s")


def test_bad_flags_fail_fast() -> None:
    _fast_error(["run", "--nnodes", "2", "--node-rank", "2", "--master-port", "29999", TOY],
                "out of range for --nnodes 2")
    _fast_error(["run", "--backend", "nccl", TOY], "--backend nccl needs CUDA GPUs")
    _fast_error(["run", "missing_script.py"], "script 'missing_script.py' not found")


def test_errors_inside_workers_name_the_fix() -> None:
    # a global batch smaller than the world size, and dp on a CPU-only machine
    out = _fast_error(["run", "--nproc", "3", TOY, "--global-batch", "2"], "global batch 2 cannot be split evenly",
                      within=120)
    # raised by every rank, told once (it used to be once per rank: 75 lines for 3 workers); ranks the agent
    # stopped before they raised it are listed as stopped
    assert out.count("global batch 2 cannot be split evenly") == 1, out
    assert re.search(r"worker ranks? [0-2](, [0-2])* of 3 failed", out), out
    assert len(out.splitlines()) < 25, out
    _fast_error(["run", "--nproc", "1", TOY, "--strategy", "dp"],
                "strategy 'dp' (torch.nn.DataParallel) needs CUDA GPUs", within=120)


def test_dry_run_prints_the_invocation_and_starts_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    from paratrain.cli import main

    port = free_port()
    start = time.monotonic()
    # node 1 of 2 whose master is not up: a real run would wait for it, a dry run only prints
    assert main(["run", "--dry-run", "--nnodes", "2", "--node-rank", "1", "--master-port", str(port), TOY, "--x"]) == 0
    assert time.monotonic() - start < 30  # a real run would wait the 60 s --connect-timeout for the master
    out = capsys.readouterr().out
    command = out.splitlines()[1].split()
    assert command[0] == "env" and "PARATRAIN_CONNECT_TIMEOUT=60.0" in command and "OMP_NUM_THREADS=1" in command
    agent = command[command.index("torch.distributed.run") + 1 :]
    assert agent == ["--nproc-per-node=1", "--nnodes=2", "--max-restarts=0", "--rdzv-backend=c10d",
                     f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=paratrain",
                     "--rdzv-conf=is_host=false,join_timeout=60", TOY, "--x"]
