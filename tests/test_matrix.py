"""The correctness matrix: every zoo model x every strategy layout x micro-batches 1 and 4 (4 only for the
interleaved and zero-bubble schedules, ddp+pp and ddp+mp: matrix_cells.LAYOUTS), fed through
paratrain's loader with a short last batch (split unevenly over data-parallel replicas: 5 rows as 3 and 2)
and an evaluation pass. Each cell either trains like the plain-PyTorch reference (losses and
weights at every step, within the case's fp32 tolerance) or is refused by a ParatrainError that names the
cause and the fix. The refusals are listed in matrix_refused.txt, so the set is visible and can only shrink: a
refused cell that starts to work, or a working cell that starts to be refused, fails this test. Each cell also
checks that the work was spread as its layout says (`spread`): FSDP ranks hold shards, pipeline ranks their
stages, model-parallel processes two stages.

Dropout cases are compared with a reference that restates paratrain's documented layout-independent masks
(zoo/dropout_rule.py), so they check the layouts against the rule, not the rule itself; test_dropout_stats.py
checks the masks against statistics. bf16 cells (BF16_LAYOUTS x BF16_MODELS, and Hugging Face Llama under tp
and fsdp+tp: BF16_TENSOR) are compared with plain torch.autocast, and every rank's
weights must differ from float32 by more than zoo.compare.AUTOCAST_FLOOR (a rank that silently dropped autocast
fails). Clipping cells (`clip`) clip the gradients by the whole model's norm with run.clip_grad_norm_
against torch.nn.utils.clip_grad_norm_ in the plain loop, in every column, at a max_norm every step exceeds.
Loop cells (`loop`) run a fine-tuning loop instead of plain SGD, in every column: two accumulation micro-steps per
optimizer step, the embeddings frozen, AdamW and a LambdaLR warm-up stepped on `run.sync_step`
(matrix_cells.LOOP_*), against the same loop in plain PyTorch (weights at ADAM_RTOL of their movement).
Activation-checkpointing cells (`ac=full`, `ac=selective`, alternating by column) recompute in the backward
and must still match the plain loop without checkpointing, with every block (every layer of a pipeline
stage) of every rank checkpointed. Compile cells (`compiled`, COMPILE_MODELS) run setup(compile="aot_eager"):
every block (every layer of a stage) of every rank compiled, and the results equal to the plain eager loop.
"""

from __future__ import annotations

import os
from dataclasses import replace
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import zoo
from helpers import refused_list
from matrix_cells import (
    BY_NAME,
    CLIP,
    EVAL_ROWS,
    LAYOUTS,
    LOOP_ACCUM,
    LOOP_OPTIM,
    Cell,
    loop_frozen,
    loop_lr,
    loop_sizes,
    run_column,
    spread,
)
from zoo.compare import AUTOCAST_FLOOR, max_diff, mismatches
from zoo.dropout_rule import applies_to, layout_rule
from zoo.reference import Record, eval_batch, global_batches, run_reference, torch_rng

import paratrain

BATCHNORM = [name for name, case in zoo.MODELS.items() if case.has(zoo.case.BATCHNORM)]

REFUSED_FILE = Path(__file__).with_name("matrix_refused.txt")


def refused_cells() -> tuple[dict[str, str], int]:
    """The refused cells (label -> text the refusal must contain) and the count recorded in the file."""
    return refused_list(REFUSED_FILE)


REFUSED, RECORDED = refused_cells()
BF16_MODELS = ("mlp", "gpt", "llama")
BF16_LAYOUTS = ("single", "ddp", "fsdp", "mp", "pp-gpipe")
BF16_TENSOR = {"tp": "hf_llama", "fsdp+tp": "hf_llama"}
"""bf16 under tensor parallelism: DTensor shards computing under autocast, and FSDP2 gathering them in bf16 beside
the tensor axis; Hugging Face Llama, the transformer the tp columns shard whole (the others are refused there)."""
CLIP_MODELS = ("gpt", "hf_llama")
"""Gradient clipping by the whole model's norm, one cell a column, the first of these the column trains: GPT,
whose head is tied to its embedding (a pipeline holds the tie on two ranks, to be counted once), or, where
tensor parallelism refuses GPT's fused projection, Hugging Face Llama, whose blocks it shards."""


COMPILE_MODELS = {"fsdp": "gpt", "pp-1f1b": "gpt_dropout", "pp-zero-bubble": "gpt_dropout", "tp": "hf_llama",
                  "fsdp+pp": "gpt"}
