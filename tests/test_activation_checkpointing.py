"""setup(activation_checkpointing=...): it keeps less for the backward, changes no result, and refuses what
it cannot do. Every layout's results are checked by the correctness matrix's `ac=` cells (test_matrix.py);
here, in one process, what those cells cannot see: how much is kept."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch
import zoo
from torch.utils._python_dispatch import TorchDispatchMode
from zoo.reference import global_batches

import paratrain
from paratrain.parallel.pipeline import schedules


class _Ops(TorchDispatchMode):
    """Counts the aten ops run inside (the backward: its own ops plus any recomputed forward)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def _kept_and_grads(mode: str, model_name: str = "gpt_dropout") -> tuple[int, Counter[str], float, dict[str, Any]]:
    """Bytes autograd keeps for the backward outside checkpointed regions after one forward, the ops the
    backward ran (recomputation included), the loss, and the gradients."""
    case = zoo.MODELS[model_name]
    run = paratrain.setup(strategy="single", seed=0, accelerator="cpu", activation_checkpointing=mode)
    try:
        model = run.prepare(case.build(0))
        inputs, targets = global_batches(case, 0, (8,))[0]
        kept: dict[int, int] = {}

        def pack(t: torch.Tensor) -> Any:
            kept.setdefault(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = case.loss_fn(model(inputs), targets)
        with _Ops() as ops:
            run.backward(loss)
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        return sum(kept.values()), ops.counts, float(loss.detach()), grads
    finally:
        run.close()


def test_checkpointing_keeps_less_and_changes_nothing() -> None:
    kept, ops, loss, grads = _kept_and_grads("none")
    runs = {"none": (kept, ops)}
    for mode in ("selective", "full"):
        kept, ops, loss_ac, grads_ac = _kept_and_grads(mode)
        runs[mode] = (kept, ops)
        assert loss_ac == loss, mode
        assert grads_ac.keys() == grads.keys()
        # the recomputation drew the forward's dropout masks again: gradients equal bit for bit
        assert all(torch.equal(grads_ac[k], grads[k]) for k in grads), mode
    # full keeps each block's input only, and its backward recomputes the blocks' matrix products
    assert runs["full"][0] < runs["selective"][0] < runs["none"][0], runs
    assert runs["full"][0] < runs["none"][0] / 4, runs
    products = {mode: ops["mm"] + ops["addmm"] for mode, (_, ops) in runs.items()}
    assert products["full"] > products["none"], products
    # selective keeps the matrix products and recomputes the rest: the products are not run again, GELU is
    assert products["selective"] == products["none"], products
    assert runs["selective"][1]["gelu"] > runs["none"][1]["gelu"] == 0, runs


def test_batchnorm_is_refused_by_name() -> None:
    run = paratrain.setup(strategy="single", seed=0, accelerator="cpu", activation_checkpointing="full")
    try:
        with pytest.raises(paratrain.ParatrainError, match="BatchNorm .* running statistics .*checkpointing='none'"):
            run.prepare(zoo.MODELS["cnn_bn"].build(0))
    finally:
        run.close()


def test_selective_checkpointing_and_a_split_backward_do_not_combine() -> None:
    with pytest.raises(paratrain.ParatrainError, match="activation_checkpointing='full'"):
        schedules.check("zero-bubble", 2, 2, 4, checkpointing="selective")
    schedules.check("zero-bubble", 2, 2, 4, checkpointing="full")
    assert "zero-bubble" in schedules.auto_names(1)
    assert "zero-bubble" not in schedules.auto_names(1, checkpointing="selective")
    with pytest.raises(paratrain.ParatrainError, match="unknown activation_checkpointing 'some'"):
        paratrain.setup(strategy="single", activation_checkpointing="some")


def test_selective_checkpointing_trains_hugging_face_models_with_their_default_cache() -> None:
    """Mixtral and Llama as transformers builds them (`use_cache=True`): each layer appends to the cache, so a
    selective recomputation met a grown cache and torch failed ("aten.slice.Tensor invocation index 4 ... not found
    in storage"). Their training forwards now run without it: gradients equal the plain model's bit for bit, the
    config keeps its cache, and an evaluation forward still returns one."""
    import moe_cases as cases

    from paratrain.parallel.activation_checkpoint import without_cache

    for name in ("mixtral", "llama"):
        inputs, _ = cases.data(name)
        plain = cases.build(name)
        plain(inputs[:4]).logits.square().mean().backward()
        model = cases.build(name)
        assert model.config.use_cache
        run = paratrain.setup(strategy="single", seed=0, accelerator="cpu", activation_checkpointing="selective")
        try:
            prepared = run.prepare(model)
            prepared(inputs[:4]).logits.square().mean().backward()
            assert model.config.use_cache, name
            got = dict(model.named_parameters())
            assert all(torch.equal(p.grad, got[k].grad) for k, p in plain.named_parameters()), name
            prepared.eval()
            with torch.no_grad():
                assert prepared(inputs[:4]).past_key_values is not None, name
        finally:
            run.close()
    with pytest.raises(paratrain.ParatrainError, match="context parallelism: .*use activation_checkpointing='full'"):
        without_cache(cases.build("llama"), "selective", shared_sequences=True)
    assert not without_cache(cases.build("llama"), "full", shared_sequences=True)  # full is exact with the cache
