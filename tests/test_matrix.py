"""The correctness matrix: every zoo model x every strategy layout x micro-batches 1 and 4, with a short
last batch and an evaluation pass. Each cell either trains like the plain-PyTorch reference (losses and
weights at every step, within the case's fp32 tolerance) or is refused by a ParatrainError that names the
cause and the fix. The refusals are listed below, so the set is visible and can only shrink: a refused cell
that starts to work, or a working cell that starts to be refused, fails this test.

Dropout cases are compared with a reference that draws paratrain's documented layout-independent masks
(zoo/dropout_rule.py); bf16 cells with plain torch.autocast, and must differ from float32 by more than
zoo.compare.AUTOCAST_FLOOR (a run that silently dropped autocast fails).
"""

from __future__ import annotations

import fnmatch
from functools import cache
from typing import Any

import pytest
import zoo
from matrix_cells import BY_NAME, EVAL_ROWS, LAYOUTS, Cell, run_column
from zoo.compare import AUTOCAST_FLOOR, max_diff, mismatches
from zoo.dropout_rule import applies_to, layout_rule
from zoo.reference import Record, eval_batch, global_batches, run_reference, torch_rng

import paratrain

BATCHNORM = [name for name, case in zoo.MODELS.items() if case.has(zoo.case.BATCHNORM)]

REFUSED: dict[tuple[str, str, int | None], str] = {
    # 1F1B runs at least as many micro-batches as stages.
    ("*", "pp-1f1b", 1): "needs at least as many micro-batches as stages",
    # BatchNorm over a split batch has no exact form on CPU workers or across micro-batches
    # (setup(batchnorm="local") opts in to per-part statistics; docs/parallelism.md).
    **{(m, layout, None): "batchnorm='local'" for m in BATCHNORM for layout in ("ddp", "fsdp")},
    **{(m, layout, mb): "batchnorm='local'" for m in BATCHNORM for layout in ("ddp+mp", "ddp+pp") for mb in (1, 4)},
    **{(m, layout, 4): "batchnorm='local'" for m in BATCHNORM
       for layout in ("mp", "pp-gpipe", "pp-1f1b", "pp-interleaved", "pp-zero-bubble")},
}
BF16_MODELS = ("mlp", "gpt", "llama")
BF16_LAYOUTS = ("single", "ddp", "fsdp", "mp", "pp-gpipe")


def expected_refusal(cell: Cell) -> str | None:
    for (model, layout, mb), text in REFUSED.items():
        if fnmatch.fnmatch(cell.model, model) and layout == cell.layout and mb == cell.microbatches:
            return text
    return None


def cells_of(layout: str) -> list[Cell]:
    cells = [Cell(model, layout, mb) for model in zoo.MODELS for mb in BY_NAME[layout].microbatches]
    if layout in BF16_LAYOUTS:
        cells += [Cell(model, layout, BY_NAME[layout].microbatches[0], "bf16") for model in BF16_MODELS]
    return cells


@cache
def reference(model: str, sizes: tuple[int, ...], precision: str) -> Record:
    case = zoo.MODELS[model]
    rule = layout_rule if applies_to(case.build(0)) else torch_rng
    return run_reference(case, global_batches(case, 0, sizes), precision=precision, dropout=rule,
                         evaluate=eval_batch(case, rows=EVAL_ROWS))


def _compare(cell: Cell, results: list[dict[str, Any]]) -> list[str]:
    case = zoo.MODELS[cell.model]
    want = reference(cell.model, BY_NAME[cell.layout].sizes, cell.precision)
    tol = case.tolerances[cell.precision]
    if case.has(zoo.case.SLOW):  # the final weights only: a ResNet-50 state per step is hundreds of MB
        want = Record(initial=want.initial, losses=want.losses, weights=want.weights[-1:], eval_loss=want.eval_loss)
    problems = []
    for result in results:
        problems += [f"rank {result['rank']}: {p}" for p in mismatches(result["losses"], result["weights"], want, tol)]
        if result["eval_loss"] is not None and not abs(result["eval_loss"] - want.eval_loss) <= tol.loss:
            problems.append(f"rank {result['rank']}: evaluation loss {result['eval_loss']:.6g} vs reference "
                            f"{want.eval_loss:.6g}")
    held = set().union(*(r["weights"][-1].keys() for r in results))
    lost = sorted(set(want.weights[-1]) - held)
    if lost:
        problems.append(f"no rank holds {lost}")
    if cell.precision == "bf16":
        fp32 = reference(cell.model, BY_NAME[cell.layout].sizes, "fp32")
        common = {k: v for k, v in results[0]["weights"][-1].items() if k in fp32.weights[-1]}
        if max_diff(common, fp32.weights[-1]) <= AUTOCAST_FLOOR:
            problems.append("bf16 weights equal the float32 reference's: autocast did not run")
    return problems


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("layout", [layout.name for layout in LAYOUTS])
def test_every_model_matches_or_is_refused_by_name(layout: str) -> None:
    spec = BY_NAME[layout]
    cells = cells_of(layout)
    if spec.nproc == 1:
        outcomes = [run_column(cells)]
    else:
        outcomes = paratrain.launch(run_column, cells, nproc=spec.nproc, timeout=840, all_ranks=True,
                                    accelerator="cpu")
    failures = []
    for cell in cells:
        kinds = {o[cell.label][0] for o in outcomes}
        expected = expected_refusal(cell)
        if "refused" in kinds:
            message = next(o[cell.label][1] for o in outcomes if o[cell.label][0] == "refused")
            if expected is None:
                failures.append(f"{cell.label}: refused, but expected to match: {message[:400]}")
            elif expected not in message:
                failures.append(f"{cell.label}: refused with {message[:300]!r}; the expected reason says {expected!r}")
            elif "submod_" in message:
                failures.append(f"{cell.label}: the refusal names a generated module: {message[:300]}")
            continue
        if expected is not None:
            failures.append(f"{cell.label}: works now; remove it from REFUSED (it expected {expected!r})")
            continue
        problems = _compare(cell, [o[cell.label][1] for o in outcomes])
        if problems:
            failures.append(f"{cell.label}: " + "; ".join(problems[:4]))
    assert not failures, f"{len(failures)} of {len(cells)} cells:\n" + "\n".join(failures)
