"""Comparing a run with the reference: per-step losses (absolute) and weights (relative to how far each
tensor moved; see `case.Tolerance`), and the check that a bf16 run really ran under autocast."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .case import Tolerance
from .reference import Record

AUTOCAST_FLOOR = 1e-5
"""A bf16 run's weights must differ from the fp32 reference's by more than this (max |difference| over the
state_dict, at some step), or it did not run under autocast. Measured over the zoo (tests/test_zoo.py):
float32 runs that only reorder sums stay within 1.2e-7 of the reference; bf16 autocast moves the weights
at least 1.5e-4 away within three steps (the MLP; 3.2e-4 to 0.39 for the others)."""


def weights_error(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], initial: dict[str, torch.Tensor],
                  tol: Tolerance) -> tuple[float, str]:
    """(worst ratio, its key) of max|got - want| / (atol + rtol * max|want - initial|) over the entries of
    `got` that `want` has (a pipeline rank holds only some); a ratio <= 1 matches."""
    worst, key = 0.0, ""
    for k, value in got.items():
        if k not in want:
            continue
        if value.shape != want[k].shape:
            return float("inf"), k
        moved = float((want[k].double() - initial[k].double()).abs().max()) if want[k].numel() else 0.0
        err = float((value.double() - want[k].double()).abs().max()) if value.numel() else 0.0
        ratio = err / (tol.atol + tol.rtol * moved)
        if ratio > worst or not key:
            worst, key = ratio, k
    return worst, key


def mismatches(losses: Sequence[float], weights: Sequence[dict[str, torch.Tensor]], want: Record,
               tol: Tolerance) -> list[str]:
    """Every step at which a run's loss or weights leave the reference's tolerance, described."""
    found = []
    if len(losses) != len(want.losses) or len(weights) != len(want.weights):
        found.append(f"{len(losses)} losses / {len(weights)} weight snapshots for {len(want.losses)} steps")
    for step, (got, ref) in enumerate(zip(losses, want.losses)):
        if not abs(got - ref) <= tol.loss:
            found.append(f"step {step}: loss {got:.6g} vs reference {ref:.6g} (|diff| > {tol.loss:g})")
    for step, (got_w, ref_w) in enumerate(zip(weights, want.weights)):
        extra = sorted(set(got_w) - set(ref_w))
        if extra:  # a checkpoint with these keys would not load into the user's model
            found.append(f"step {step}: state_dict keys the model does not have: {extra}")
        ratio, key = weights_error(got_w, ref_w, want.initial, tol)
        if not ratio <= 1.0:
            found.append(f"step {step}: {key} off by {ratio:.3g}x the tolerance (atol {tol.atol:g}, rtol {tol.rtol:g})")
    return found


def max_diff(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    """Largest absolute difference over the entries of `got` (all must exist in `want`, shapes equal)."""
    missing = sorted(set(got) - set(want))
    assert not missing, f"not in the reference: {missing}"
    return max((float((got[k].float() - want[k].float()).abs().max()) for k in got if got[k].numel()), default=0.0)
