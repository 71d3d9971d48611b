"""Strategy "mp" (one process, stages on several devices; all on "cpu" here) trains exactly like one process.

Tolerance: float32 losses and weights agree to 1e-6 absolute over 3 SGD-momentum steps (see pipeline_cases).
These run in the test process itself: "mp" needs no process group.
"""

from __future__ import annotations

import pytest
import torch
from helpers import check_job
from pipeline_cases import LR, TOL, batches, caught, make_model, reference, train, weight_error

import paratrain
from paratrain.parallel.pipeline.mp_pipeline import MPPipeline, clock_cycles
from paratrain.parallel.pipeline.streams import Copier


@pytest.fixture(scope="module")
def ref() -> dict[str, object]:
    return reference(steps=3, batch=10)


@pytest.mark.parametrize("microbatches", [1, 2, 3, 5, 10])
def test_mp_matches_single_process(microbatches: int, ref: dict) -> None:
    out = train("mp", steps=3, batch=10, microbatches=microbatches, devices=["cuda:0", "cuda:1"])
    assert out["losses"] == pytest.approx(ref["losses"], abs=TOL)
    assert weight_error(out["weights"], ref["weights"]) < TOL
    assert set(out["weights"]) == set(ref["weights"])  # one process holds every layer, original names
    assert out["plan"]["microbatches"] == microbatches
    assert sum(out["plan"]["balance"]) == 9 and len(out["plan"]["balance"]) == 2


def test_mp_uneven_microbatches_three_stages(ref: dict) -> None:
    """Batch 10 in 4 micro-batches (3, 3, 2, 2) over 3 stages: the loss is taken on the whole output."""
    out = train("mp", steps=3, batch=10, microbatches=4, devices=["cpu"] * 3, balance=[2, 4, 3])
    assert out["losses"] == pytest.approx(ref["losses"], abs=TOL)
    assert weight_error(out["weights"], ref["weights"]) < TOL
    assert out["plan"]["balance"] == [2, 4, 3]


def test_mp_auto_microbatches_and_reports(ref: dict) -> None:
    out = train("mp", steps=3, batch=10, microbatches="auto", devices=["cpu", "cpu"])
    assert weight_error(out["weights"], ref["weights"]) < TOL  # trial steps left no trace
    plan = out["plan"]
    curve = plan["search"]["curve"]
    assert plan["microbatches"] in (1, 2, 5, 10) and str(plan["microbatches"]) in curve
    assert all(seconds > 0 for seconds in curve.values())
    assert len(plan["layer_costs"]) == 9  # balance="time" measured every layer
    rows = plan["memory"]
    assert [r["stages"] for r in rows] == [[0], [1]]
    assert sum(r["params_bytes"] for r in rows) == sum(v.numel() * 4 for v in ref["weights"].values())
    assert all(r["peak_activation_bytes"] > 0 and r["activation_per_microbatch_bytes"] > 0 for r in rows)


def test_mp_traced_model_matches() -> None:
    """A model that is not an nn.Sequential is split by torch's tracing front end, names kept."""
    want = reference(steps=3, batch=8, kind="traced")
    out = train("mp", steps=3, batch=8, kind="traced", microbatches=2, balance="equal")
    assert out["losses"] == pytest.approx(want["losses"], abs=TOL)
    assert weight_error(out["weights"], want["weights"]) < TOL
    assert set(out["weights"]) == set(want["weights"])


def test_mp_grad_accum_and_bf16(ref: dict) -> None:
    accum = train("mp", steps=3, batch=10, grad_accum=2, microbatches=2)
    assert weight_error(accum["weights"], ref["weights"]) < TOL
    bf16 = train("mp", steps=3, batch=10, microbatches=2, precision="bf16")
    assert weight_error(bf16["weights"], ref["weights"]) < 5e-2


def test_mp_rejects_bad_setups_with_the_fix() -> None:
    assert "ddp+mp" in caught(check_job, "mp", 2)
    assert "3 entries but there are 2 stages" in caught(check_job, "mp", balance=[1, 2, 3])
    assert "positive int or 'auto'" in caught(check_job, "mp", microbatches=0)
    run = paratrain.setup(strategy="mp", devices=["cpu"] * 12)
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU())
    msg = caught(run.prepare, model, example=torch.randn(4, 2))
    assert "2 layer(s) but 12 pipeline stages" in msg


def test_clock_cycles_and_cpu_copies() -> None:
    cycles = clock_cycles(3, 2)
    assert cycles == [[(0, 0)], [(1, 0), (0, 1)], [(2, 0), (1, 1)], [(2, 1)]]
    assert sum(len(c) for c in clock_cycles(5, 4)) == 20 and len(clock_cycles(5, 4)) == 8
    x = torch.randn(3)
    assert Copier([torch.device("cpu")]).to((x, {"k": x}), torch.device("cpu"))[0] is x
    two = torch.nn.Sequential(torch.nn.Linear(1, 1), torch.nn.ReLU())
    assert isinstance(paratrain.setup(strategy="mp").prepare(two, example=torch.randn(2, 1)), MPPipeline)


def _reference_on(device: str, steps: int, batch: int) -> dict[str, object]:
    """pipeline_cases.reference on `device`: plain PyTorch, one process, the whole batch (no paratrain code, so a
    bug shared by paratrain's `single` and its `mp` cannot hide)."""
    torch.manual_seed(0)
    model = make_model().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    losses = []
    for x, y in batches(steps, batch):
        loss = torch.nn.functional.mse_loss(model(x.to(device)), y.to(device))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "weights": {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (PARATRAIN_TEST_GPU=1, make test-gpu)")
def test_mp_on_cuda_matches_plain_pytorch() -> None:
    """Stages on cuda:0 and cuda:1 where two GPUs are visible, else both on cuda:0; pipelined, against the plain
    loop on cuda:0. Tolerance 1e-5: micro-batches change the shapes, so cuBLAS may sum in another order."""
    devices = ["cuda:0", "cuda:1"] if torch.cuda.device_count() >= 2 else ["cuda:0", "cuda:0"]
    want = _reference_on("cuda:0", steps=3, batch=12)
    for microbatches in (1, 3, "auto"):
        out = train("mp", steps=3, batch=12, microbatches=microbatches, devices=devices)
        assert out["plan"]["microbatches"] in ((1, 2, 3, 4, 6, 12) if microbatches == "auto" else (microbatches,))
        assert out["losses"] == pytest.approx(want["losses"], abs=1e-5)
        assert set(out["weights"]) == set(want["weights"])
        assert weight_error(out["weights"], want["weights"]) < 1e-5
