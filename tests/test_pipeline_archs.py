"""Pipelines (`pp`) on models as their libraries build them, against the plain PyTorch loop.

- torchvision's VisionTransformer with `microbatches` unset: the batch times the heads (its attention folds the
  heads into the batch) crosses the cut as an integer, recomputed after it from the batch dimension; the unset
  count is the fewest equal micro-batches 1F1B runs (one per stage);
- Hugging Face Mixtral with its defaults: `use_cache=True` in its config (the pipeline's output carries no cache)
  and its experts routed through the library's grouped implementation;
- Hugging Face T5 (without dropout: dropout called as a function is a matter of the randomness rule), cut before
  the decoder's embedding, so the decoder's token ids cross the cut: torch learns a later stage's shapes by running
  it on tensors made from metadata, and uninitialised ids there failed on that rank alone.

One 2-process launch runs them all; each rank must hold only its stage. Then the refusals: a model that fails on
one rank while it is split is refused on every rank, and Mixtral with the library's looping "eager" experts is
refused naming the experts module and the implementation that traces.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from matrix_cells import full_state
from torch import nn
from zoo import BF16, FP32, archs, data
from zoo.case import ZooCase, seeded
from zoo.compare import mismatches
from zoo.reference import Optim, global_batches, run_reference

import paratrain
from paratrain.parallel.pipeline import graph_split, schedules, tracing

SIZES = (8, 8)


def _t5_without_dropout(seed: int) -> nn.Module:
    from transformers import T5Config, T5ForConditionalGeneration

    cfg = T5Config(vocab_size=data.VOCAB, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4,
                   decoder_start_token_id=0, pad_token_id=0, eos_token_id=2, dropout_rate=0.0)
    with seeded(seed):
        return archs.Seq2Seq(T5ForConditionalGeneration(cfg))


def _case(name: str, build: Any, batch: Any, loss_fn: Any, lr: float) -> ZooCase:
    return ZooCase(name=name, about="", build=build, batch=batch, loss_fn=loss_fn,
                   tolerances={"fp32": FP32, "bf16": BF16}, lr=lr)


CASES: dict[str, tuple[ZooCase, dict[str, Any]]] = {
    "vit": (_case("vit", archs.build_vit, data.image_batch, data.class_loss, 0.05), {}),
    "mixtral": (_case("mixtral", archs.build_mixtral, data.lm_batch, data.hf_lm_loss, 0.1), {"microbatches": 2}),
    "t5": (_case("t5", _t5_without_dropout, archs.t5_batch, data.hf_lm_loss, 0.1),
           {"microbatches": 2, "balance": [3, 8]}),  # encoder.embed_tokens..encoder.block.0 | encoder.block.1..
}


def _train(name: str) -> dict[str, Any]:
    case, options = CASES[name]
    run = paratrain.setup(strategy="pp", seed=0, accelerator="cpu", **options)
    try:
        model = case.build(0)
        names = set(full_state(model))
        optimizer = Optim().make(model.parameters(), case)
        batches = global_batches(case, 0, SIZES)
        model, optimizer = run.prepare(model, optimizer, example=batches[0][0])
        losses, weights = [], []
        for x, y in batches:
            losses.append(float(run.forward_backward(model, x, y, case.loss_fn)))
            optimizer.step()
            optimizer.zero_grad()
            weights.append(full_state(run.unwrap(model)))
        return {"losses": losses, "weights": weights, "names": names, "microbatches": model.plan.microbatches}
    finally:
        run.close()


class _TracedDifferently(nn.Module):
    """A forward that fails on rank 1 only, while the model is traced to be split."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if dist.get_rank() == 1:
            raise RuntimeError("a shape this rank's copy of the model does not have")
        return self.blocks[1](self.blocks[0](x))


