"""Pipelines over 4 CPU workers and data parallelism over model parallelism, against one process.

- "pp" with 4 stages (and 8 virtual stages) under every schedule;
- "ddp+pp" on a 2 x 2 DeviceMesh: 2 replicas of a 2-stage pipeline, each replica half of every batch;
- "ddp+mp": 2 workers, each with the model split over 2 ("cpu") devices, DDP across them.

Tolerance: float32 losses and weights agree to 1e-6 absolute over 3 SGD-momentum steps.
"""

from __future__ import annotations

from typing import Any

import pytest
from pipeline_cases import TOL, reference, train, weight_error

import paratrain

FOUR: dict[str, tuple[str, dict[str, Any]]] = {
    "pp-gpipe": ("pp", {"schedule": "gpipe", "microbatches": 4}),
    "pp-1f1b": ("pp", {"schedule": "1f1b", "microbatches": 4, "balance": "equal"}),
    "pp-interleaved": ("pp", {"schedule": "interleaved-1f1b", "microbatches": 4, "stages_per_worker": 2}),
    "pp-zero-bubble-v": ("pp", {"schedule": "zero-bubble", "microbatches": 4, "stages_per_worker": 2}),
    "pp-zero-bubble": ("pp", {"schedule": "zero-bubble", "microbatches": 4}),
    "ddp+pp-1f1b": ("ddp+pp", {"schedule": "1f1b", "microbatches": 2}),
    "ddp+pp-gpipe-accum": ("ddp+pp", {"schedule": "gpipe", "microbatches": 2, "grad_accum": 2}),
    "ddp+pp-interleaved": ("ddp+pp", {"schedule": "interleaved-1f1b", "microbatches": 2, "stages_per_worker": 2}),
    "ddp+pp-zero-bubble": ("ddp+pp", {"schedule": "zero-bubble", "microbatches": 2, "stages_per_worker": 2}),
}

TWO: dict[str, dict[str, Any]] = {
    "mb1": {"microbatches": 1},
    "mb3-uneven": {"microbatches": 3},  # 8 samples per replica: micro-batches of 3, 3, 2
    "accum": {"microbatches": 2, "grad_accum": 2},
    "auto": {"microbatches": "auto"},
}


def _four() -> dict[str, Any]:
    return {name: train(strategy, **opts) for name, (strategy, opts) in FOUR.items()}


def _two() -> dict[str, Any]:
    return {name: train("ddp+mp", devices_per_worker=2, **opts) for name, opts in TWO.items()}


@pytest.fixture(scope="module")
def ref() -> dict[str, Any]:
    return reference()


@pytest.mark.timeout(150)
def test_four_worker_pipelines_match_single_process(ref: dict[str, Any]) -> None:
    results = paratrain.launch(_four, nproc=4, timeout=140, all_ranks=True)
    for name, (strategy, opts) in FOUR.items():
        held: dict[int, set[str]] = {}
        for rank, res in enumerate(results):
            got = res[name]
            assert got["losses"] == pytest.approx(ref["losses"], abs=TOL), (name, rank)
            assert weight_error(got["weights"], ref["weights"]) < TOL, (name, rank)
            held.setdefault(got["replica"], set()).update(got["weights"])
        for replica, names in held.items():  # each replica's ranks together hold the whole model
            assert names == set(ref["weights"]), (name, replica)
        plan = results[0][name]["plan"]
        assert plan["strategy"] == strategy and plan["stages"] == (4 if strategy == "pp" else 2) * opts.get(
            "stages_per_worker", 1)
        if strategy == "ddp+pp":  # the N-D mesh: the pipeline axis outermost, replicas of a stage neighbours
            assert [r[name]["replica"] for r in results] == [0, 1, 0, 1]
            # replicas of one stage end identical (gradients averaged over the "dp_replicate" group)
            assert weight_error(results[0][name]["weights"], results[1][name]["weights"]) == 0.0


@pytest.mark.timeout(120)
def test_ddp_over_model_parallel_matches_single_process(ref: dict[str, Any]) -> None:
    results = paratrain.launch(_two, nproc=2, timeout=110, all_ranks=True)
    for rank, res in enumerate(results):
        for name in TWO:
            got = res[name]
            assert got["losses"] == pytest.approx(ref["losses"], abs=TOL), (name, rank)
            assert set(got["weights"]) == set(ref["weights"])  # every worker holds the whole model
            assert weight_error(got["weights"], ref["weights"]) < TOL, (name, rank)
            assert got["plan"]["strategy"] == "ddp+mp" and len(got["plan"]["balance"]) == 2
        assert res["mb1"]["plan"]["balance"] == results[0]["mb1"]["plan"]["balance"]  # measured, then agreed
        assert res["auto"]["plan"]["search"]["curve"]
