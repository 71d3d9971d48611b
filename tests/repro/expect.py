"""The checks of the reproductions. Each test asserts the one outcome its case has: a run that matches plain
PyTorch at every step (`check_results`), or a `ParatrainError` that names the user's own module and says why
(`check_refusal`). A test never accepts either, so a fixed case cannot regress into a refusal unseen; a raw
torch error, a generated name (`submod_pp_1`) or a silent mismatch fails."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import zoo
from zoo.case import Batch, Tolerance
from zoo.compare import mismatches
from zoo.reference import Record, global_batches, run_reference

import paratrain


def reference(case: zoo.ZooCase | str, sizes: Sequence[int] = (8, 8), evaluate: Batch | None = None) -> Record:
    """Plain PyTorch on the batches `loop.train` uses for the same sizes and seed 0."""
    case = zoo.MODELS[case] if isinstance(case, str) else case
    return run_reference(case, global_batches(case, 0, sizes), evaluate=evaluate)


def refusal(exc: BaseException) -> paratrain.ParatrainError | None:
    """The library's own refusal in `exc` (a worker's, through WorkerFailed), or None for anything else."""
    if isinstance(exc, paratrain.WorkerFailed):
        inner = exc.error
        return refusal(inner) if inner is not None and not isinstance(inner, paratrain.WorkerFailed) else None
    return exc if isinstance(exc, paratrain.ParatrainError) else None


def check_refusal(exc: BaseException, names: Sequence[str], reasons: Sequence[str] = ()) -> None:
    """`exc` is a clear refusal: a ParatrainError naming one of `names` and containing every text of `reasons`
    (so a refusal for another cause fails), no generated names (anything else is re-raised)."""
    error = refusal(exc)
    if error is None:
        raise exc
    message = str(error)
    assert "submod_" not in message, f"the refusal names a generated module, not the user's: {message}"
    assert any(n in message for n in names), f"the refusal names none of {list(names)}: {message}"
    missing = [r for r in reasons if r not in message]
    assert not missing, f"the refusal does not say {missing}: {message}"


def check_results(results: Sequence[dict[str, Any]], want: Record, tol: Tolerance) -> None:
    """Every rank's losses and weights match the reference at every step, and the ranks together hold
    every entry of the model's state_dict."""
    for result in results:
        problems = mismatches(result["losses"], result["weights"], want, tol)
        assert not problems, f"rank {result['rank']} trained differently from plain PyTorch:\n" + "\n".join(problems)
    held = set().union(*(r["weights"][-1].keys() for r in results))
    lost = sorted(set(want.weights[-1]) - held)
    assert not lost, f"no rank holds {lost}"

