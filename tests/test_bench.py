"""`paratrain bench`: the plan (what runs, what is reported not applicable and why), the results.json
contract, the plots, and two end-to-end runs of the CLI on the toy workload (one that measures single,
ddp and pp with their hand-written references, one whose model fails). No timing is asserted."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from helpers import paratrain

from paratrain import strategies
from paratrain.bench import jobs, plots, report, schema, workloads
from paratrain.cli import main as cli_main

PNG = b"\x89PNG\r\n\x1a\n"


def _settings(batch: int = 24, gpus: int = 0) -> jobs.Settings:
    return jobs.Settings(workload="toy", batch=batch, steps=2, warmup=1, repeat=2, gpus=gpus)


def _plan(names: str, workers: list[int], micro: str = "auto", batch: int = 24, gpus: int = 0) -> jobs.JobList:
    return jobs.build(jobs.parse_strategies(names), workers, jobs.parse_microbatches(micro), _settings(batch, gpus))


def _skipped(p: jobs.JobList) -> dict[tuple[str, int, int | None], tuple[str, str]]:
    return {(s.strategy, s.workers, s.microbatches): (status, reason) for s, status, reason in p.skipped}


def _png(path: Path) -> None:
    data = path.read_bytes()
    assert data[:8] == PNG, f"{path} is not a PNG"
    assert len(data) > 5000, f"{path} is only {len(data)} bytes"


# -- tier 1: the plan and the contract, no processes --------------------------------------------------


def test_plan_pairs_each_strategy_with_its_reference_and_explains_what_cannot_run() -> None:
    p = _plan("single,dp,ddp,mp,pp,ddp+pp", [2], micro="2,5")
    jobs = {job.title.split(",")[0]: [(s.strategy, s.microbatches, s.schedule) for s in job.specs] for job in p.jobs}
    assert jobs["single"] == [("single", None, None)]
    assert jobs["ddp vs torch-ddp"] == [("ddp", None, None), ("torch-ddp", None, None), ("no-comm", None, None)]
    assert jobs["pp vs torch-pipelining"] == [("pp", 2, "1f1b"), ("torch-pipelining", 2, "1f1b")]
    assert jobs["mp vs torch-pipeline"] == [("mp", 2, None), ("torch-pipeline", 2, None)]
    assert [job.nproc for job in p.jobs] == [1, 2, 1, 2]  # single, ddp, mp, pp: one process for mp
    skipped = _skipped(p)
    status, reason = skipped[("dp", 1, None)]
    assert status == "not-applicable" and "needs CUDA GPUs" in reason
    status, reason = skipped[("ddp+pp", 2, None)]
    assert status == "not-applicable" and ">= 4" in reason and "got 2" in reason
    status, reason = skipped[("pp", 2, 5)]
    assert status == "not-applicable" and "24 % 5 = 4" in reason


def test_plan_details_batch_splits_schedules_and_missing_strategies() -> None:
    p = _plan("ddp,pp", [1, 3], micro="auto", batch=8)
    skipped = _skipped(p)
    assert "8 % 3 = 2" in skipped[("ddp", 3, None)][1] and "--batch-size 6" in skipped[("ddp", 3, None)][1]
    assert "at least 2 workers" in skipped[("pp", 1, None)][1]
    pp3 = next(job for job in p.jobs if job.title.startswith("pp"))
    # auto: powers of two dividing the batch; 1F1B below 3 stages runs as GPipe on both sides
    assert [(s.strategy, s.microbatches, s.schedule) for s in pp3.specs][:4] == [
        ("pp", 1, "gpipe"), ("torch-pipelining", 1, "gpipe"), ("pp", 2, "gpipe"), ("torch-pipelining", 2, "gpipe")]
    assert {s.microbatches for s in pp3.specs} == {1, 2, 4, 8}
    gpu = _plan("dp,ddp,pp", [2], micro="2", gpus=1)
    assert "one worker per GPU" in _skipped(gpu)[("ddp", 2, None)][1]
    assert [job.specs[0] for job in gpu.jobs] == [jobs.Spec("single", 1), jobs.Spec("dp", 1)]  # single: baseline


def test_bad_flags_fail_fast_naming_the_fix(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["bench", "--strategies", "single,ppp"]) == 2
    assert "Did you mean 'pp'" in capsys.readouterr().err
    assert cli_main(["bench", "--workers", "two"]) == 2
    assert "whole numbers" in capsys.readouterr().err
    assert cli_main(["bench", "--workload", "toy", "--steps", "0"]) == 2
    assert "--steps must be >= 1" in capsys.readouterr().err
    assert cli_main(["bench", "--model", "no_such_module_here:make"]) == 2
    assert "cannot load" in capsys.readouterr().err


def _fake_results() -> dict[str, Any]:
    def run(strategy: str, workers: int, times: list[float], micro: int | None = None) -> schema.RunRecord:
        spec = jobs.Spec(strategy, workers, micro, "1f1b" if strategy in ("pp", "torch-pipelining") else None)
        twin = {ref: name for name, ref in jobs.REFERENCE.items()}.get(strategy, strategy)
        options = {"microbatches": micro} if micro else {}
        bound = (workers if twin == jobs.CEILING else  # the strategy states its own bound
                 strategies.get(twin).bound(jobs.context(twin, workers, _settings(), **options)))
        return schema.record(spec, "ok", None, bound, times, 100.0)

    runs = [run("single", 1, [1.0, 1.1, 0.9]), run("ddp", 2, [0.55, 0.5, 0.6]), run("torch-ddp", 2, [0.5, 0.5, 0.5]),
            run("no-comm", 2, [0.5, 0.5, 0.5]), run("ddp", 4, [0.3, 0.3, 0.3]), run("torch-ddp", 4, [0.3, 0.3, 0.3])]
    runs += [run(s, 2, [t, t], m) for m, t in ((1, 1.0), (2, 0.8), (4, 0.7)) for s in ("pp", "torch-pipelining")]
    runs.append(schema.record(jobs.Spec("dp", 1), "not-applicable", "needs GPUs", 1.0))
    return {"schema": schema.SCHEMA, "created": schema.now(), "command": "paratrain bench", "paratrain": {},
            "machine": schema.machine(), "workload": {"name": "toy"}, "global_batch": 8, "settings": {},
            "runs": schema.finalise(runs, 8)}


def test_finalise_derives_medians_speedups_bounds_and_reference_ratios() -> None:
    typed = _fake_results()
    results = schema.as_json(typed)
    schema.validate(results)
    runs = {(r["strategy"], r["workers"], r["microbatches"]): r for r in results["runs"]}
    ddp = runs[("ddp", 2, None)]
    assert ddp["median_step_s"] == 0.55 and ddp["samples_per_s"] == pytest.approx(8 / 0.55, rel=1e-3)
    assert ddp["speedup_vs_single"] == pytest.approx(1.0 / 0.55, rel=1e-3)
    assert ddp["scaling_efficiency"] == pytest.approx(1.0 / 0.55 / 2, rel=1e-3)
    assert ddp["vs_reference"] == pytest.approx(1.1) and ddp["reference"] == "torch-ddp"
    assert runs[("pp", 2, 4)]["bound"] == pytest.approx(2 * 4 / 5)  # K*M/(M+K-1)
    assert runs[("dp", 1, None)]["median_step_s"] is None and runs[("dp", 1, None)]["reason"] == "needs GPUs"
    lines = report.comparisons(typed["runs"])
    assert any("ddp on 2 worker(s): 1.100 x torch-ddp" in line for line in lines)
    assert "not-applicable" in report.table(typed["runs"]) and "| dp |" in report.markdown(typed["runs"])


def test_schema_names_every_broken_field() -> None:
    bad = json.loads(json.dumps(schema.as_json(_fake_results())))
    bad["runs"][0]["status"] = "done"
    bad["runs"][1]["reason"] = "oops"
    bad["runs"][1]["status"] = "ok"
    del bad["runs"][2]["step_times_s"]
    bad["runs"][-1]["reason"] = None
    del bad["machine"]["gpus"]
    with pytest.raises(ValueError) as err:
        schema.validate(bad)
    text = str(err.value)
    for expected in ("runs[0]: status 'done'", "runs[1]: an ok run has a reason", "runs[2]: missing key 'step_times_s'",
                     "a not-applicable run needs a reason", "machine has no 'gpus'"):
        assert expected in text


def test_plots_bar_chart_microbatch_curve_and_scaling(tmp_path: Path) -> None:
    written = plots.write_all(_fake_results(), tmp_path)
    assert sorted(p.name for p in written) == ["microbatch_tradeoff.png", "scaling.png", "strategy_times.png"]
    for path in written:
        _png(path)


def test_user_factory_workload(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "my_models.py").write_text(textwrap.dedent("""
        import torch
        from torch import nn

        def make(batch_size):
            model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
            return model, torch.randn(batch_size, 6), torch.randn(batch_size, 3), nn.L1Loss()

        def wrong(batch_size):
            return nn.Linear(2, 2)
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    w = workloads.get("my_models:make")
    x, y = w.data(10)
    assert x.shape == (10, 6) and y.shape == (10, 3) and isinstance(w.loss(), __import__("torch").nn.L1Loss)
    first, second = w.model(), w.model()
    assert all((a == b).all() for a, b in zip(first.parameters(), second.parameters()))  # same weights each build
    with pytest.raises(Exception, match="must return"):
        workloads.get("my_models:wrong")
    sys.modules.pop("my_models", None)


