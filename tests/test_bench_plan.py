"""`paratrain bench --plan`: the planner's best layouts become bench jobs exactly as it chose them (degrees,
micro-batches, schedule, stages per worker), predictions are paired with the runs that measured them, bad
combinations are refused with the fix, and the CLI measures single plus the top K end to end. No timing is
asserted: which layout wins here is the benchmark's finding (docs/benchmarks.md), not a test's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import TWO_CORES, bench_here

from paratrain.bench import jobs, planned, schema
from paratrain.bench_plan import _bench_runs, _choice
from paratrain.cli import main as cli_main
from paratrain.planner.layout import Layout
from paratrain.planner.predict import Prediction


def _settings() -> jobs.Settings:
    return jobs.Settings(workload="toy", batch=24, steps=1, warmup=0, repeat=1)


def _plan(*chosen: Prediction) -> planned.Plan:
    """The planner's predictions as `bench --plan` receives them (paratrain/bench_plan.py)."""
    return planned.Plan(chosen=[_choice(p) for p in chosen],
                        single=_choice(Prediction(Layout(strategy="single"), step_s=0.03)),
                        candidates=len(chosen) + 3, cluster="two-cores")


def test_the_planners_layouts_run_as_it_chose_them() -> None:
    interleaved = Prediction(Layout(strategy="pp", pp=2, schedule="interleaved-1f1b", stages_per_worker=3,
                                    microbatches=4), step_s=0.01)
    ddp = Prediction(Layout(strategy="ddp", dp=2), step_s=0.02)
    accumulating = Prediction(Layout(strategy="fsdp", dp=2, grad_accum=2), step_s=0.025)
    got = planned.jobs(_plan(interleaved, ddp, accumulating), _settings(), references=True)
    specs = [(s.strategy, s.workers, s.microbatches, s.schedule, dict(s.options)) for job in got.jobs
             for s in job.specs]
    assert specs == [("single", 1, None, None, {}), ("pp", 2, 4, "interleaved-1f1b", {"stages_per_worker": 3}),
                     ("ddp", 2, None, None, {}), ("torch-ddp", 2, None, None, {}), ("no-comm", 2, None, None, {})]
    reasons = {spec.strategy: reason for spec, _, reason in got.skipped}
    assert "accumulation" in reasons["fsdp"] and "interleaved-1f1b" in reasons["torch-pipelining"]


def test_only_layouts_the_bench_runs_at_their_planned_degrees_are_handed_to_it() -> None:
    said: list[str] = []
    runs = lambda layout: _bench_runs(layout, said.append)  # noqa: E731
    assert runs(Layout(strategy="tp", tp=2)) and runs(Layout(strategy="fsdp+tp", dp=2, tp=2))
    assert runs(Layout(strategy="ddp+pp", dp=2, pp=2, schedule="1f1b", microbatches=4))
    assert runs(Layout(strategy="pp", pp=4, schedule="1f1b", microbatches=4)) and runs(Layout(strategy="single"))
    assert not said
    # the bench gives ddp+pp on 8 workers 2 stages and tp+pp on 8 workers tp 4 x pp 2: other degrees are not timed
    assert not runs(Layout(strategy="ddp+pp", dp=2, pp=4, schedule="1f1b", microbatches=4))
    assert runs(Layout(strategy="tp+pp", tp=4, pp=2, schedule="1f1b", microbatches=4))
    assert not runs(Layout(strategy="tp+pp", tp=2, pp=4, schedule="1f1b", microbatches=4))
    assert len(said) == 2 and "see it in paratrain plan" in said[0] and "pp 2 x dp_replicate 4" in said[0]


