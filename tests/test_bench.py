"""`paratrain bench`: the plan (what runs, what is reported not applicable and why), the results.json
contract, the plots, the gpt workload (deterministic build, FLOP count against the formula, the hand-cut
tied weight), and end-to-end runs of the CLI: the toy workload (single, ddp and pp with their hand-written
references), a model that fails, and the tiny gpt with tokens/s and MFU. No timing is asserted."""

from __future__ import annotations

import json
import math
import random
import sys
import textwrap
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import bench_here, paratrain
from torch import nn

from paratrain import ParatrainError, strategies
from paratrain.bench import cli as bench_cli
from paratrain.bench import jobs, mfu, plots, references, report, schema
from paratrain.cli import main as cli_main
from paratrain.measure import gpt, stats, workloads

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
    assert [job.baseline for job in p.jobs] == [False, True, True, True]  # one worker beside every run but single
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


def test_compile_pairs_paratrain_with_the_compiled_hand_loops_and_names_the_rest() -> None:
    settings = replace(_settings(), compile="aot_eager")
    p = jobs.build(jobs.parse_strategies("ddp,pp"), [2], [2], settings)
    assert [[s.strategy for s in job.specs] for job in p.jobs] == [["single"], ["ddp", "torch-ddp", "no-comm"], ["pp"]]
    status, reason = _skipped(p)[("torch-pipelining", 2, 2)]
    assert status == "not-applicable" and "--compile compiles the hand-written torch-ddp and no-comm" in reason
    model = nn.Linear(4, 4)
    assert references._compiled(model, _settings()) is model
    assert references._compiled(model, settings) is not model


def test_every_strategy_says_how_many_processes_one_pipeline_spans() -> None:
    """What the schedule bound divides by: tensor and data ranks are not stages, mp's stages share one process."""
    spans = {(name, nproc, options.get("tp_size"), options.get("pp_size")):
             strategies.get(name).pipeline_ranks(jobs.context(name, nproc, _settings(), **options))
             for name, nproc, options in [("single", 1, {}), ("ddp", 4, {}), ("fsdp", 2, {}), ("mp", 1, {}),
                                          ("pp", 4, {}), ("ddp+pp", 4, {"pp_size": 2}), ("tp", 2, {}),
                                          ("tp+pp", 4, {"tp_size": 2}), ("fsdp+tp", 4, {"tp_size": 2})]}
    assert list(spans.values()) == [1, 1, 1, 1, 4, 2, 1, 2, 1], spans


def test_bad_flags_fail_fast_naming_the_fix(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["bench", "--strategies", "single,ppp"]) == 2
    assert "Did you mean 'pp'" in capsys.readouterr().err
    assert cli_main(["bench", "--workers", "two"]) == 2
    assert "whole numbers" in capsys.readouterr().err
    assert cli_main(["bench", "--workload", "toy", "--steps", "0"]) == 2
    assert "--steps must be >= 1" in capsys.readouterr().err
    assert cli_main(["bench", "--model", "no_such_module_here:make"]) == 2
    assert "cannot load" in capsys.readouterr().err
    assert cli_main(["bench", "--workload", "mlp", "--gpt-size", "tiny"]) == 2
    assert "--gpt-size tiny applies to --workload gpt" in capsys.readouterr().err


TOKENS, FLOPS, PEAK = 16, 8e9, 1e10
"""The fake results' workload: 16 tokens per sample, 8 GFLOP per step, devices of 10 GFLOP/s."""


