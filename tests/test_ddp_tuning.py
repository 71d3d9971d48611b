"""`comm_hook="auto"` (parallel/data_parallel/ddp_tuning.py): DDP's exact communication settings chosen by
measurement in `prepare`, training exactly as one process does; lossy hooks only by name. No timing is asserted: which
candidate wins depends on the machine, so the tests check that every candidate was measured, that the DDP
in use was built with the winner's settings, and that the weights match the single-process run."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from pipeline_cases import TOL, caught, make_model, reference, train, weight_error

import paratrain
from paratrain.parallel.data_parallel import ddp_tuning


def test_candidates_are_exact_settings_sized_to_the_gradients() -> None:
    model = torch.nn.Linear(1024, 1024)  # 4 MiB of float32 gradients
    found = ddp_tuning.candidates(model)
    assert list(found) == ["default", "views", "one-bucket", "small-buckets"]
    assert found["one-bucket"]["bucket_cap_mb"] > 4.0  # every gradient fits the one bucket
    assert all("comm_hook" not in opts for opts in found.values())  # nothing lossy is tried


def _cases() -> dict[str, Any]:
    out: dict[str, Any] = {"auto": train("ddp", kind="traced", comm_hook="auto"),
                           "bf16": train("ddp", comm_hook="bf16")}
    out["powersgd"] = caught(paratrain.setup, strategy="ddp", comm_hook="powersgd")
    run = paratrain.setup(strategy="ddp", comm_hook="auto")
    out["no_example"] = caught(run.prepare, make_model(), torch.optim.SGD(make_model().parameters(), lr=0.1))
    return out


@pytest.mark.timeout(150)
def test_auto_measures_every_candidate_and_trains_like_one_process() -> None:
    traced, plain = reference(kind="traced"), reference()
    results = paratrain.launch(_cases, nproc=2, timeout=140, all_ranks=True)
    for res in results:
        auto = res["auto"]
        assert auto["losses"] == pytest.approx(traced["losses"], abs=TOL)
        assert weight_error(auto["weights"], traced["weights"]) < TOL
        tuning = auto["tuning"]
        assert set(tuning["seconds"]) == {"default", "views", "one-bucket", "small-buckets"}
        assert tuning["best"] == min(tuning["seconds"], key=tuning["seconds"].get)
        built = auto["ddp"]  # the DDP that trained was built with the winner's settings
        assert built["gradient_as_bucket_view"] == int(tuning["options"].get("gradient_as_bucket_view", False))
        if "bucket_cap_mb" in tuning["options"]:
            assert built["bucket_cap_bytes"] == int(tuning["options"]["bucket_cap_mb"] * 1024 * 1024)
        assert "comm_hook" not in built  # exact: no compression hook
        lossy = res["bf16"]  # asked for by name: registered, rounding, and still close to the exact run
        assert lossy["ddp"]["comm_hook"] == "bf16_compress_hook"
        assert lossy["losses"] == pytest.approx(plain["losses"], abs=5e-2)
        assert weight_error(lossy["weights"], plain["weights"]) > 1e-6
        assert "gloo" in res["powersgd"] and "comm_hook='bf16'" in res["powersgd"]  # refused on CPU workers
        assert "comm_hook='auto'" in res["no_example"] and "example=" in res["no_example"]
    assert results[0]["auto"]["tuning"] == results[1]["auto"]["tuning"]  # every rank chose the same
