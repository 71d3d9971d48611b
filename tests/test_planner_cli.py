"""`paratrain plan` end to end through the CLI entry point: an analytic GPT planned on a preset cluster
(plan.json, the plot, the exact setup call), and `--validate` on this machine with the toy workload (the
machine is measured by two gloo workers, a ddp layout runs in fresh workers, validation.json is
written). Timings are not asserted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from paratrain.cli import main as cli_main

PNG = b"\x89PNG\r\n\x1a\n"


def test_plan_an_analytic_gpt_on_a_preset_cluster(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "plan"
    code = cli_main(["plan", "--workload", "gpt-1.7b", "--global-batch", "64", "--precision", "bf16",
                     "--cluster", "h100-nvlink", "--top", "3", "--out", str(out)])
    text = capsys.readouterr().out
    assert code == 0, text[-3000:]
    assert "more that fit" in text and "run = paratrain.setup(strategy=" in text
    doc = json.loads((out / "plan.json").read_text())
    assert doc["schema"] == "paratrain-plan/1" and doc["global_batch"] == 64 and doc["cluster"]["name"] == "h100-nvlink"
    best = doc["best"]
    assert best["fits"] and best["setup"]["strategy"] == best["layout"]["strategy"]
    assert best["step_s"] > 0 and best["memory"]["total"] < 80 * 2**30
    assert best["step_s"] == min(p["step_s"] for p in doc["layouts"] if p["fits"])
    assert set(doc["scaling"]) == {"1", "2", "4", "8"}
    assert (out / "plan_scaling.png").read_bytes()[:8] == PNG


@pytest.mark.procs
@pytest.mark.timeout(240)
def test_validate_runs_layouts_here_and_writes_validation_json(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "val"
    code = cli_main(["plan", "--workload", "toy", "--global-batch", "8", "--cluster", "local", "--validate",
                     "--layouts", "ddp 2", "--steps", "5", "--warmup", "1", "--repeat", "1", "--timeout", "120",
                     "--out", str(out)])
    text = capsys.readouterr().out
    assert code == 0, text[-3000:]
    assert "predicted vs measured" in text and "median |error|" in text
    records = json.loads((out / "validation.json").read_text())
    assert [r["layout"] for r in records] == ["ddp 2"]
    for r in records:
        assert r["status"] == "ok", r
        for key in ("predicted_step_s", "measured_step_s", "predicted_peak_bytes", "measured_peak_bytes"):
            assert isinstance(r[key], float) and r[key] > 0, (key, r)
        assert r["step_error"] == r["predicted_step_s"] / r["measured_step_s"] - 1
        # against the round's single, timed in another launch: an interval from both samples
        low, high = r["measured_vs_single_ci"]
        assert len(r["measured_step_times_s"]) == 5 and 0 < low <= high, r
        assert r["relative_step_error_ci"][0] <= r["relative_step_error_ci"][1]
    assert "meas. / round single (95% CI)" in text
    local = json.loads((out / "cluster-local.json").read_text())
    assert local["measured_here"] and local["kind"] == "cpu" and set(local["collectives"]) == {
        "all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p"}
    # DTensor's and FSDP2's own costs were measured. DTensor's is a difference of three timings clamped at zero, which
    # the other test process's load can take to zero (seen once in CI): measured, not asserted positive. FSDP's is
    # milliseconds a unit, ten times the noise; a line through two noisy points, so it is read where it was measured
    # (a 512-feature unit), not at 0 bytes
    unit = local["fsdp_unit_overhead"]
    assert isinstance(local["tp_overhead_us"], float) and local["tp_overhead_us"] >= 0
    assert unit["alpha_us"] * 1e-6 + unit["beta_s_per_gb"] * 4 * 512 * 513 / 1e9 > 0


def test_validation_says_whether_the_pick_missed_the_fastest_by_more_than_the_noise() -> None:
    from paratrain.planner import validate

    def record(layout: str, predicted: float, times: list[float]) -> dict[str, object]:
        return {"layout": layout, "status": "ok", "predicted_step_s": predicted, "measured_step_s": sorted(times)[2],
                "predicted_peak_bytes": 1.0, "measured_peak_bytes": 1.0, "step_error": 0.0, "memory_error": 0.0,
                "measured_step_times_s": times}

    fastest = [1.0, 1.02, 0.98, 1.01, 0.99]
    noisy = validate.summary([record("a", 1.0, [1.03, 0.8, 1.25, 0.95, 1.1]), record("b", 2.0, fastest)])
    low, high = noisy["predicted_fastest_vs_measured_fastest_ci"]
    assert noisy["measured_fastest"] == "b" and low < 0 < high  # the pick's 3% is within its noise
    clear = validate.summary([record("a", 1.0, [t * 1.2 for t in fastest]), record("b", 2.0, fastest)])
    assert clear["predicted_fastest_vs_measured_fastest_ci"][0] > 0.1
    text = validate.table([record("a", 1.0, [t * 1.2 for t in fastest]), record("b", 2.0, fastest)], "now")
    assert "beyond the noise" in text and "95% CI +" in text


def test_validate_refuses_other_hardware_and_analytic_models(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["plan", "--workload", "toy", "--cluster", "h100-nvlink", "--validate"]) == 2
    assert "use --cluster local" in capsys.readouterr().err
    assert cli_main(["plan", "--workload", "gpt-5b", "--cluster", "h100-ib"]) == 2
    assert "give --global-batch" in capsys.readouterr().err
    assert cli_main(["plan", "--workload", "gpt-5b", "--global-batch", "8", "--cluster", "h100-ib", "--validate"]) == 2
    assert "is analytic" in capsys.readouterr().err
    assert cli_main(["plan", "--workload", "gpt-5b", "--global-batch", "8", "--cluster", "h100-ib",
                     "--strategies", "ddp,pipe"]) == 2
    assert "Did you mean 'pp'" in capsys.readouterr().err