def _fake_results() -> dict[str, Any]:
    def run(strategy: str, workers: int, times: list[float], micro: int | None = None) -> schema.RunRecord:
        spec = jobs.Spec(strategy, workers, micro, "1f1b" if strategy in ("pp", "torch-pipelining", "tp+pp") else None)
        twin = {ref: name for name, ref in jobs.REFERENCE.items()}.get(strategy, strategy)
        options = {"microbatches": micro} if micro else {}
        bound = (workers if twin == jobs.CEILING else  # the strategy states its own bound
                 strategies.get(twin).bound(jobs.context(twin, workers, _settings(), **options)))
        return schema.record(spec, "ok", None, bound, times, 100.0)

    runs = [run("single", 1, [1.0, 1.1, 0.9]), run("ddp", 2, [0.55, 0.5, 0.6]), run("torch-ddp", 2, [0.5, 0.5, 0.5]),
            run("no-comm", 2, [0.5, 0.5, 0.5]), run("ddp", 4, [0.3, 0.3, 0.3]), run("torch-ddp", 4, [0.3, 0.3, 0.3])]
    runs += [run(s, 2, [t, t], m) for m, t in ((1, 1.0), (2, 0.8), (4, 0.7)) for s in ("pp", "torch-pipelining")]
    runs.append(run("tp+pp", 4, [0.4, 0.4], 4))  # an N-D layout with a pipeline axis: micro-batches and a schedule
    runs.append(schema.record(jobs.Spec("dp", 1), "not-applicable", "needs GPUs", 1.0))
    peak = mfu.Peak(flops_per_s=PEAK, dtype="fp32", source="measured", per_worker=[PEAK, PEAK])
    return {"schema": schema.SCHEMA, "created": schema.now(), "command": "paratrain bench", "paratrain": {},
            "machine": {**schema.machine(), "peak": peak.as_dict()},
            "workload": {"name": "toy", "description": "toy", "parameters": 1, "tokens_per_sample": TOKENS,
                         "flops_per_step": FLOPS, "flops_method": "given"},
            "global_batch": 8, "settings": {},
            "runs": schema.finalise(runs, 8, tokens_per_sample=TOKENS, flops_per_step=int(FLOPS),
                                    peak_flops_per_s=PEAK)}


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
    assert ddp["tokens_per_s"] == pytest.approx(8 * TOKENS / 0.55, rel=1e-3)
    assert ddp["mfu"] == pytest.approx(FLOPS / 0.55 / (PEAK * 2), rel=1e-3)  # two workers: twice the peak
    assert runs[("pp", 2, 4)]["bound"] == pytest.approx(2 * 4 / 5)  # K*M/(M+K-1)
    assert runs[("tp+pp", 4, 4)]["bound"] == pytest.approx(2 * 2 * 4 / 5)  # tp 2 x the 2-stage pipeline's bound
    assert runs[("dp", 1, None)]["median_step_s"] is None and runs[("dp", 1, None)]["reason"] == "needs GPUs"
    assert runs[("dp", 1, None)]["tokens_per_s"] is None and runs[("dp", 1, None)]["mfu"] is None
    lines = report.comparisons(typed["runs"])
    assert "ddp on 2 worker(s) / torch-ddp: not judged (x1.100, no interval from 3 step(s))" in lines
    assert "not-applicable" in report.table(typed["runs"]) and "| dp |" in report.markdown(typed["runs"])
    assert "| tokens/s | MFU |" in report.markdown(typed["runs"]) and "72.7%" in report.table(typed["runs"])


def test_schema_reads_version_1_and_requires_the_current_fields() -> None:
    current = schema.as_json(_fake_results())
    old = json.loads(json.dumps(current))
    old["schema"] = "paratrain-bench/1"
    for run in old["runs"]:
        del run["tokens_per_s"], run["mfu"]
    typed = schema.from_json(old)["runs"]  # version 1 still reads: the new fields are null
    assert typed[1].median == 0.55 and typed[1].mfu is None and typed[1].tokens_per_s is None
    with pytest.raises(ValueError, match="expected 'paratrain-bench/4'"):
        schema.validate(old)
    with pytest.raises(ValueError, match="this paratrain reads"):
        schema.from_json({**old, "schema": "paratrain-bench/9"})
    broken = json.loads(json.dumps(current))
    broken["runs"][0]["tokens_per_s"] = None
    broken["runs"][1]["mfu"] = 0.0
    del broken["machine"]["peak"]["source"], broken["workload"]["flops_method"]
    with pytest.raises(ValueError) as err:
        schema.validate(broken)
    text = str(err.value)
    for expected in ("runs[0]: tokens_per_s must be a positive number", "runs[1]: mfu must be a positive number",
                     "machine.peak has no 'source'", "workload has no 'flops_method'"):
        assert expected in text


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


def _noisy(centre: float, spread: float, n: int, seed: int, drift: list[float] | None = None) -> list[float]:
    """`n` step times around `centre`, each off by up to `spread` (a fraction) and scaled by the machine's `drift`
    in its round (shared by both sides of a pair)."""
    rng = random.Random(seed)
    return [centre * (drift[i] if drift else 1.0) * (1 + rng.uniform(-spread, spread)) for i in range(n)]


DRIFT = [1 + 0.25 * math.sin(i / 3) for i in range(30)]
"""A machine whose speed swings by ±25% over the rounds, as this one does when others start work."""


