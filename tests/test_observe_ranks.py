"""`run.log` and `paratrain.profile` over several ranks: values averaged or summed in one all-reduce, the
per-rank breakdown gathered, a rank with a slow loader named; and `paratrain bench`'s progress bar."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

import paratrain


class _Rows(Dataset):
    """32 rows of a regression; given a clock, each row read advances it by 10 s: that rank's loader is then
    (deterministically, without sleeping) 10 s per row slower than the others'."""

    def __init__(self, clock: Any = None) -> None:
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(32, 4, generator=g), torch.randn(32, 1, generator=g)
        self.clock = clock

    def __len__(self) -> int:
        return 32

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.clock is not None:
            self.clock.offset += 10.0
        return self.x[i], self.y[i]


class _ShiftedClock:
    """`time` as observe/breakdown.py sees it, running `offset` seconds ahead."""

    def __init__(self) -> None:
        self.offset = 0.0

    def perf_counter(self) -> float:
        return time.perf_counter() + self.offset


def _train_and_log(folder: str, strategy: str, slow_rank: int | None) -> dict[str, Any]:
    from paratrain.observe import breakdown

    options = {"microbatches": 2, "balance": "equal"} if strategy == "pp" else {}
    run = paratrain.setup(strategy=strategy, log_dir=folder, progress=False, seed=0, **options)
    clock = None
    if run.rank == slow_rank:
        clock = _ShiftedClock()
        breakdown.time = clock  # type: ignore[assignment]
    loader = run.prepare_loader(DataLoader(_Rows(clock), batch_size=run.per_worker_batch(8)))
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    model, opt = run.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    calls = []
    reduce = torch.distributed.all_reduce

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return reduce(*args, **kwargs)

    records = []
    with paratrain.profile(run) as prof:
        for step, (x, y) in enumerate(loader, 1):
            loss = run.forward_backward(model, x, y, nn.functional.mse_loss)
            opt.step()
            opt.zero_grad()
            torch.distributed.all_reduce = counted
            records.append(run.log(step, {"loss": loss, "rank": run.rank, "ones": 1}, reduce={"ones": "sum"},
                                   samples=len(x)))
            torch.distributed.all_reduce = reduce
    try:
        run.log(9, **({"a": 1.0} if run.rank == 0 else {"b": 1.0}))
        mixed = ""
    except paratrain.ParatrainError as exc:
        mixed = str(exc)
    run.close()
    return {"records": records, "calls": len(calls), "slow": prof.slow, "ranks": prof.ranks, "steps": prof.steps,
            "mixed": mixed, "rank": run.rank}


@pytest.mark.parametrize("strategy", ["ddp", "pp"])
def test_log_reduces_in_one_all_reduce_and_gathers_each_ranks_breakdown(tmp_path: Path, strategy: str) -> None:
    out = paratrain.launch(_train_and_log, str(tmp_path), strategy, None, nproc=2, timeout=120, all_ranks=True)
    for result in out:
        records = result["records"]
        assert result["calls"] == len(records) == 4  # one all-reduce per run.log, profiling included
        for r in records:
            assert r["rank"] == 0.5 and r["ones"] == 2.0  # mean of ranks 0 and 1; a sum
            assert r["samples"] == 8.0  # the global batch: ddp's two shares, or once for a pipeline's two stages
            assert len(r["per_rank"]["compute_s"]) == 2 and all(v >= 0 for v in r["per_rank"]["comm_s"])
            assert all(v > 0 for v in r["per_rank"]["compute_s"])
        assert [r["step"] for r in records] == [1, 2, 3, 4]
        assert result["steps"] == 4 and len(result["ranks"]) == 2
        assert "different metric names on different ranks" in result["mixed"]
    assert [r["loss"] for r in out[0]["records"]] == [r["loss"] for r in out[1]["records"]]
    written = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["loss"] for r in written] == [r["loss"] for r in out[0]["records"]]  # rank 0 wrote them


def test_a_rank_whose_loader_is_slow_is_named(tmp_path: Path) -> None:
    out = paratrain.launch(_train_and_log, str(tmp_path), "ddp", 1, nproc=2, timeout=120, all_ranks=True)
    for result in out:
        assert result["slow"] == [1]
        assert result["ranks"][1].data >= 40.0 > result["ranks"][0].data  # 4 rows a batch on each of 2 ranks
        assert all(r["slow_ranks"] == [1] for r in result["records"])


def test_bench_shows_a_bar_over_its_configurations(capsys: pytest.CaptureFixture[str],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    from paratrain.bench import jobs as planning
    from paratrain.bench import runner

    settings = planning.Settings(workload="toy", batch=8, steps=1, warmup=0, repeat=1)
    plan = planning.build(["single", "ddp"], [2], None, settings, references=True)
    done = []

    def fake_launch(fn: Any, job: planning.Job, *args: Any, **kwargs: Any) -> list[dict[str, Any]]:
        done.append(job.title)
        return [{"spec": spec, "reason": "", "step_times_s": [0.1], "peak_memory_mb": 1.0} for spec in job.specs]

    monkeypatch.setattr(runner, "launch", fake_launch)
    records = runner.run_jobs(plan, settings, 10.0, progress=True)
    total = sum(len(job.specs) for job in plan.jobs)
    err = capsys.readouterr().err
    assert len(done) == len(plan.jobs) >= 2 and len(records) >= total
    assert f"{total}/{total}" in err and "config" in err and "bench" in err and "<" in err  # elapsed<remaining