class _FailsOnRankOne(nn.Module):
    """A layer that raises a raw error on rank 1 only, when the split measures it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if dist.get_rank() == 1:
            raise IndexError("index out of range in self")
        return x


def _refused(model: nn.Module) -> str:
    run = paratrain.setup(strategy="pp", microbatches=2, accelerator="cpu", timeout_s=30)
    try:
        run.prepare(model, example=torch.randn(4, 4))
    except paratrain.ParatrainError as e:
        return str(e)
    finally:
        run.close()
    return "prepared"


def _all() -> dict[str, Any]:
    out: dict[str, Any] = {name: _train(name) for name in CASES}
    out["traced differently"] = _refused(_TracedDifferently())
    out["fails on one rank"] = _refused(nn.Sequential(nn.Linear(4, 4), _FailsOnRankOne(), nn.Linear(4, 4)))
    return out


@pytest.mark.procs
@pytest.mark.timeout(240)
def test_library_models_train_under_pp_like_the_plain_loop() -> None:
    results = paratrain.launch(_all, nproc=2, timeout=220, accelerator="cpu", all_ranks=True)
    for name, (case, _) in CASES.items():
        want = run_reference(case, global_batches(case, 0, SIZES))
        held = [set(rank[name]["weights"][-1]) for rank in results]
        names = results[0][name]["names"]
        assert held[0] | held[1] == names, (name, sorted(names - held[0] - held[1]))
        tied = {k for k in held[0] & held[1] if "embed_tokens" in k or "shared" in k or "lm_head" in k}
        assert held[0] & held[1] == tied, (name, sorted(held[0] & held[1]))  # each rank holds only its stage
        assert len(held[0]) < len(names) and len(held[1]) < len(names), name
        for rank in results:
            assert not mismatches(rank[name]["losses"], rank[name]["weights"], want, FP32), (name, mismatches(
                rank[name]["losses"], rank[name]["weights"], want, FP32))
    assert [rank["vit"]["microbatches"] for rank in results] == [2, 2]  # unset: 1F1B's fewest on 2 stages
    for rank in results:
        assert "_TracedDifferently cannot be traced" in rank["traced differently"], rank["traced differently"]
        assert "in _TracedDifferently (_TracedDifferently)" in rank["traced differently"]
        assert "on rank(s) [1]" in rank["traced differently"]
        assert "failed with IndexError: index out of range" in rank["fails on one rank"], rank["fails on one rank"]
        assert "on rank(s) [1]" in rank["fails on one rank"]


def test_looping_experts_are_refused_naming_the_module_and_the_implementation_that_traces() -> None:
    model = archs.build_mixtral(0)
    model.set_experts_implementation("eager")
    with pytest.raises(paratrain.ParatrainError) as caught:
        tracing.trace(model, data.lm_batch(0, 4)[0])
    message = str(caught.value)
    assert "in MixtralForCausalLM.model.layers.0.mlp.experts (MixtralExperts)" in message, message
    assert "set_experts_implementation('grouped_mm')" in message, message


def test_a_cache_is_traced_off_and_the_config_left_as_it_was() -> None:
    model = archs.build_qwen2_moe(0)
    assert model.config.use_cache
    segments = graph_split.traced_segments(model, tracing.trace(model, data.lm_batch(0, 4)[0]))
    assert model.config.use_cache
    out: Any = data.lm_batch(1, 3)[0]
    for _, segment in segments:
        out = segment(out)
    assert getattr(out, "past_key_values", None) is None and out.logits.shape[:2] == (3, data.SEQ)


class _SizeOfAnother(nn.Module):
    """Numbers computed from the batch of an input no later layer sees cross the cut as values."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8)])

    def forward(self, x: dict[str, torch.Tensor]) -> torch.Tensor:
        h = self.blocks[0](x["a"])
        scale, shift = x["n"].size(0) * 3, x["n"].size(0) / 4
        return self.blocks[1](h) * scale + shift


def test_numbers_cross_recomputed_from_sizes_or_as_values() -> None:
    vit = archs.build_vit(0)
    traced = tracing.trace(vit, data.image_batch(0, 4)[0])
    order = graph_split.unit_order(traced.train, graph_split.unit_paths(vit))
    cuts = graph_split._boundaries(traced.train, graph_split.assign(traced.train, order), len(order))
    assert any(cut.recomputed for cut in cuts) and not any(cut.carried for cut in cuts)
    other = _SizeOfAnother()
    traced = tracing.trace(other, {"a": torch.randn(4, 8), "n": torch.randn(6, 2)})
    order = graph_split.unit_order(traced.train, graph_split.unit_paths(other))
    (cut,) = graph_split._boundaries(traced.train, graph_split.assign(traced.train, order), len(order))
    assert len(cut.carried) == 2, cut
    for model, x in ((vit, data.image_batch(1, 3)[0]),
                     (_SizeOfAnother(), {"a": torch.randn(3, 8), "n": torch.randn(5, 2)})):
        example = {"a": torch.randn(4, 8), "n": torch.randn(6, 2)} if isinstance(model, _SizeOfAnother) else \
            data.image_batch(0, 4)[0]
        out: Any = x
        for _, segment in graph_split.traced_segments(model, tracing.trace(model, example)):
            out = segment(out)
        torch.testing.assert_close(out, model(x))


def test_an_unset_micro_batch_count_is_the_fewest_the_schedule_runs() -> None:
    assert paratrain.config.Config().microbatches is None
    assert schedules.default_microbatches("1f1b", 2, 1, 8, "strategy 'pp'") == 2
    assert schedules.default_microbatches("1f1b", 4, 1, 6, "strategy 'pp'") == 6
    assert schedules.default_microbatches("gpipe", 4, 1, 6, "strategy 'pp'") == 1
    with pytest.raises(paratrain.ParatrainError, match="batch divisible by 4"):
        schedules.default_microbatches("1f1b", 4, 1, 3, "strategy 'pp'")