# -- tier 4: the CLI end to end on real workers --------------------------------------------------------


def test_bench_end_to_end_on_cpu_workers(tmp_path: Path) -> None:
    """single, dp, ddp and pp (2 micro-batches) on 2 CPU workers: every requested strategy is measured or
    reported not applicable with its reason; the references run beside ddp and pp; plots are written."""
    out = tmp_path / "bench"
    proc = paratrain("bench", "--workload", "toy", "--strategies", "single,dp,ddp,pp", "--workers", "2",
                     "--microbatches", "2", "--batch-size", "20", "--steps", "2", "--repeat", "2", "--warmup", "1",
                     "--out", str(out), timeout=180)
    assert proc.returncode == 0, proc.stdout[-4000:]
    results = json.loads((out / "results.json").read_text())
    schema.validate(results)
    assert results["global_batch"] == 20 and results["workload"]["name"] == "toy"
    runs = {(r["strategy"], r["workers"], r["microbatches"]): r for r in results["runs"]}
    assert set(runs) == {("single", 1, None), ("dp", 1, None), ("ddp", 2, None), ("torch-ddp", 2, None),
                         ("no-comm", 2, None), ("pp", 2, 2), ("torch-pipelining", 2, 2)}
    assert runs[("dp", 1, None)]["status"] == "not-applicable" and "GPU" in runs[("dp", 1, None)]["reason"]
    for key, run in runs.items():
        if key[0] != "dp":
            assert run["status"] == "ok", run
            assert len(run["step_times_s"]) == 2 * 2 and run["peak_memory_mb"] > 0
    assert runs[("ddp", 2, None)]["vs_reference"] > 0 and runs[("pp", 2, 2)]["vs_reference"] > 0
    assert runs[("pp", 2, 2)]["schedule"] == "1f1b" and runs[("single", 1, None)]["speedup_vs_single"] == 1.0
    assert "paratrain / hand-written PyTorch" in proc.stdout and "torch-pipelining" in proc.stdout
    for name in ("strategy_times.png", "microbatch_tradeoff.png"):
        _png(out / name)
    assert "| ddp | 2 |" in (out / "table.md").read_text()