def test_predictions_are_paired_with_the_runs_that_measured_them() -> None:
    fast = Prediction(Layout(strategy="pp", pp=2, schedule="1f1b", microbatches=4), step_s=0.010)
    slow = Prediction(Layout(strategy="ddp", dp=2), step_s=0.020)
    never = Prediction(Layout(strategy="fsdp", dp=2), step_s=0.024)

    def run(strategy: str, workers: int, median: float, **kw: object) -> schema.RunRecord:
        return schema.RunRecord(strategy=strategy, workers=workers, median_step_s=median, status="ok", bound=1.0,
                                **kw)  # type: ignore[arg-type]

    runs = [run("single", 1, 0.030), run("pp", 2, 0.016, microbatches=4, schedule="1f1b"),
            run("torch-pipelining", 2, 0.001, microbatches=4, schedule="1f1b"), run("ddp", 2, 0.015),
            run("ddp", 2, 0.001, options={"comm_hook": "bf16"}),  # not the layout the planner predicted
            schema.RunRecord(strategy="fsdp", workers=2, status="failed", reason="x", bound=1.0)]
    got = planned.compare(_plan(fast, slow, never), runs)
    rows = {r["layout"]: r for r in got["layouts"]}
    assert list(rows) == ["single", "pp 2 (1f1b, M=4)", "ddp 2", "fsdp 2"]
    assert rows["ddp 2"]["measured_step_s"] == 0.015 and rows["ddp 2"]["step_error"] == pytest.approx(0.02 / 0.015 - 1)
    assert rows["fsdp 2"]["status"] == "not measured" and rows["fsdp 2"]["step_error"] is None
    assert got["predicted_fastest"] == "pp 2 (1f1b, M=4)" and got["measured_fastest"] == "ddp 2"
    assert got["pick_vs_fastest"] == pytest.approx(0.016 / 0.015)
    assert "the planner's pick: pp 2 (1f1b, M=4) (1.067x its step time)" in planned.table(got)


def test_bad_plan_flags_fail_fast_naming_the_fix(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spec = tmp_path / "two.json"
    spec.write_text(json.dumps(TWO_CORES))
    assert cli_main(["bench", "--plan", "--strategies", "ddp,dp"]) == 2  # any name of the grammar is planned
    assert "planner predicts" in capsys.readouterr().err
    assert cli_main(["bench", "--plan", "--microbatches", "2"]) == 2
    assert "drop --microbatches" in capsys.readouterr().err
    assert cli_main(["bench", "--plan", "--cluster", str(spec), "--workers", "4", "--workload", "toy",
                     "--out", str(tmp_path / "out")]) == 2
    assert "--workers 2" in capsys.readouterr().err
    assert cli_main(["bench", "--plan", "--top", "0", "--cluster", str(spec), "--workload", "toy",
                     "--out", str(tmp_path / "out")]) == 2
    assert "--top must be >= 1" in capsys.readouterr().err
    assert cli_main(["bench", "--plan", "--cluster", "h100-nvlink", "--workload", "toy",
                     "--out", str(tmp_path / "out")]) == 2
    assert "describes cuda devices but the bench runs on CPU workers" in capsys.readouterr().err


@pytest.mark.procs
def test_bench_plan_measures_single_and_the_top_layouts_end_to_end(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    spec, out = tmp_path / "two.json", tmp_path / "bench"
    spec.write_text(json.dumps(TWO_CORES))
    code, stdout = bench_here(capsys, "--plan", "--top", "2", "--cluster", str(spec), "--workload", "toy", "--workers",
                              "2", "--batch-size", "16", "--steps", "1", "--repeat", "1", "--warmup", "0",
                              "--no-reference", "--out", str(out))
    assert code == 0, stdout[-4000:]
    results = json.loads((out / "results.json").read_text())
    schema.validate(results)
    plan = results["plan"]
    assert plan["top"] == 2 and plan["fitting_layouts"] > 2 and plan["cluster"] == "two-cores"
    rows = plan["layouts"]
    assert rows[0]["layout"] == "single" and len(rows) == 3
    for row in rows:
        assert row["status"] == "ok" and row["measured_step_s"] > 0 and row["predicted_step_s"] > 0, row
    measured = {(r["strategy"], r["workers"], r["microbatches"], r["schedule"]) for r in results["runs"]}
    for row in rows[1:]:  # each chosen layout ran as chosen, and nothing else did
        pipelined = row["strategy"] in ("pp", "ddp+pp")
        assert (row["strategy"], row["devices"], row["microbatches"] if pipelined else None,
                row["schedule"]) in measured
    assert len(measured) == 3
    assert plan["predicted_fastest"] == min(rows, key=lambda r: r["predicted_step_s"])["layout"]
    assert plan["measured_fastest"] == min(rows, key=lambda r: r["measured_step_s"])["layout"]
    assert "predicted beside measured" in stdout and "the planner's pick" in stdout
