"""The examples run as users run them, and `paratrain doctor` reports this machine."""

from __future__ import annotations

import socket
import sys
from pathlib import Path

from helpers import EXAMPLES, paratrain, run_cmd


def test_image_classification_trains_and_resumes(tmp_path: Path) -> None:
    script = str(EXAMPLES / "image_classification.py")
    first = paratrain("run", "--nproc", "2", script, "--epochs", "1", "--checkpoint-dir", str(tmp_path), timeout=120)
    assert first.returncode == 0, first.stdout[-3000:]
    assert "epoch 0" in first.stdout and "on 200 images" in first.stdout  # each val image counted once
    second = paratrain("run", "--nproc", "2", script, "--epochs", "2", "--checkpoint-dir", str(tmp_path), timeout=120)
    assert second.returncode == 0, second.stdout[-3000:]
    assert "resumed from" in second.stdout and "epoch 0" not in second.stdout
    accuracy = float(second.stdout.split("val accuracy ")[1].split()[0])
    assert accuracy > 0.3  # ten classes: chance is 0.1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-000000000", "step-000000001"]


def test_toy_example_runs_in_one_process() -> None:
    res = run_cmd([sys.executable, str(EXAMPLES / "toy.py"), "--strategy", "single", "--grad-accum", "2"], timeout=60)
    assert res.returncode == 0 and "epoch 1 loss" in res.stdout, res.stdout


def test_doctor_reports_and_flags_a_busy_port() -> None:
    ok = paratrain("doctor", "--master-port", "0", timeout=60)
    assert ok.returncode == 0, ok.stdout
    assert "torch" in ok.stdout and "gloo" in ok.stdout
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        busy = paratrain("doctor", "--master-port", str(port), timeout=60)
    assert busy.returncode == 1
    assert f"PROBLEM port {port}" in busy.stdout and "--master-port" in busy.stdout