"""The compile cells, one in each of these columns: each way a layout changes what is compiled. FSDP2 shards
compiled blocks (their parameters become DTensors); a pipeline compiles the traced graphs of its stages, where the
GPT's dropout runs eagerly between compiled pieces; tensor parallelism compiles blocks of DTensor Linears; FSDP over
pipeline stages compiles graphs whose weights FSDP swaps at every call; zero-bubble refuses it. Compiling costs
10-30 s of CPU a cell here (the suite measured 100 s more with eight compiled columns than with three), so the
columns left out are those made of these pieces (single and nn.Dropout modules between compiled blocks:
tests/test_compile.py; ddp wraps the blocks single compiles; mp, pp-gpipe, pp-interleaved, ddp+pp and ddp+mp run
pp's compiled stage graphs; fsdp+tp, ddp+tp, tp+pp and fsdp+tp+pp compose the tp and fsdp+pp cells' pieces).
`make test-compile` (COMPILE_EVERYWHERE) runs a compile cell in every column."""


COMPILE_EVERYWHERE = os.environ.get("PARATRAIN_MATRIX_COMPILE") == "all"
"""`make test-compile` sets it: the columns run only their compile cells, one in every column (the first of
COMPILE_FALLBACK the column trains and does not refuse where COMPILE_MODELS names none): the check behind "compile
works under every layout" that CI's time budget leaves out (CI runs the COMPILE_MODELS cells)."""
COMPILE_FALLBACK = ("gpt_dropout", "gpt", "hf_llama")


ADAM_RTOL = 1e-2
"""Weights of the loop cells (AdamW) are compared relative to how far they moved at 1% (fp32 SGD cells: 0.1%):
Adam divides each gradient by its own running magnitude, so where a gradient is near zero the float noise of
another summation order moves the update by a visible share (measured: 0.33% of the movement, ddp+pp). Losses keep
the case's tolerance."""


AC_MODELS = ("gpt_dropout", "hf_llama")
"""Activation checkpointing, one cell a column, the first of these the column trains: the GPT with dropout (the
recomputation must draw the forward's masks again) or, under tensor parallelism, Hugging Face Llama."""


def expected_refusal(cell: Cell) -> str | None:
    return REFUSED.get(cell.label)


def test_refused_set_only_shrinks() -> None:
    """Every refused cell exists in the matrix, and the set is as large as the count recorded with it: a new
    refusal must raise the count in the same change, where a reviewer sees it."""
    every = {cell.label for layout in LAYOUTS for cell in cells_of(layout.name)}
    assert not set(REFUSED) - every, f"refused cells the matrix does not have: {sorted(set(REFUSED) - every)}"
    assert len(REFUSED) <= RECORDED, (f"{len(REFUSED)} refused cells, but {REFUSED_FILE.name} records {RECORDED}: "
                                      "a cell that trained is refused now; fix it rather than list it")
    assert len(REFUSED) == RECORDED, f"the refused set shrank to {len(REFUSED)}: lower the recorded count to match"


SLOW_LAYOUTS = ("mp",)
"""The layout ResNet-50 (a slow case: 25M parameters, 15-20 s a cell) is tried in: the tutorials' model split
over two devices (pipelined with micro-batches by `mp` M=4, as their `split_size` loop
is); every other layout, DDP's all-reduced BatchNorm and multi-process pipelines included, is covered by the
small CNNs with BatchNorm (cnn_bn, cnn_bn_dropout)."""


CUT_MODELS = ("gpt_flat",)
"""Models for the layouts that cut the model (each with several micro-batches): what they test is where a
cut falls, which nothing else in the matrix depends on."""


def cells_of(layout: str) -> list[Cell]:
    column = BY_NAME[layout]
    models = [m for m in column.models or zoo.MODELS
              if (layout in SLOW_LAYOUTS or not zoo.MODELS[m].has(zoo.case.SLOW))
              and (m not in CUT_MODELS or column.microbatches[-1] is not None)]
    cells = [Cell(model, layout, mb) for model in models for mb in column.microbatches
             if model not in CUT_MODELS or mb == column.microbatches[-1]]
    if layout in BF16_LAYOUTS:
        cells += [Cell(model, layout, BY_NAME[layout].microbatches[0], "bf16") for model in BF16_MODELS]
    cells += [Cell(model, layout, None, "bf16") for model in [BF16_TENSOR.get(layout)] if model in models]
    first = BY_NAME[layout].microbatches[-1]  # pipelines: M=4, several micro-batches per stage
    clipped = [m for m in CLIP_MODELS if m in models and Cell(m, layout, first).label not in REFUSED][:1]
    recomputed = [m for m in AC_MODELS if m in models and Cell(m, layout, first).label not in REFUSED][:1]
    looped = clipped if "loop" in column.extras else []
    clipped = clipped if "clip" in column.extras else []
    recomputed = recomputed if "ac" in column.extras else []
    compiled = [m for m in [COMPILE_MODELS.get(layout)] if m in models]
    if COMPILE_EVERYWHERE:
        compiled = compiled or [m for m in COMPILE_FALLBACK
                                if m in models and Cell(m, layout, first).label not in REFUSED][:1]
        return [Cell(model, layout, first, compiled=True) for model in compiled]
    mode = ("selective", "full")[[c.name for c in LAYOUTS].index(layout) % 2]  # zero-bubble: full
    return (cells + [Cell(model, layout, first, clip=True) for model in clipped]
            + [Cell(model, layout, first, loop=True) for model in looped]
            + [Cell(model, layout, first, checkpointing=mode) for model in recomputed]
            + [Cell(model, layout, first, compiled=True) for model in compiled])