def test_a_5_percent_slower_side_with_little_noise_is_called_slower_despite_the_drift() -> None:
    ours, theirs = _noisy(1.05, 0.01, 30, 1, DRIFT), _noisy(1.0, 0.01, 30, 2, DRIFT)
    ratio = stats.paired_ratio(ours, theirs)
    assert ratio.low is not None and ratio.high is not None and 1.02 < ratio.low < 1.05 < ratio.high < 1.08
    assert stats.verdict(ratio).startswith("slower (x1.04") and "95% CI 1.04" in stats.verdict(ratio)
    assert stats.verdict(stats.paired_ratio(theirs, ours)).startswith("faster (x0.95")
    apart = stats.ratio_of_medians(ours, theirs, paired=False)  # the drift, timed apart, hides the 5%
    assert apart.low is not None and apart.low < 1.0 and stats.verdict(apart).startswith("within noise")
    assert stats.paired_ratio(ours, theirs) == ratio  # a fixed seed: the same steps, the same interval


def test_two_noisy_equal_sides_are_within_noise_with_its_width() -> None:
    ours, theirs = _noisy(1.0, 0.2, 15, 3), _noisy(1.0, 0.2, 15, 4)
    ratio = stats.paired_ratio(ours, theirs)
    assert ratio.low is not None and ratio.low < 1.0 < (ratio.high or 0.0)
    text = stats.verdict(ratio)
    assert text.startswith("within noise (±") and f"{ratio.noise:.1%}" in text and "95% CI" in text
    few = stats.paired_ratio(ours[:3], theirs[:3])  # three pairs: no interval, so no verdict either
    assert few.interval is None and stats.verdict(few).startswith("not judged")
    with pytest.raises(ValueError, match="a pair needs one step of each side"):
        stats.paired_ratio(ours, theirs[:-1])


def test_a_speedup_past_its_bound_is_noise_or_flagged_never_a_share_above_100_percent() -> None:
    baseline = _noisy(1.0, 0.02, 15, 5)
    below = stats.paired_ratio(baseline, _noisy(0.6, 0.02, 15, 6))  # 1.67x of a bound 2
    assert stats.against_bound(below, 2.0) == "83% of its bound 2.00x"
    wide = stats.paired_ratio(baseline, _noisy(0.55, 0.6, 15, 6))
    assert stats.against_bound(wide, 2.0).endswith("of its bound 2.00x (the bound within the noise)")
    noisy = stats.paired_ratio(_noisy(1.0, 0.25, 15, 7), _noisy(0.95, 0.25, 15, 8))  # 1.05x, bound 1: noise
    assert noisy.value > 1.0 and stats.against_bound(noisy, 1.0) == "at its bound 1.00x within noise"
    past = stats.paired_ratio(baseline, _noisy(0.45, 0.02, 15, 9))  # 2.2x of a bound 2, the interval above it
    flagged = stats.against_bound(past, 2.0)
    assert flagged.startswith("above its bound 2.00x by more than the noise") and "%" not in flagged


def test_sides_take_turns_step_by_step_a_b_b_a() -> None:
    from paratrain.bench import worker

    two = [worker._Side(jobs.Spec("ddp", 2)), worker._Side(jobs.Spec("torch-ddp", 2))]
    order = ["".join("AB"[two.index(side)] for side in worker.turn(two, k)) for k in range(4)]
    assert order == ["AB", "BA", "BA", "AB"]
    three = [worker._Side(jobs.Spec(name, 2)) for name in ("ddp", "torch-ddp", "no-comm")]
    firsts = [worker.turn(three, k)[0] for k in range(6)]
    assert all(firsts.count(side) == 2 for side in three)  # each side leads equally often