def test_a_failing_model_is_reported_failed_with_its_error(tmp_path: Path) -> None:
    (tmp_path / "broken_model.py").write_text(textwrap.dedent("""
        import torch
        from torch import nn

        class Broken(nn.Linear):
            def forward(self, x):
                raise ValueError("this model cannot run forward")

        def make(batch_size):
            return nn.Sequential(Broken(4, 2)), torch.randn(batch_size, 4), torch.randn(batch_size, 2)
    """))
    out = tmp_path / "bench"
    proc = paratrain("bench", "--model", "broken_model:make", "--strategies", "ddp", "--workers", "2",
                     "--batch-size", "4", "--steps", "1", "--repeat", "1", "--warmup", "0", "--out", str(out),
                     timeout=120, env=_env(tmp_path))
    assert proc.returncode == 1, proc.stdout[-4000:]
    results = json.loads((out / "results.json").read_text())
    schema.validate(results)
    assert {r["strategy"] for r in results["runs"]} == {"single", "ddp", "torch-ddp", "no-comm"}
    for run in results["runs"]:
        assert run["status"] == "failed" and "this model cannot run forward" in run["reason"], run
    assert "configuration(s) failed" in proc.stdout


def _env(path: Path) -> dict[str, str]:
    from helpers import cli_env

    return cli_env(PYTHONPATH=str(path))
