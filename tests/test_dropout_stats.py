"""paratrain's dropout checked against statistics, not against its own rule.

The correctness matrix compares dropout cases with a reference that restates the library's mask rule
(zoo/dropout_rule.py), so a flaw of the rule itself (masks that repeat across rows, steps or layers, a wrong
rate or scale) would be drawn identically on both sides and pass. Here the masks paratrain draws are
observed with forward hooks on the `nn.Dropout` modules and held to what dropout must be: a fraction p
of the elements zeroed (a binomial bound), the rest scaled by 1/(1 - p), masks independent between steps,
rows, positions and layers, none in eval mode, and, as docs/parallelism.md ("Randomness") promises, the
same mask for the same sample row whatever the layout (one process, ddp over 2 workers, a 2-stage pipeline
with 2 micro-batches).

The masks are a deterministic function of the seeds used here, so these checks never flake: a bound at
SIGMAS standard deviations either holds for these masks or the rule changed.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import pytest
import torch
import zoo
from torch import nn

import paratrain

P = 0.25
ROWS, COLS, STEPS = 32, 512, 3
"""Per step ROWS x COLS = 16384 dropout elements, 49152 over the steps."""
MICRO = 2
SIGMAS = 5.0
"""A bound at 5 standard deviations: a correct rule fails it about once in 1.7 million seeds."""

Seen = list[tuple[torch.Tensor, torch.Tensor]]
"""(input, output) of every call of one dropout module."""


def _model() -> nn.Sequential:
    """Linear -> Dropout -> Linear: the dropout's input is a nonzero activation, so every zero it outputs is a
    dropped element. Under pp with balance [1, 2] the dropout runs on rank 1, away from the first stage."""
    with zoo.case.seeded(0):
        return nn.Sequential(nn.Linear(COLS, COLS), nn.Dropout(P), nn.Linear(COLS, 1))


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(ROWS, COLS, generator=g), torch.randn(ROWS, 1, generator=g)) for _ in range(STEPS)]


def _observe(modules: Mapping[str, nn.Module]) -> dict[str, Seen]:
    """Forward hooks that record each module's (input, output) pairs, by name."""
    seen: dict[str, Seen] = {name: [] for name in modules}
    for name, module in modules.items():
        def hook(m: nn.Module, args: tuple[Any, ...], out: torch.Tensor, name: str = name) -> None:
            seen[name].append((args[0].detach().clone(), out.detach().clone()))

        module.register_forward_hook(hook)
    return seen


def _train(strategy: str, seed: int = 0, between: Callable[..., Any] | None = None,
           **options: Any) -> dict[str, Any]:
    """STEPS steps of `_model` with run.forward_backward, then one run.evaluate; returns the dropout's
    (input, output) of each step's training forwards (this rank's rows, in row order; None where this rank
    does not hold the dropout) and of the evaluation. `between(run, model, x)` runs after every step."""
    run = paratrain.setup(strategy=strategy, seed=seed, timeout_s=60, **options)
    model = _model()
    seen = _observe({"drop": model[1]})["drop"]
    data = _batches()
    model, optimizer = run.prepare(model, torch.optim.SGD(model.parameters(), lr=0.01), example=data[0][0])
    seen.clear()  # prepare may run the model (tracing, measuring)
    steps: list[tuple[torch.Tensor, torch.Tensor] | None] = []
    for x, y in data:
        if strategy == "ddp":
            x, y = x.chunk(run.world_size)[run.rank], y.chunk(run.world_size)[run.rank]
        run.forward_backward(model, x, y, nn.functional.mse_loss)
        optimizer.step()
        optimizer.zero_grad()
        # A pipeline's micro-batches run in order; torch adds a shape-learning forward before the first step's.
        real = seen[-options.get("microbatches", 1):]
        steps.append((torch.cat([i for i, _ in real]), torch.cat([o for _, o in real])) if real else None)
        seen.clear()
        if between is not None:
            between(run, model, x)
            seen.clear()
    run.evaluate(model, data[0][0].chunk(run.world_size)[run.rank] if strategy == "ddp" else data[0][0])
    result = {"steps": steps, "eval": list(seen), "rank": run.rank}
    run.close()
    return result