def test_finalise_pairs_each_run_with_its_baseline_and_reference_and_prints_their_intervals(
        tmp_path: Path) -> None:
    """The one-worker baseline and the reference timed in the same rounds as the run: the speedup and the ratio
    are medians of paired ratios with their intervals; results.json holds them; a single measured apart (here
    slow) does not move a speedup that has its own baseline."""
    n = 15
    baseline, ddp = _noisy(1.0, 0.02, n, 10, DRIFT), _noisy(0.55, 0.02, n, 11, DRIFT)
    torch_ddp, pp = _noisy(0.5, 0.02, n, 12, DRIFT), _noisy(1.0, 0.3, n, 13, DRIFT)
    runs = [schema.record(jobs.Spec("single", 1), "ok", None, 1.0, _noisy(1.3, 0.02, n, 14), 10.0),
            schema.record(jobs.Spec("ddp", 2), "ok", None, 2.0, ddp, 10.0, single_times=baseline),
            schema.record(jobs.Spec("torch-ddp", 2), "ok", None, 2.0, torch_ddp, 10.0, single_times=baseline),
            schema.record(jobs.Spec("pp", 2, 1, "gpipe"), "ok", None, 1.0, pp, 10.0, single_times=baseline),
            schema.record(jobs.Spec("torch-pipelining", 2, 1, "gpipe"), "ok", None, 1.0, pp[::-1], 10.0,
                          single_times=baseline)]
    results = {**_fake_results(), "runs": schema.finalise(runs, 8, tokens_per_sample=TOKENS, flops_per_step=int(FLOPS),
                                                          peak_flops_per_s=PEAK)}
    data = schema.as_json(results)
    schema.validate(data)
    by = {r["strategy"]: r for r in data["runs"]}
    assert by["single"]["speedup_vs_single"] == 1.0 and by["single"]["speedup_ci"] is None
    ddp_run = by["ddp"]
    assert ddp_run["speedup_vs_single"] == pytest.approx(1 / 0.55, rel=0.03)  # not 1.3 / 0.55: single ran apart
    low, high = ddp_run["speedup_ci"]
    assert low < ddp_run["speedup_vs_single"] < high and ddp_run["single_step_times_s"] == pytest.approx(baseline)
    low, high = ddp_run["ratio_ci"]
    assert 1.0 < low < ddp_run["vs_reference"] < high and ddp_run["vs_reference"] == pytest.approx(1.1, rel=0.03)
    lines = report.comparisons(results["runs"])
    assert lines[0].startswith("ddp on 2 worker(s) / torch-ddp: slower (x1.")
    assert lines[1].startswith("pp on 2 worker(s), 1 micro-batches / torch-pipelining: within noise (±")
    summary = "\n".join(report.summary(results["runs"]))
    assert "ddp on 2 worker(s): 1.8" in summary and "% of its bound 2.00x" in summary
    assert "pp on 2 worker(s), M=1, gpipe: 1.16x single (95% CI 0.90-1.23), at its bound 1.00x within noise" in summary
    assert "95% CI" in report.table(results["runs"]).splitlines()[0]
    broken = json.loads(json.dumps(data))
    broken["runs"][1]["ratio_ci"] = [1.2, 1.1]
    broken["runs"][0]["speedup_ci"] = [0.9, 1.1]
    broken["runs"][0]["speedup_vs_single"] = None
    with pytest.raises(ValueError) as err:
        schema.validate(broken)
    assert "runs[1]: ratio_ci must be [low, high]" in str(err.value)
    assert "runs[0]: speedup_ci without speedup_vs_single" in str(err.value)
    busy = {"cores": 2, "load_average": {"start": 5.0, "end": 7.0}}  # others' work: noted, since it lowers speedups
    assert "other work shared this machine" in (bench_cli._busy({"machine": busy, "runs": runs}) or "")
    quiet = {"cores": 2, "load_average": {"start": 0.3, "end": 2.6}}  # the end's load is this run's 2 workers
    assert bench_cli._busy({"machine": quiet, "runs": runs}) is None
    written = plots.write_all(results, tmp_path)
    assert "intervals.png" in [p.name for p in written]
    _png(tmp_path / "intervals.png")


def test_plots_bar_chart_microbatch_curve_and_scaling(tmp_path: Path) -> None:
    written = plots.write_all(_fake_results(), tmp_path)
    assert sorted(p.name for p in written) == ["intervals.png", "microbatch_tradeoff.png", "scaling.png",
                                               "strategy_times.png", "throughput.png"]
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


def test_gpt_builds_deterministically_with_its_tie_and_synthetic_next_tokens() -> None:
    w = workloads.get("gpt", gpt_size="tiny")
    torch.manual_seed(0)
    first = w.model()
    torch.manual_seed(0)
    second = w.model()
    assert isinstance(first, gpt.GPT) and first.head.proj.weight is first.embed.tok.weight  # tied
    assert first.state_dict().keys() == second.state_dict().keys()
    assert all(torch.equal(a, b) for a, b in zip(first.state_dict().values(), second.state_dict().values()))
    x, y = w.data(8)
    x2, _ = w.data(8)
    cfg = gpt.SIZES["tiny"]
    assert x.shape == y.shape == (8, cfg.seq) and x.dtype == torch.int64 and torch.equal(x, x2)
    assert torch.equal(x[:, 1:], y[:, :-1])  # targets are the next tokens
    assert w.tokens == cfg.seq and workloads.get("gpt").description.startswith("GPT decoder 'mini'")
    assert workloads.get("gpt", gpu=True).batch * gpt.SIZES["gpt2"].seq == 8192  # GPT-2 small on GPUs
    loss = w.loss()(first(x), y)
    assert abs(loss.item() - math.log(cfg.vocab)) < 0.1  # GPT-2's small init: about uniform at the start


