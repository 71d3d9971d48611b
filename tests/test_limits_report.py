"""benchmarks/limits_report.py: every goal of docs/benchmarks.md section H gets a verdict that follows
from its thresholds, and a goal not met gets its measured reason, read from the same runs."""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
RUNS = ROOT / "benchmarks" / "results" / "limits-2026-11-25"


def _report() -> ModuleType:
    spec = importlib.util.spec_from_file_location("limits_report", ROOT / "benchmarks" / "limits_report.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["limits_report"] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture()
def runs(tmp_path: Path) -> Path:
    shutil.copytree(RUNS, tmp_path / "runs")
    return tmp_path / "runs"


def _run(root: Path) -> dict[str, Any]:
    _report().main(root)
    return json.loads((root / "summary.json").read_text())


def test_recorded_runs_get_verdicts_and_measured_reasons(runs: Path) -> None:
    s = _run(runs)
    pp, ddp, over, four = s["pipelines"], s["ddp"], s["overhead"], s["four_stages"]
    assert pp["met"] is False and pp["speedup"] == pytest.approx(1.3097)  # pp auto M=4, the sweep's best
    assert pp["no_comm_ceiling"] == pytest.approx(1.9417)  # the overhead run's ceiling (the sweep has none)
    assert pp["compute_only_speedup"] > pp["speedup"] and "sends, receives" in pp["reason"]
    assert pp["search"]["met"] is False and pp["search"]["distance_from_best"] == pytest.approx(0.236, abs=1e-3)
    assert ddp["met"] is False and ddp["best"] == "ddp comm_hook=auto"
    # the floor: single / (no-comm step + the all-reduce alone) = 0.3369 / (0.2041 + 0.0414)
    assert ddp["floor_speedup"] == pytest.approx(0.336931 / (0.204105 + 0.0414355), rel=1e-4)
    assert "41 ms" in ddp["reason"] and set(ddp["lossy"]) == {"ddp comm_hook=bf16", "ddp comm_hook=fp16"}
    ratios = {r["config"]: (r["ratio"], r["met"]) for r in over["rows"]}
    assert ratios == {"ddp": (1.0628, False), "pp 1f1b M=2": (1.0384, False), "pp 1f1b M=4": (0.9861, True),
                      "pp 1f1b M=8": (0.9572, True)}
    assert over["met"] is False and over["heartbeat_share_of_a_core"] < 1e-3
    assert four["share_of_ceiling"] == pytest.approx(1.2582 / 1.5865, rel=1e-4)
    text = (runs / "summary.md").read_text()
    assert text.count("**not met**") == 5 and text.count("**met**") == 2


def test_a_goal_reached_is_met_and_needs_no_reason(runs: Path) -> None:
    sched = json.loads((runs / "sched.json").read_text())
    best = next(r for r in sched["runs"] if r["strategy"] == "pp" and r["schedule"] == "auto"
                and r["microbatches"] == 4)
    best["speedup_vs_single"], best["bound"] = 1.85, 1.92
    sched["runs"].append({**best, "strategy": "no-comm", "microbatches": None, "schedule": None,
                          "speedup_vs_single": 1.95})
    (runs / "sched.json").write_text(json.dumps(sched))
    pp = _run(runs)["pipelines"]
    assert pp["met"] is True and pp["reason"] == "met" and pp["share_of_ceiling"] == pytest.approx(1.85 / 1.95)
    best["bound"] = 2.0  # 1.85 is 92.5% of its bound: short of the 95% asked
    (runs / "sched.json").write_text(json.dumps(sched))
    assert _run(runs)["pipelines"]["met"] is False


def test_missing_runs_are_named_not_a_crash(tmp_path: Path, runs: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    s = _run(empty)
    assert s["pipelines"]["met"] is None and "no pp runs" in s["pipelines"]["reason"]
    assert s["ddp"]["met"] is None and s["overhead"]["rows"] == [] and s["overhead"]["met"] is False
    (runs / "allreduce_cost.json").unlink()  # a step that failed: the verdict stays, the reason says why not
    (runs / "overhead.json").unlink()  # the only run here with the no-comm ceiling
    s = _run(runs)
    assert s["ddp"]["met"] is False and "allreduce_cost.json" in s["ddp"]["reason"]
    assert s["pipelines"]["met"] is False and "needs the no-comm run" in s["pipelines"]["reason"]
    assert "1.31x (pp auto M=4), - of -" in (runs / "summary.md").read_text()