def _kept(step: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """The step's keep mask (True where the dropout kept the element)."""
    inputs, outputs = step
    assert bool((inputs != 0).all()), "a zero input: dropped elements cannot be told apart"
    return outputs != 0


def _check_rate(hits: int, n: int, q: float, what: str) -> float:
    """`hits` of `n` independent trials of probability `q` is within SIGMAS standard deviations; returns the
    bound on the fraction."""
    bound = SIGMAS * math.sqrt(q * (1 - q) / n)
    assert abs(hits / n - q) <= bound, f"{what}: {hits}/{n} = {hits / n:.4f}, want {q:.4f} +- {bound:.4f}"
    return bound


def _check_scale(inputs: torch.Tensor, outputs: torch.Tensor, kept: torch.Tensor, p: float) -> None:
    """Kept elements are the input times 1/(1 - p) (to float32 rounding), dropped ones exactly 0."""
    torch.testing.assert_close(outputs[kept], inputs[kept] / (1 - p), rtol=3e-7, atol=0.0)
    assert bool((outputs[~kept] == 0).all())


@pytest.fixture(scope="module")
def single() -> dict[str, Any]:
    return _train("single")


@pytest.fixture(scope="module")
def launched() -> list[dict[str, dict[str, Any]]]:
    """ddp then pp in the same 2 workers: one launch."""
    return paratrain.launch(_two_layouts, nproc=2, timeout=60, all_ranks=True, accelerator="cpu")


def _two_layouts() -> dict[str, dict[str, Any]]:
    return {"ddp": _train("ddp"),
            "pp": _train("pp", microbatches=MICRO, schedule="gpipe", balance=[1, 2])}


def test_a_fraction_p_is_dropped_and_the_rest_is_scaled(single: dict[str, Any]) -> None:
    """Over all steps the zeroed fraction is p within SIGMAS binomial deviations; every row's and column's
    fraction too (no row or position is dropped always or never); every kept element is scaled by 1/(1-p)."""
    masks = torch.stack([_kept(step) for step in single["steps"]])  # (steps, rows, cols)
    dropped = ~masks
    _check_rate(int(dropped.sum()), dropped.numel(), P, "dropped fraction")
    for r in range(ROWS):
        _check_rate(int(dropped[:, r].sum()), STEPS * COLS, P, f"dropped fraction of row {r}")
    for c in range(COLS):
        _check_rate(int(dropped[:, :, c].sum()), STEPS * ROWS, P, f"dropped fraction of column {c}")
    for (inputs, outputs), kept in zip(single["steps"], masks):
        _check_scale(inputs, outputs, kept, P)


def test_masks_are_independent_between_steps_rows_and_positions(single: dict[str, Any]) -> None:
    """Independent masks drop both elements of a pair with probability p**2; tested on disjoint pairs (so the
    counts are binomial) of the same element at consecutive steps, of consecutive rows and of neighbouring
    positions. No two rows and no two steps share a mask; another seed gives other masks."""
    dropped = ~torch.stack([_kept(step) for step in single["steps"]])
    steps = dropped[:-1] & dropped[1:]
    _check_rate(int(steps.sum()), steps.numel(), P**2, "dropped at the same place in consecutive steps")
    rows = dropped[:, 0::2] & dropped[:, 1::2]
    _check_rate(int(rows.sum()), rows.numel(), P**2, "dropped at the same position in rows 2k and 2k+1")
    cols = dropped[:, :, 0::2] & dropped[:, :, 1::2]
    _check_rate(int(cols.sum()), cols.numel(), P**2, "dropped at positions 2k and 2k+1 of a row")
    for s, mask in enumerate(dropped):
        assert len(torch.unique(mask, dim=0)) == ROWS, f"step {s}: two rows share a mask"
    assert len(torch.unique(dropped.flatten(1), dim=0)) == STEPS, "two steps share a mask"
    other = _train("single", seed=1)
    assert not any(torch.equal(_kept(a), _kept(b)) for a, b in zip(single["steps"], other["steps"])), \
        "seed 1 draws the masks of seed 0"


def test_masks_do_not_depend_on_the_layout(single: dict[str, Any], launched: list[dict[str, dict[str, Any]]]) -> None:
    """docs/parallelism.md, "Randomness": the same sample row gets the same mask in one process, under ddp over
    2 workers (rows 16-31 on rank 1) and in a 2-stage pipeline whose dropout sits on rank 1 and sees the batch as
    2 micro-batches. Rank 1 seeds torch's generator differently from one process, so masks drawn from it fail."""
    for step in range(STEPS):
        want = _kept(single["steps"][step])
        shares = [by_rank["ddp"]["steps"][step] for by_rank in launched]
        assert all(share is not None for share in shares)
        ddp = torch.cat([_kept(share) for share in shares])  # type: ignore[arg-type]
        assert torch.equal(ddp, want), f"step {step}: ddp rows differ from one process in {(ddp != want).sum()}"
        stage = launched[1]["pp"]["steps"][step]
        assert launched[0]["pp"]["steps"][step] is None and stage is not None, "the dropout is not on rank 1"
        pp = _kept(stage)
        assert torch.equal(pp, want), f"step {step}: pp rows differ from one process in {(pp != want).sum()}"
        _check_scale(stage[0], stage[1], pp, P)


def test_eval_mode_applies_no_dropout(single: dict[str, Any], launched: list[dict[str, dict[str, Any]]]) -> None:
    """run.evaluate passes the dropout's input through unchanged, in one process, under ddp and in a pipeline."""
    evaluations = [("single", single["eval"])]
    evaluations += [(f"{layout} rank {r}", by_rank[layout]["eval"]) for r, by_rank in enumerate(launched)
                    for layout in ("ddp", "pp")]
    assert single["eval"] and launched[0]["ddp"]["eval"] and launched[1]["pp"]["eval"], "the dropout never ran"
    for where, calls in evaluations:
        for inputs, outputs in calls:  # NaN equals NaN: a pipeline stage's first call (torch's shape-learning
            same = (inputs == outputs) | (inputs.isnan() & outputs.isnan())  # forward) sees uninitialised memory
            assert bool(same.all()), f"{where}: evaluation changed {int((~same).sum())} elements"


def _evaluate(run: paratrain.Run, model: nn.Module, x: torch.Tensor) -> None:
    run.evaluate(model, x)


def test_evaluating_between_steps_leaves_the_training_masks_alone(single: dict[str, Any]) -> None:
    """A mask is a function of (seed, micro-step, layer, call within that forward, row, position): evaluating
    the model between training steps must not change the masks of the steps after it."""
    evaluated = _train("single", between=_evaluate)
    for step, (want, got) in enumerate(zip(single["steps"], evaluated["steps"])):
        assert torch.equal(_kept(got), _kept(want)), f"step {step}: an evaluation before it changed its masks"


def test_every_dropout_layer_of_gpt_dropout() -> None:
    """The zoo's GPT with dropout 0.1 (embeddings, attention probabilities, residuals, MLP), 2 steps in one
    process: every layer drops p of its nonzero inputs (attention probabilities above the causal mask are 0
    already) within the binomial bound and scales the rest; layers of one shape draw different masks, the
    same-named layers of the two blocks included (the layer's path, not its name within a block, keys it)."""
    case = zoo.MODELS["gpt_dropout"]
    run = paratrain.setup(strategy="single", seed=0, timeout_s=60)
    model = case.build(0)
    drops = {name: m for name, m in model.named_modules() if isinstance(m, nn.Dropout)}
    p = next(iter(drops.values())).p
    assert len(drops) == 7 and all(m.p == p > 0 for m in drops.values())
    seen = _observe(drops)
    batches = [case.batch(step, 8) for step in range(2)]
    model, optimizer = run.prepare(model, torch.optim.SGD(model.parameters(), lr=case.lr), example=batches[0][0])
    for calls in seen.values():
        calls.clear()
    for inputs, targets in batches:
        run.forward_backward(model, inputs, targets, case.loss_fn)
        optimizer.step()
        optimizer.zero_grad()
    run.close()
    total = hits = 0
    for name, calls in seen.items():
        assert len(calls) == 2, f"{name} ran {len(calls)} times in 2 steps"
        live = torch.stack([i for i, _ in calls]) != 0
        out = torch.stack([o for _, o in calls])
        dropped = live & (out == 0)
        _check_rate(int(dropped.sum()), int(live.sum()), p, f"{name}: dropped fraction of nonzero inputs")
        _check_scale(torch.stack([i for i, _ in calls]), out, live & (out != 0), p)
        total, hits = total + int(live.sum()), hits + int(dropped.sum())
    _check_rate(hits, total, p, "dropped fraction over every layer")
    residual = [name for name, calls in seen.items() if calls[0][0].shape == seen["drop"][0][0].shape]
    assert len(residual) == 5
    for a in residual:
        for b in residual[residual.index(a) + 1:]:
            assert not torch.equal(seen[a][0][1] == 0, seen[b][0][1] == 0), f"{a} and {b} draw the same mask"
    both = (seen["blocks.0.mlp.3"][0][1] == 0) & (seen["blocks.1.mlp.3"][0][1] == 0)
    _check_rate(int(both.sum()), both.numel(), p**2, "dropped at the same place by blocks.0.mlp.3 and blocks.1.mlp.3")