@pytest.mark.parametrize("size,batch", [("tiny", 8), ("mini", 4), ("gpt2", 2)])
def test_counted_flops_match_6N_plus_attention(size: str, batch: int) -> None:
    """FlopCounterMode on meta gives the formula 6 N + 12 L T d per token to within 0.1% (exactly, in
    fact: both count matrix products only, attention over the full T x T, backward twice the forward)."""
    w = workloads.get("gpt", gpt_size=size)
    with torch.device("meta"):  # GPT-2 small in a blink: no weights are initialised for real
        model = w.model()
    counted = mfu.count_step_flops(w, batch, model)
    cfg = gpt.SIZES[size]
    assert counted.total == pytest.approx(gpt.flops_per_token(cfg) * batch * cfg.seq, rel=1e-3), counted.method
    assert counted.kind == "matmul" and "FlopCounterMode" in counted.method


def test_gpu_peaks_come_from_the_datasheet_table_by_name_and_dtype() -> None:
    h100 = mfu.gpu_peak("NVIDIA H100 80GB HBM3", "bf16", "matmul")
    assert h100.flops_per_s == pytest.approx(989.4e12) and h100.dtype == "bf16" and "SXM5" in h100.source
    assert mfu.gpu_peak("NVIDIA H100 PCIe", "bf16", "matmul").flops_per_s == pytest.approx(756e12)
    assert mfu.gpu_peak("NVIDIA H200", "16", "matmul").flops_per_s == pytest.approx(989.4e12)
    # float32: PyTorch runs matrix products in fp32 unless TF32 is allowed, convolutions in TF32 by default
    fp32 = mfu.gpu_peak("NVIDIA H100 80GB HBM3", "32", "matmul")
    dtype, tflops = ("tf32", 494.7) if torch.backends.cuda.matmul.allow_tf32 else ("fp32", 66.9)
    assert fp32.dtype == dtype and fp32.flops_per_s == pytest.approx(tflops * 1e12)
    assert mfu.gpu_peak("NVIDIA A100-SXM4-80GB", "32", "convolution").dtype == (
        "tf32" if torch.backends.cudnn.allow_tf32 else "fp32")
    unknown = mfu.gpu_peak("Some GPU 9000", "bf16", "matmul")
    assert unknown.flops_per_s is None and "no datasheet figure" in unknown.source


def test_hand_cut_gpt_keeps_the_tied_weight_exact() -> None:
    """Cut in two, the tied weight sits on both stages; the copies' summed gradients (what the references
    do across devices or ranks) equal the tied model's gradient, and one SGD step keeps them equal."""
    w = workloads.get("gpt", gpt_size="tiny")
    x, y = w.data(8)
    torch.manual_seed(0)
    whole = w.model()
    w.loss()(whole(x), y).backward()
    torch.manual_seed(0)
    pieces = references.cut(w.model(), 2, w.split, w.layers)
    assert [type(m).__name__ for m in pieces[0]] == ["Embedding", "Block"]
    assert [type(m).__name__ for m in pieces[1]] == ["Block", "Head"]
    shared = references.shared_across(pieces)
    assert [(owners, [p.shape for p in ps]) for owners, ps in shared] == [((0, 1), [whole.embed.tok.weight.shape])]
    pairs = references.untie(pieces[0], pieces[1])
    assert pairs == [("0.tok.weight", "1.proj.weight")] and not references.shared_across(pieces)
    w.loss()(pieces[1](pieces[0](x)), y).backward()
    references.sum_tied_grads(pieces[0], pieces[1], pairs)
    first, second = pieces[0].get_parameter("0.tok.weight"), pieces[1].get_parameter("1.proj.weight")
    assert first.grad is not None and second.grad is not None and whole.embed.tok.weight.grad is not None
    torch.testing.assert_close(first.grad, whole.embed.tok.weight.grad)
    torch.testing.assert_close(second.grad, whole.embed.tok.weight.grad)
    params = [*pieces[0].parameters(), *pieces[1].parameters()]
    torch.optim.SGD(params, lr=0.1).step()
    torch.optim.SGD(whole.parameters(), lr=0.1).step()
    torch.testing.assert_close(first, second)
    torch.testing.assert_close(first.detach(), whole.embed.tok.weight.detach())


def test_plan_times_comm_hooks_and_schedules_side_by_side() -> None:
    settings = jobs.Settings(workload="mlp", batch=64, steps=1, warmup=1, repeat=1,
                             comm_hooks=("none", "auto", "bf16"), schedule="1f1b,zero-bubble")
    p = jobs.build(jobs.parse_strategies("ddp,pp"), [2], [4], settings)
    specs = {(s.strategy, s.schedule, s.options) for job in p.jobs for s in job.specs}
    assert {("ddp", None, ()), ("ddp", None, (("comm_hook", "auto"),)), ("ddp", None, (("comm_hook", "bf16"),)),
            ("torch-ddp", None, ()), ("no-comm", None, ())} <= specs
    assert ("pp", "1f1b", ()) in specs and ("pp", "zero-bubble", (("stages_per_worker", 2),)) in specs
    assert ("torch-pipelining", "1f1b", ()) in specs  # the hand-written twin covers 1f1b and gpipe only
    assert _skipped(p)[("torch-pipelining", 2, 4)][0] == "not-applicable"
    labels = {s.label for job in p.jobs for s in job.specs}
    assert "ddp comm_hook=auto" in labels and "pp stages_per_worker=2 M=4" in labels
    with pytest.raises(ParatrainError, match="Did you mean .zero-bubble."):
        jobs.schedules("zero-bubbel")


