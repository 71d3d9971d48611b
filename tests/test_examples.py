"""The examples run as users run them, and `paratrain doctor` reports this machine."""

from __future__ import annotations

import json
import socket
import sys
from pathlib import Path

import pytest
from helpers import EXAMPLES, paratrain, run_cmd


def test_image_classification_trains_resumes_and_logs(tmp_path: Path) -> None:
    script = str(EXAMPLES / "image_classification.py")
    first = paratrain("run", "--nproc", "2", script, "--epochs", "1", "--checkpoint-dir", str(tmp_path), "--progress",
                      timeout=120)
    assert first.returncode == 0, first.stdout[-3000:]
    assert "epoch 0" in first.stdout and "on 200 images" in first.stdout  # each val image counted once
    assert "16/16" in first.stdout and "loss=" in first.stdout and "samples/s=" in first.stdout  # rank 0's bar
    second = paratrain("run", "--nproc", "2", script, "--epochs", "2", "--checkpoint-dir", str(tmp_path), "--progress",
                       timeout=120)
    assert second.returncode == 0, second.stdout[-3000:]
    assert "resumed from" in second.stdout and "epoch 0" not in second.stdout
    accuracy = float(second.stdout.split("val accuracy ")[1].split()[0])
    assert accuracy > 0.3  # ten classes: chance is 0.1
    assert "32/32" in second.stdout and "val/accuracy=" in second.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "logs", "step-000000016", "step-000000032"]
    # the logs of both runs read as one: 16 steps of 512 images / 32 per epoch, a validation line per epoch
    lines = [json.loads(line) for line in (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in lines if "loss" in r]
    assert [r["step"] for r in train] == list(range(1, 33)) and all(r["loss"] > 0 for r in train)
    assert all(r["samples_per_s"] > 0 and r["step_time_s"] > 0 for r in train)
    validation = [(r["step"], r["val/accuracy"]) for r in lines if "val/accuracy" in r]
    assert [s for s, _ in validation] == [16, 32] and validation[1][1] == pytest.approx(accuracy, abs=5e-4)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "logs"))
    events.Reload()
    loss = events.Scalars("loss")  # float32 in the event file
    assert [e.step for e in loss] == list(range(1, 33))
    assert [e.value for e in loss] == pytest.approx([r["loss"] for r in train], rel=1e-6)
    assert [e.step for e in events.Scalars("val/accuracy")] == [16, 32]


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