@cache
def reference(model: str, sizes: tuple[int, ...], precision: str, clip: bool = False, loop: bool = False) -> Record:
    case = zoo.MODELS[model]
    rule = layout_rule if applies_to(case.build(0)) else torch_rng
    loop_options: dict[str, Any] = ({"optim": LOOP_OPTIM, "accumulate": LOOP_ACCUM, "frozen": loop_frozen,
                                     "lr_factor": loop_lr} if loop else {})
    record = run_reference(case, global_batches(case, 0, sizes), precision=precision, dropout=rule,
                           evaluate=eval_batch(case, rows=EVAL_ROWS), clip=CLIP if clip else None, **loop_options)
    assert not clip or min(record.grad_norms) > 2 * CLIP, f"{model}: norms {record.grad_norms} would not be clipped"
    return record


def _compare(cell: Cell, results: list[dict[str, Any]]) -> list[str]:
    case = zoo.MODELS[cell.model]
    layout = BY_NAME[cell.layout]
    want = reference(cell.model, loop_sizes(layout) if cell.loop else layout.sizes, cell.precision, cell.clip,
                     cell.loop)
    tol = case.tolerances[cell.precision]
    if cell.loop:
        tol = replace(tol, rtol=max(tol.rtol, ADAM_RTOL))
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
        for result in results:  # every rank: a stage that dropped autocast must show too
            common = {k: v for k, v in result["weights"][-1].items() if k in fp32.weights[-1]}
            if max_diff(common, fp32.weights[-1]) <= AUTOCAST_FLOOR:
                problems.append(f"rank {result['rank']}: bf16 weights equal the float32 reference's: autocast did "
                                "not run")
    if cell.checkpointing != "none":
        problems += [f"rank {r['rank']}: {r['checkpointed'][0]} of {r['checkpointed'][1]} units checkpointed"
                     for r in results if r["checkpointed"][0] != r["checkpointed"][1] or not r["checkpointed"][1]]
    if cell.compiled:
        problems += [f"rank {r['rank']}: {r['compiled'][0]} of {r['compiled'][1]} units compiled, dynamo gave up "
                     f"on {r['compiled'][2]} frame(s)" for r in results
                     if r["compiled"][0] != r["compiled"][1] or not r["compiled"][1] or r["compiled"][2]]
    return problems + spread(BY_NAME[cell.layout].strategy, [r["where"] for r in results])



HALVES = (("single", "ddp", "fsdp", "mp", "ddp+mp", "pp-1f1b", "ddp+tp", "fsdp+pp"),
          ("pp-gpipe", "pp-interleaved", "pp-zero-bubble", "ddp+pp", "tp", "fsdp+tp", "tp+pp", "fsdp+tp+pp"))
"""The columns in two halves of about equal time, one class each, so that `pytest -n N --dist loadscope` (make
test) runs them on two workers side by side."""
assert sorted(HALVES[0] + HALVES[1]) == sorted(layout.name for layout in LAYOUTS)


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.usefixtures("traced_workers")
class _Columns:
    def test_every_model_matches_or_is_refused_by_name(self, layout: str) -> None:
        check_column(layout)


@pytest.mark.parametrize("layout", HALVES[0])
class TestDataAndModelParallelColumns(_Columns):
    pass


@pytest.mark.parametrize("layout", HALVES[1])
class TestPipelineColumns(_Columns):
    pass


def check_column(layout: str) -> None:
    """Every cell of one layout matches the reference or is refused as matrix_refused.txt says."""
    spec = BY_NAME[layout]
    cells = cells_of(layout)
    if spec.nproc == 1 and spec.microbatches == (None,):
        outcomes = [run_column(cells)]  # nothing to trace: in this process (`mp`, one process too, traces every
        # model: its worker forks from the template that holds the traces, rather than loading them all here)
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