def test_each_schedule_is_held_to_its_own_bound_not_1f1b_s() -> None:
    settings = jobs.Settings(workload="mlp", batch=64, steps=1, warmup=1, repeat=1,
                             schedule="1f1b,zero-bubble,interleaved-1f1b,auto")
    p = jobs.build(jobs.parse_strategies("pp"), [2], [4], settings)
    bound = {s.schedule: s.bound for job in p.jobs for s in job.specs if s.strategy == "pp"}
    assert bound["1f1b"] == pytest.approx(2 * 4 / 5)  # K*M/(M+K-1)
    # Simulated from torch's own action lists: the ZBV bubble is a fraction of 1F1B's, interleaving halves it
    assert bound["zero-bubble"] == pytest.approx(1.92, abs=0.01)
    assert bound["interleaved-1f1b"] == pytest.approx(2 * 8 / 9, abs=0.01)
    assert bound["1f1b"] < bound["auto"] <= bound["zero-bubble"]  # auto: the best it chooses among (V=1)
    ddp_pp = jobs.build(jobs.parse_strategies("ddp+pp"), [4], [4], replace(settings, schedule="zero-bubble"))
    assert [s.bound for job in ddp_pp.jobs for s in job.specs if s.strategy == "ddp+pp"] == \
        [pytest.approx(2 * bound["zero-bubble"])]  # 2 replicas of the 2-stage pipeline


def test_lossy_options_show_their_final_loss_beside_the_exact_run() -> None:
    def run(options: tuple[tuple[str, str], ...], loss: float) -> schema.RunRecord:
        record = schema.record(jobs.Spec("ddp", 2, options=options), "ok", None, 2.0, [0.5, 0.5], 10.0)
        record.final_loss = loss
        return record

    single = schema.record(jobs.Spec("single", 1), "ok", None, 1.0, [1.0, 1.0], 10.0)
    runs = schema.finalise([single, run((), 0.5), run((("comm_hook", "bf16"),), 0.5012)], 8)
    table = report.table(runs)
    assert "final loss" in table and "0.50120" in table and "ddp bf16" in table
    assert runs[2].options == {"comm_hook": "bf16"}
    assert any("with comm_hook=bf16" in line for line in report.summary(runs))


# -- tier 4: the CLI end to end on real workers --------------------------------------------------------


