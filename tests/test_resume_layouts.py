"""Universal resume: a checkpoint written under any layout loads under every other one.

Hugging Face's LlamaForCausalLM trains 2 steps with AdamW and a warm-up/cosine LR schedule under each
layout of the grid and saves; then every layout loads every checkpoint. Right after the load, the whole
weights, both Adam moments, Adam's step count and the scheduler equal the saving run's exactly (the
checkpoint moved, nothing was recomputed); the next step then matches a plain PyTorch loop that never
stopped (Adam's tolerance: weights within 1e-4 of their movement, since Adam turns float noise in
near-zero gradients into lr-sized steps), which takes every param-group option (lr, betas, eps, weight
decay) and the scheduler's next factor to hold.

The grid is the matrix's transformer column: every layout it trains Hugging Face Llama under, each pipeline
schedule family once (4 stages as 2 per worker under pp, 2 stages of replicas under ddp+pp, of FSDP shards under
fsdp+pp, of tensor-parallel DTensor shards under tp+pp), so a move between them changes the split, the sharding,
the tensor degree and the replicas; world sizes run 1, 2 and 4, so every pair also changes the world size or the
strategy; fsdp+tp and ddp+tp hold DTensors on a 2-D mesh; mp and ddp+mp split the model over devices in a process.
Left out: fsdp+tp+pp (8 workers), which writes what fsdp+pp's shards and tp's DTensors write; pp's other
schedules, which hold the stages pp-4-stages and ddp+pp hold.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
import trace_cache
import zoo
from helpers import fork_from_traced_template, max_diff
from matrix_cells import full_state
from zoo.reference import chunk, global_batches

import paratrain

STEPS = 3
SAVED_AT = 2
SIZES = (8,) * STEPS
LAYOUTS: dict[str, tuple[str, int, dict[str, Any]]] = {
    "single": ("single", 1, {}),
    "fsdp": ("fsdp", 2, {}),
    "pp-4-stages": ("pp", 2, {"schedule": "interleaved-1f1b", "stages_per_worker": 2, "balance": "equal"}),
    "fsdp+pp": ("fsdp+pp", 4, {"schedule": "gpipe", "balance": "equal"}),
    "fsdp+tp": ("fsdp+tp", 4, {"tp_size": 2}),
    "tp+pp": ("tp+pp", 4, {"tp_size": 2, "schedule": "gpipe", "balance": "equal"}),
    "ddp": ("ddp", 2, {}),
    "tp": ("tp", 2, {}),
    "ddp+tp": ("ddp+tp", 4, {"tp_size": 2}),
    "ddp+pp": ("ddp+pp", 4, {"schedule": "1f1b", "microbatches": 2, "balance": "equal"}),
    "mp": ("mp", 1, {"devices": ["cpu", "cpu"], "balance": "equal"}),
    "ddp+mp": ("ddp+mp", 2, {"devices_per_worker": 2, "balance": "equal"}),
}


def _schedule(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
    def warmup_cosine(step: int) -> float:
        return (step + 1) / 2 if step < 2 else 0.5 * (1 + math.cos(math.pi * (step - 2) / STEPS))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine)


def _adamw(params: Any) -> torch.optim.Optimizer:
    # eps=1e-3: see tests/test_fsdp.py (a bias with an exactly-zero true gradient)
    return torch.optim.AdamW(params, lr=1e-2, betas=(0.8, 0.95), eps=1e-3, weight_decay=0.1)


def _whole(t: torch.Tensor) -> torch.Tensor:
    full = getattr(t, "full_tensor", None)
    return (full() if full is not None else t).detach().float().cpu().clone()


def _snapshot(run: Any, model: Any, optimizer: Any, scheduler: Any) -> dict[str, Any]:
    """Weights, moments and Adam step counts by parameter name, as this rank holds them."""
    inner = run.unwrap(model)
    moments: dict[str, torch.Tensor] = {}
    for name, p in inner.named_parameters():
        for key, value in optimizer.state.get(p, {}).items():
            moments[f"{name}.{key}"] = _whole(value)
    return {"weights": full_state(inner), "moments": moments, "lr": scheduler.get_last_lr(),
            "scheduler_step": scheduler.last_epoch}


def _steps(run: Any, model: Any, optimizer: Any, scheduler: Any, steps: range) -> None:
    case = zoo.MODELS["hf_llama"]
    replica, replicas = run.strategy.data_shard(run.ctx)
    batches = global_batches(case, 0, SIZES)
    for step in steps:
        inputs, targets = batches[step]
        run.forward_backward(model, chunk(inputs, replicas)[replica], chunk(targets, replicas)[replica],
                             case.loss_fn)
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()


def _prepared(layout: str) -> tuple[Any, Any, Any, Any]:
    case = zoo.MODELS["hf_llama"]
    strategy, _, options = LAYOUTS[layout]
    run = paratrain.setup(strategy=strategy, seed=0, accelerator="cpu", timeout_s=120, **options)
    replica, replicas = run.strategy.data_shard(run.ctx)
    model = case.build(0)
    with trace_cache.for_case("hf_llama"):  # traced once per test run, as in the matrix (tests/trace_cache.py)
        model, optimizer = run.prepare(model, _adamw(model.parameters()),
                                       example=chunk(global_batches(case, 0, SIZES)[0][0], replicas)[replica])
    return run, model, optimizer, _schedule(optimizer)


def _save(layout: str, root: str) -> dict[str, Any]:
    run, model, optimizer, scheduler = _prepared(layout)
    _steps(run, model, optimizer, scheduler, range(SAVED_AT))
    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "step": SAVED_AT}
    run.save(state, path=root)
    saved = _snapshot(run, model, optimizer, scheduler)
    run.close()
    return saved


def _load_each(layout: str, roots: list[str]) -> list[dict[str, Any]]:
    """Load every checkpoint in turn into one prepared run, snapshot, take the remaining steps, snapshot."""
    run, model, optimizer, scheduler = _prepared(layout)
    out = []
    for root in roots:
        state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "step": 0}
        error = None
        try:
            run.load(state, path=Path(root) / f"step-{SAVED_AT:09d}")
        except paratrain.ParatrainError as exc:
            error = f"{type(exc).__name__}: {exc}"[:600]
        if error is not None:
            out.append({"error": error})
            continue
        loaded = _snapshot(run, model, optimizer, scheduler)
        loaded["step"] = state["step"]
        _steps(run, model, optimizer, scheduler, range(SAVED_AT, STEPS))
        loaded["after"] = full_state(run.unwrap(model))
        out.append(loaded)
    run.close()
    return out


def _merged(per_rank: list[dict[str, Any]], key: str) -> dict[str, torch.Tensor]:
    """One dict over the ranks (pipeline stages hold different names; replicas and shards the same)."""
    out: dict[str, torch.Tensor] = {}
    for result in per_rank:
        out.update(result[key])
    return out


def _plain() -> list[dict[str, torch.Tensor]]:
    case = zoo.MODELS["hf_llama"]
    model = case.build(0)
    optimizer = _adamw(model.parameters())
    scheduler = _schedule(optimizer)
    weights = []
    for inputs, targets in global_batches(case, 0, SIZES):
        case.loss_fn(model(inputs), targets).backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        weights.append(full_state(model))
    return weights


def _launch(fn: Any, layout: str, *args: Any) -> list[Any]:
    _, nproc, _ = LAYOUTS[layout]
    return paratrain.launch(fn, layout, *args, nproc=nproc, timeout=200, accelerator="cpu", all_ranks=True)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[str, list[dict[str, Any]]]]:
    root = tmp_path_factory.mktemp("ckpt")
    out = {}
    with pytest.MonkeyPatch.context() as patch:
        fork_from_traced_template(patch)
        for layout in LAYOUTS:
            folder = str(root / layout.replace("+", "_"))
            out[layout] = (folder, _launch(_save, layout, folder))
    return out


@pytest.mark.timeout(600)
@pytest.mark.usefixtures("traced_workers")
@pytest.mark.parametrize("target", list(LAYOUTS))
def test_every_checkpoint_resumes_under(target: str, saved: dict[str, tuple[str, list[dict[str, Any]]]]) -> None:
    plain = _plain()
    initial = full_state(zoo.MODELS["hf_llama"].build(0))
    sources = list(saved)
    per_rank = _launch(_load_each, target, [saved[s][0] for s in sources])
    moved = max_diff(plain[-1], initial)
    assert max_diff(_merged(saved["single"][1], "weights"), initial) > 1e-3  # the checkpoints are not the start
    assert min(float(m.abs().max()) for k, m in _merged(saved["fsdp"][1], "moments").items() if "exp_avg" in k) > 0
    failures = []
    for i, source in enumerate(sources):
        ranks = [r[i] for r in per_rank]
        if "error" in ranks[0]:
            failures.append(f"{source} -> {target}: {ranks[0]['error']}")
            continue
        before = saved[source][1]
        weights, moments = _merged(ranks, "weights"), _merged(ranks, "moments")
        expected_weights, expected_moments = _merged(before, "weights"), _merged(before, "moments")
        problems = []
        if weights.keys() != expected_weights.keys() or max_diff(weights, expected_weights) != 0.0:
            problems.append("weights differ after the load")
        if moments.keys() != expected_moments.keys() or max_diff(moments, expected_moments) != 0.0:
            problems.append(f"optimizer state differs ({sorted(moments)[:3]} vs {sorted(expected_moments)[:3]})")
        if (ranks[0]["lr"], ranks[0]["scheduler_step"], ranks[0]["step"]) != (
                before[0]["lr"], before[0]["scheduler_step"], SAVED_AT):
            problems.append(f"scheduler {ranks[0]['lr']} at {ranks[0]['scheduler_step']}")
        after = _merged(ranks, "after")
        off = max_diff(after, plain[-1]) if after.keys() == plain[-1].keys() else math.inf
        if off > 1e-4 * moved:
            problems.append(f"a step later {off:.2e} from the plain loop (moved {moved:.2e})")
        if problems:
            failures.append(f"{source} -> {target}: " + "; ".join(problems))
    assert not failures, "\n".join(failures)


@pytest.mark.timeout(120)
def test_another_model_is_refused_by_name(saved: dict[str, tuple[str, list[dict[str, Any]]]]) -> None:
    """What may not change: the model. Both kinds of checkpoint refuse it, naming what does not fit."""
    case = zoo.MODELS["llama"]
    for source, said in (("single", "does not fit this state"), ("fsdp", "does not fit this model")):
        run = paratrain.setup(strategy="single", seed=0, accelerator="cpu")
        model = case.build(0)
        model, optimizer = run.prepare(model, _adamw(model.parameters()))
        with pytest.raises(paratrain.CheckpointError, match=said) as caught:
            run.load({"model": model, "optimizer": optimizer}, path=Path(saved[source][0]) / f"step-{SAVED_AT:09d}")
        assert "layers" in str(caught.value) or "blocks" in str(caught.value), caught.value
        run.close()


def _save_lora(root: str) -> dict[str, torch.Tensor]:
    """LoRA fine-tuning (peft) under pp, 4 stages as 2 per worker: two AdamW steps on the adapters, then a save."""
    case = zoo.MODELS["hf_llama_lora"]
    run = paratrain.setup(strategy="pp", schedule="interleaved-1f1b", stages_per_worker=2, balance="equal",
                          microbatches=2, seed=0, accelerator="cpu", timeout_s=120)
    model = case.build(0)
    batches = global_batches(case, 0, SIZES)
    with trace_cache.for_case("hf_llama_lora"):
        model, optimizer = run.prepare(model, _adamw([p for p in model.parameters() if p.requires_grad]),
                                       example=batches[0][0])
    for inputs, targets in batches[:SAVED_AT]:
        run.forward_backward(model, inputs, targets, case.loss_fn)
        optimizer.step()
        optimizer.zero_grad()
    run.save({"model": model, "optimizer": optimizer}, path=root)
    weights = full_state(run.unwrap(model))
    run.close()
    return weights


@pytest.mark.timeout(300)
@pytest.mark.usefixtures("traced_workers")
def test_a_lora_checkpoint_from_a_pipeline_loads_in_one_process(tmp_path: Path) -> None:
    """What a LoRA user expects of a checkpoint: the whole model in peft's names (frozen base and trained adapters)
    and the adapters' optimizer state, loaded bit for bit under another layout, adapters extractable by peft."""
    import peft

    case = zoo.MODELS["hf_llama_lora"]
    saved = _merged([{"w": w} for w in paratrain.launch(_save_lora, str(tmp_path), nproc=2, timeout=200,
                                                          accelerator="cpu", all_ranks=True)], "w")
    run = paratrain.setup(strategy="single", seed=0, accelerator="cpu")
    model = case.build(0)
    model, optimizer = run.prepare(model, _adamw([p for p in model.parameters() if p.requires_grad]))
    run.load({"model": model, "optimizer": optimizer}, path=tmp_path / f"step-{0:09d}")
    loaded = full_state(model)
    trained = {k for k in loaded if ".lora_" in k}
    assert loaded.keys() == saved.keys() and max_diff(loaded, saved) == 0.0
    initial = full_state(case.build(0))
    assert max_diff({k: loaded[k] for k in trained}, {k: initial[k] for k in trained}) > 1e-4  # they trained
    assert len(optimizer.state) == len(trained) == len(peft.get_peft_model_state_dict(model)) == 24
    run.close()
