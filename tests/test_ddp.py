"""DDP (and FSDP2) on 2 and 3 CPU workers reach the weights of a plain PyTorch loop in one process at the same
global batch (helpers.plain_toy, which imports no paratrain: a bug shared with the `single` strategy would show).

Tolerance: float32 weights agree to 2e-6 absolute (all-reduce sums gradients in another order);
bf16 autocast runs agree to 2e-2 (per-rank matmuls round differently with the smaller batch), and must differ
from the float32 reference by more than zoo.compare.AUTOCAST_FLOOR (a run that dropped autocast fails)."""

from __future__ import annotations

import pytest
import torch
from helpers import max_diff, plain_toy, train_toy
from zoo.compare import AUTOCAST_FLOOR

import paratrain


@pytest.fixture(scope="module")
def reference() -> dict[str, dict[str, object]]:
    """Plain-PyTorch runs; "accum" is one step of 24 rows, the same math as grad_accum=2 of 12."""
    return {
        "fp32": plain_toy(global_batch=12),
        "accum": plain_toy(global_batch=24),
        "bf16": plain_toy(global_batch=12, precision="bf16"),
    }


def _many(configs: list[dict[str, object]]) -> list[dict[str, object]]:
    return [train_toy(**c) for c in configs]  # type: ignore[arg-type]


@pytest.mark.parametrize("nproc", [2, 3])
def test_ddp_matches_a_plain_loop(nproc: int, reference: dict[str, dict[str, object]]) -> None:
    configs = [
        {"strategy": "ddp", "global_batch": 12},
        {"strategy": "ddp", "global_batch": 24, "grad_accum": 2},
        {"strategy": "ddp", "global_batch": 12, "precision": "bf16"},
        {"strategy": "fsdp", "global_batch": 24, "grad_accum": 2},
    ]
    results = paratrain.launch(_many, configs, nproc=nproc, timeout=120, all_ranks=True)
    for rank_results in results:
        plain, accum, bf16, fsdp = rank_results
        assert plain["world"] == nproc
        assert max_diff(plain["weights"], reference["fp32"]["weights"]) < 2e-6
        assert plain["losses"] == pytest.approx(reference["fp32"]["losses"], abs=1e-6)
        assert max_diff(accum["weights"], reference["accum"]["weights"]) < 2e-6
        assert len(accum["losses"]) == 2 * len(reference["accum"]["losses"])
        assert max_diff(bf16["weights"], reference["bf16"]["weights"]) < 2e-2
        assert max_diff(bf16["weights"], reference["fp32"]["weights"]) > AUTOCAST_FLOOR  # autocast really ran
        assert max_diff(fsdp["weights"], reference["accum"]["weights"]) < 2e-6  # sharded, same math
    # every rank holds the same weights
    assert max_diff(results[0][0]["weights"], results[-1][0]["weights"]) == 0.0


def _ddp_options() -> dict[str, object]:
    """DDP knobs each still train to the plain loop's weights (fp16 compression to its precision)."""
    out: dict[str, object] = {}
    for name, opts in {
        "buckets": {"bucket_cap_mb": 0.001},
        "static": {"static_graph": True, "gradient_as_bucket_view": True},
        "bf16_hook": {"comm_hook": "bf16"},
        "fp16_hook": {"comm_hook": "fp16"},
    }.items():
        result = train_toy("ddp", global_batch=12, **opts)
        out[name] = result["weights"]
        out[name + "_ddp"] = result["ddp"]
    return out


def test_ddp_options_train_correctly(reference: dict[str, dict[str, object]]) -> None:
    res = paratrain.launch(_ddp_options, nproc=2, timeout=120)
    assert max_diff(res["buckets"], reference["fp32"]["weights"]) < 2e-6
    assert max_diff(res["static"], reference["fp32"]["weights"]) < 2e-6
    assert max_diff(res["bf16_hook"], reference["fp32"]["weights"]) < 5e-2
    assert max_diff(res["fp16_hook"], reference["fp32"]["weights"]) < 5e-3
    # each knob took effect: DDP was built with it, and the compressed runs really rounded
    # (the toy's 2.7 KB of gradients fit DDP's first bucket, which is 1 MiB whatever the cap says)
    assert res["buckets_ddp"]["bucket_cap_bytes"] == int(0.001 * 1024 * 1024)
    assert res["static_ddp"]["static_graph"] == 1 and res["static_ddp"]["gradient_as_bucket_view"] == 1
    assert res["bf16_hook_ddp"]["comm_hook"] == "bf16_compress_hook"
    assert res["fp16_hook_ddp"]["comm_hook"] == "fp16_compress_hook"
    assert max_diff(res["bf16_hook"], reference["fp32"]["weights"]) > 1e-5  # bf16 rounding moved the weights


def _unused_parameter() -> str:
    run = paratrain.setup(strategy="ddp")

    class Branchy(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.used = torch.nn.Linear(4, 1)
            self.spare = torch.nn.Linear(4, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.used(x)

    model = run.prepare(Branchy())
    try:
        for _ in range(2):
            run.backward(model(torch.randn(2, 4)).sum())
    except paratrain.ParatrainError as exc:
        return str(exc)
    return "no error"


def test_unused_parameters_are_named() -> None:
    message = paratrain.launch(_unused_parameter, nproc=2, timeout=60)
    assert "spare.weight" in message and "spare.bias" in message
    assert "find_unused_parameters=True" in message


def _uneven_and_eval() -> dict[str, object]:
    run = paratrain.setup(strategy="ddp")
    model = run.prepare(torch.nn.Linear(3, 1))
    steps = 5 if run.rank == 0 else 2  # rank 1 runs out of batches first
    with run.join(model):
        for _ in range(steps):
            run.backward(model(torch.ones(4, 3)).sum())
    data = torch.utils.data.TensorDataset(torch.arange(11).float())
    loader = run.prepare_loader(torch.utils.data.DataLoader(data, batch_size=2), evaluation=True)
    total = sum(batch[0].sum() for batch in loader)
    count = sum(len(batch[0]) for batch in loader)
    return {"sum": run.all_reduce(total, "sum").item(), "count": run.all_reduce(count, "sum").item(),
            "rand": torch.rand(3).tolist()}


@pytest.fixture(scope="module")
def uneven() -> list[dict[str, object]]:
    return paratrain.launch(_uneven_and_eval, nproc=2, timeout=60, all_ranks=True)  # type: ignore[no-any-return]


def test_uneven_inputs_finish_and_eval_is_exact(uneven: list[dict[str, object]]) -> None:
    results = uneven
    for r in results:
        assert r["sum"] == sum(range(11))  # each sample exactly once, no padding duplicates
        assert r["count"] == 11
    assert results[0]["rand"] != results[1]["rand"]  # per-rank randomness differs after prepare


def test_per_rank_randomness_is_reproducible(uneven: list[dict[str, object]]) -> None:
    again = paratrain.launch(_uneven_and_eval, nproc=2, timeout=60, all_ranks=True)
    assert [r["rand"] for r in uneven] == [r["rand"] for r in again]