@pytest.mark.procs
def test_bench_end_to_end_on_cpu_workers(tmp_path: Path) -> None:
    """single, dp, ddp and pp (2 micro-batches) on 2 CPU workers: every requested strategy is measured or
    reported not applicable with its reason; the references run beside ddp and pp; plots are written."""
    out = tmp_path / "bench"
    proc = paratrain("bench", "--workload", "toy", "--strategies", "single,dp,ddp,pp", "--workers", "2",
                     "--microbatches", "2", "--batch-size", "20", "--steps", "3", "--repeat", "2", "--warmup", "1",
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
            assert len(run["step_times_s"]) == 2 * 3 and run["peak_memory_mb"] > 0
    for key in (("ddp", 2, None), ("pp", 2, 2)):  # paired with its reference and the one-worker baseline
        run = runs[key]
        assert run["vs_reference"] > 0 and run["ratio_ci"][0] <= run["ratio_ci"][1], run
        assert len(run["single_step_times_s"]) == 6 and run["speedup_ci"][0] <= run["speedup_ci"][1], run
    assert runs[("pp", 2, 2)]["schedule"] == "1f1b" and runs[("single", 1, None)]["speedup_vs_single"] == 1.0
    assert "paratrain / hand-written PyTorch" in proc.stdout and "torch-pipelining" in proc.stdout
    assert "95% CI" in proc.stdout and "one worker (baseline)" in proc.stdout
    for name in ("strategy_times.png", "microbatch_tradeoff.png", "intervals.png"):
        _png(out / name)
    assert "| ddp | 2 |" in (out / "table.md").read_text()


@pytest.mark.procs
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
    import os

    from helpers import cli_env

    return cli_env(PYTHONPATH=os.pathsep.join([str(path), *filter(None, [os.environ.get("PYTHONPATH")])]))


@pytest.mark.procs
def test_bench_gpt_end_to_end_with_tokens_and_mfu(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The tiny gpt on single, ddp, pp (2 micro-batches) and tp, 2 CPU workers: valid results.json with the
    counted FLOPs and each worker's measured peak; every ok run has tokens/s and an MFU in (0, 1]; the
    references, the data-parallel and the tensor-parallel runs are ok (tp trains the same steps as ddp: the same
    final loss); paratrain's pp is ok or carries its reason. (torch-pipeline,
    beside mp, runs the same hand cut in one process; test_hand_cut_gpt_keeps_the_tied_weight_exact covers it.)"""
    out = tmp_path / "bench"
    code, stdout = bench_here(capsys, "--workload", "gpt", "--gpt-size", "tiny", "--strategies", "single,ddp,pp,tp",
                              "--workers", "2", "--microbatches", "2", "--steps", "2", "--repeat", "1", "--warmup",
                              "0", "--timeout", "150", "--out", str(out))
    results = json.loads((out / "results.json").read_text())
    schema.validate(results)
    cfg = gpt.SIZES["tiny"]
    assert results["schema"] == schema.SCHEMA and results["settings"]["gpt_size"] == "tiny"
    assert results["workload"]["tokens_per_sample"] == cfg.seq
    assert results["workload"]["flops_per_step"] == gpt.flops_per_token(cfg) * 8 * cfg.seq
    peak = results["machine"]["peak"]
    assert peak["dtype"] == "fp32" and len(peak["per_worker"]) == 2 and peak["flops_per_s"] > 0
    runs = {(r["strategy"], r["workers"], r["microbatches"]): r for r in results["runs"]}
    assert set(runs) == {("single", 1, None), ("ddp", 2, None), ("torch-ddp", 2, None), ("no-comm", 2, None),
                         ("pp", 2, 2), ("torch-pipelining", 2, 2), ("tp", 2, None), ("torch-tp", 2, None)}
    tp, ddp = runs[("tp", 2, None)], runs[("ddp", 2, None)]
    assert tp["status"] == runs[("torch-tp", 2, None)]["status"] == "ok", tp
    assert tp["reference"] == "torch-tp" and tp["final_loss"] == pytest.approx(ddp["final_loss"], rel=1e-5)
    for key, run in runs.items():
        if run["status"] == "ok":
            assert run["tokens_per_s"] > 0 and 0 < run["mfu"] <= 1, run
            assert run["tokens_per_s"] == pytest.approx(run["samples_per_s"] * cfg.seq, rel=1e-3)
        else:
            assert key[0] == "pp" and run["reason"], run  # only paratrain's pipeline may not split a GPT yet
    assert code == (1 if any(r["status"] == "failed" for r in runs.values()) else 0), stdout[-4000:]
    assert "model FLOPs:" in stdout and "| tokens/s | MFU |" in (out / "table.md").read_text()
    _png(out / "throughput.png")


@pytest.mark.procs
def test_bench_times_comm_hooks_and_schedule_auto(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """ddp with torch's settings, comm_hook=auto and bf16 side by side, and pp with schedule=auto: each
    measured, each paratrain run reporting its final loss (the lossy one's effect is visible)."""
    out = tmp_path / "bench"
    code, stdout = bench_here(capsys, "--workload", "mlp-wide", "--strategies", "ddp,pp", "--workers", "2",
                              "--comm-hook", "none,auto,bf16", "--schedule", "auto", "--microbatches", "2",
                              "--batch-size", "8", "--steps", "1", "--repeat", "1", "--warmup", "1",
                              "--no-reference", "--out", str(out))
    assert code == 0, stdout[-4000:]
    results = json.loads((out / "results.json").read_text())
    schema.validate(results)
    runs = {(r["strategy"], r["options"].get("comm_hook"), r["schedule"]): r for r in results["runs"]}
    assert set(runs) == {("single", None, None), ("ddp", None, None), ("ddp", "auto", None),
                         ("ddp", "bf16", None), ("pp", None, "auto")}
    for run in runs.values():
        assert run["status"] == "ok" and run["final_loss"] is not None
    exact, lossy = runs[("ddp", None, None)]["final_loss"], runs[("ddp", "bf16", None)]["final_loss"]
    assert runs[("ddp", "auto", None)]["final_loss"] == pytest.approx(exact, abs=1e-6)  # exact settings only
    assert lossy == pytest.approx(exact, rel=1e-2)
    assert "comm_hook auto ->" in stdout and "schedule auto ->" in stdout


@pytest.mark.procs
def test_tp_pp_is_timed_beside_torchtitans_order_written_by_hand(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    """tp+pp on 4 CPU workers (tp 2 x pp 2) beside torch-tp-pp (parallelize_module, then two PipelineStages over
    the mesh's "pp" dimension and torch's 1F1B) with 2 micro-batches: both run, are paired, and paratrain's trains
    the same step as one process (the same final loss, to the float noise of sums split over tensor ranks); the
    schedule's bound counts the 2 pipeline ranks, not the 4 workers."""
    out = tmp_path / "bench"
    code, stdout = bench_here(capsys, "--workload", "mlp", "--batch-size", "64", "--strategies", "tp+pp",
                              "--workers", "4", "--microbatches", "2", "--schedule", "1f1b", "--steps", "1",
                              "--repeat", "1", "--warmup", "0", "--timeout", "150", "--out", str(out))
    assert code == 0, stdout[-4000:]
    results = json.loads((out / "results.json").read_text())
    schema.validate(results)
    runs = {(r["strategy"], r["workers"], r["microbatches"]): r for r in results["runs"]}
    ours, theirs = runs[("tp+pp", 4, 2)], runs[("torch-tp-pp", 4, 2)]
    assert ours["status"] == theirs["status"] == "ok", (ours, theirs)
    assert ours["reference"] == "torch-tp-pp" and ours["vs_reference"] > 0 and theirs["schedule"] == "1f1b"
    assert ours["bound"] == pytest.approx(2 * 2 * 2 / 3, abs=1e-3)  # tp 2 x a 2-stage 1F1B over 2 micro-batches
    assert ours["final_loss"] == pytest.approx(runs[("single", 1, None)]["final_loss"], rel=1e-5)  # sharded sums


HAND_WRITTEN = ("torch-fsdp", "torch-fsdp-tp", "torch-tp-pp", "torch-ddp-pp", "torch-fsdp-pp")
"""The N-D references on 4 workers: a reference that trains wrong would make its ratio meaningless."""


def _one_reference_step(names: tuple[str, ...]) -> dict[str, dict[str, torch.Tensor]]:
    """In each worker: every reference built from the same weights and stepped once on the tiny gpt; the whole
    value of every parameter this rank trained (a gradient was left on it), by its name in the model."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    w = replace(workloads.get("gpt", gpt_size="tiny"), lr=1.0)  # a step as large as the gradient: a wrong one shows
    settings = jobs.Settings(workload="gpt", gpt_size="tiny", batch=8, steps=1, warmup=0, repeat=1, schedule="1f1b")
    built: list[nn.Module] = []
    build = references.build_model
    references.build_model = lambda *a: built.append(build(*a)) or built[-1]  # type: ignore[assignment]
    out = {}
    for name in names:
        spec = jobs.Spec(name, 4, 2 if name.endswith("-pp") else None, "1f1b" if name.endswith("-pp") else None)
        references.BUILDERS[name](spec, w, w.data(8), settings, torch.device("cpu"))()
        out[name] = {key: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
                     for key, p in built[-1].named_parameters(remove_duplicate=False) if p.grad is not None}
    dist.destroy_process_group()
    return out


@pytest.mark.procs
@pytest.mark.timeout(180)
def test_hand_written_nd_references_train_as_one_process() -> None:
    """Each N-D hand-written reference (FSDP, FSDP x TP, and pipelines of tensor-parallel, replicated and sharded
    stages, with GPT's head tied to its embedding across the stages) takes the step plain SGD takes on the global
    batch: every weight's update, on every rank that trains it, and every weight trained by some rank."""
    import paratrain

    w = workloads.get("gpt", gpt_size="tiny")
    torch.manual_seed(references.SEED)
    plain = w.model()
    before = {key: p.detach().clone() for key, p in plain.named_parameters(remove_duplicate=False)}
    x, y = w.data(8)
    w.loss()(plain(x), y).backward()
    torch.optim.SGD(plain.parameters(), lr=1.0).step()
    want = {key: p.detach() - before[key] for key, p in plain.named_parameters(remove_duplicate=False)}
    per_rank = paratrain.launch(_one_reference_step, HAND_WRITTEN, nproc=4, timeout=150, all_ranks=True,
                                accelerator="cpu")
    for name in HAND_WRITTEN:
        trained = set()
        for rank, got in enumerate(per_rank):
            for key, value in got[name].items():
                where = f"{name} rank {rank} {key}"
                torch.testing.assert_close(value - before[key], want[key], rtol=1e-4, atol=1e-6,
                                           msg=lambda m, where=where: f"{where}: {m}")
                trained.add(key)
        assert trained == set(want), (name, set(want) - trained)
