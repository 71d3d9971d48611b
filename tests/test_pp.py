"""Strategy "pp" on 2 CPU workers (gloo) trains exactly like one process, under every schedule.

One 2-process launch runs all the cases (each worker start costs seconds); the parent compares each
rank's losses and the weights of the layers it holds with the single-process reference.
Tolerance: float32 losses and weights agree to 1e-6 absolute over 3 SGD-momentum steps.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from pipeline_cases import TOL, caught, make_model, reference, train, weight_error

import paratrain

CASES: dict[str, dict[str, Any]] = {
    "gpipe": {"schedule": "gpipe", "microbatches": 4},
    "gpipe-memory": {"schedule": "gpipe", "microbatches": 2, "balance": "memory"},
    "1f1b": {"schedule": "1f1b", "microbatches": 4, "balance": "equal"},
    "1f1b-accum": {"schedule": "1f1b", "microbatches": 2, "grad_accum": 2, "balance": [4, 5]},
    "interleaved-1f1b": {"schedule": "interleaved-1f1b", "microbatches": 4, "stages_per_worker": 2},
    "zero-bubble-v": {"schedule": "zero-bubble", "microbatches": 4, "stages_per_worker": 2},
    "zero-bubble": {"schedule": "zero-bubble", "microbatches": 4},
    "auto": {"schedule": "1f1b", "microbatches": "auto"},
    "schedule-auto": {"schedule": "auto", "microbatches": "auto", "kind": "traced"},
    "traced": {"schedule": "1f1b", "microbatches": 2, "kind": "traced"},
    "inplace": {"schedule": "1f1b", "microbatches": 2, "kind": "inplace", "balance": [1, 8]},
}


def _cases(tmp: str) -> dict[str, Any]:
    out: dict[str, Any] = {name: train("pp", **opts) for name, opts in CASES.items()}
    run = paratrain.setup(strategy="pp", microbatches=4, schedule="1f1b")
    model = run.prepare(make_model(), example=torch.randn(8, 8))
    out["uneven"] = caught(run.forward_backward, model, torch.randn(6, 8), torch.randn(6, 4),
                           torch.nn.functional.mse_loss)
    # torch's clip_grad_norm_ on a stage's parameters is refused; run.clip_grad_norm_ is the whole model's norm
    run.forward_backward(model, torch.randn(8, 8), torch.randn(8, 4), torch.nn.functional.mse_loss)
    out["torch_clip"] = caught(torch.nn.utils.clip_grad_norm_, model.parameters(), 0.5)
    out["clip_norm"] = float(run.clip_grad_norm_(model, 0.5))
    other = torch.nn.Linear(3, 3)
    other(torch.ones(2, 3)).sum().backward()
    out["other_clip"] = (float(torch.nn.utils.clip_grad_norm_(other.parameters(), 0.5)),
                         float(torch.linalg.vector_norm(torch.cat([q.grad.flatten() for q in other.parameters()]))))
    # save after 2 steps with an unequal split; resume in a fresh run that splits differently
    train("pp", schedule="1f1b", microbatches=2, balance=[2, 7], save_to=tmp)
    ckpt = sorted(p for p in Path(tmp).iterdir() if p.is_dir())[-1]
    out["files"] = sorted(p.name for p in ckpt.iterdir())
    out["resumed"] = train("pp", schedule="1f1b", microbatches=2, balance="equal", resume_from=str(ckpt))
    return out


@pytest.mark.timeout(150)
def test_pipeline_schedules_match_single_process(tmp_path: Path) -> None:
    ref, traced_ref = reference(), reference(kind="traced")
    results = paratrain.launch(_cases, str(tmp_path), nproc=2, timeout=140, all_ranks=True)
    for rank, res in enumerate(results):
        held: set[str] = set()
        for name, opts in CASES.items():
            want = traced_ref if opts.get("kind") == "traced" else ref  # in-place ReLU: same numbers
            got = res[name]
            assert got["losses"] == pytest.approx(want["losses"], abs=TOL), (name, rank)  # on every rank
            assert weight_error(got["weights"], want["weights"]) < TOL, (name, rank)
            if opts["schedule"] == "auto":  # measured: one of the schedules of this layout, and the curve kept
                assert got["plan"]["schedule"] in ("1f1b", "zero-bubble", "gpipe"), got["plan"]
                assert f"{got['plan']['schedule']} M={got['plan']['microbatches']}" in got["plan"]["schedule_curve"]
            else:
                assert got["plan"]["schedule"] == opts["schedule"]
            if name == "1f1b":
                held |= set(got["weights"])
        assert res["1f1b"]["plan"]["balance"] == [5, 4]
        assert res["1f1b-accum"]["plan"]["balance"] == [4, 5]
        assert len(res["gpipe"]["plan"]["layer_costs"]) == 9  # balance="time" measured every layer
        auto = res["auto"]["plan"]
        assert auto["microbatches"] in (2, 4, 8, 16) and str(auto["microbatches"]) in auto["search"]["curve"]
        mem = res["gpipe"]["plan"]["memory"]
        assert [m["in_flight_bound"] for m in mem] == [4, 4]  # GPipe keeps every micro-batch
        assert all(m["in_flight_bound"] <= 2 for m in res["1f1b"]["plan"]["memory"])  # 1F1B: at most K
        assert all(m["peak_activation_bytes"] > 0 and m["params_bytes"] > 0 for m in mem)
        assert "batch 6 cannot be split into 4 micro-batches" in res["uneven"] and "microbatches=3" in res["uneven"]
        assert f"pipeline rank {rank}'s stages" in res["torch_clip"] and "run.clip_grad_norm_" in res["torch_clip"]
        assert res["clip_norm"] > 0 and res["clip_norm"] == results[0]["clip_norm"]  # one norm, every rank
        assert res["other_clip"][0] > 0.5 and res["other_clip"][1] == pytest.approx(0.5, rel=1e-5)  # torch's own
        assert {"rank-0.pt", "rank-1.pt", "rng-0.pt", "rng-1.pt"} <= set(res["files"])
        resumed = res["resumed"]
        assert resumed["plan"]["balance"] == [5, 4]  # another split than the saved [2, 7]: loaded by name
        assert resumed["losses"] == pytest.approx(ref["losses"][2:], abs=TOL)
        assert weight_error(resumed["weights"], ref["weights"]) < TOL
        if rank == 1:
            assert held.isdisjoint(results[0]["1f1b"]["weights"])  # the two ranks hold different layers
            assert held | set(results[0]["1f1b"]["weights"]) == set(ref["weights"])
