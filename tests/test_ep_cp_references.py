"""The hand-written twins of `ep` and `cp` (bench/references_ep_cp.py) compute what one process computes, and so
does paratrain's side of the same comparison: a ratio of step times means something only between two loops that
train to the same weights.

On 2 CPU workers, the tiny MoE GPT under `ep 2` / `torch-ep` and the tiny long-sequence GPT under `cp 2` /
`torch-cp` take 3 SGD steps from the seed's weights; each side's losses (the mean over the global batch) and every
weight it trained (each expert on the rank that owns it, under its index in the whole model) match one process's
plain loop on the whole batch.
"""

from __future__ import annotations

import re
from dataclasses import replace
from typing import Any

import pytest
import torch
from torch import nn

from paratrain.bench import jobs, references
from paratrain.measure import workloads

STEPS = 3
LR = 0.5
"""Steps large enough that a wrong gradient (a missing average, an expert summed twice) moves the weights by far
more than the tolerance."""
CASES = (("gpt-moe", "tiny-moe", "ep", "torch-ep"), ("gpt-long", "tiny-long", "cp", "torch-cp"),
         ("mixtral", "tiny-moe", "ep", "torch-ep"))
"""(workload, size, paratrain strategy, its twin): listed experts, a share of each sequence, grouped experts."""
EXPERT = re.compile(r"blocks\.(\d+)\.mlp\.experts\.(\d+)\.(.+)")


class _Logits(nn.Module):
    """A Hugging Face causal LM as a module from token ids to logits (what the workloads' loops train)."""

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm(ids).logits  # type: ignore[no-any-return]


def _mixtral(size: str) -> workloads.Workload:
    """Hugging Face Mixtral from a tiny config (4 grouped experts, top-2), its defaults otherwise, on the token
    batches of the gpt-moe workload."""
    import transformers as tf

    tf.logging.set_verbosity_error()
    config = tf.MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
                              num_local_experts=4, num_experts_per_tok=2)
    return replace(workloads.get("gpt-moe", gpt_size=size), name="mixtral",
                   model=lambda: _Logits(tf.MixtralForCausalLM(config)))


def _workload(name: str, size: str) -> workloads.Workload:
    w = _mixtral(size) if name == "mixtral" else workloads.get(name, gpt_size=size)
    return replace(w, lr=LR)


def _weights(model: nn.Module) -> dict[str, tuple[int, torch.Tensor]]:
    """Every parameter this rank holds by its name in the whole model, with the index of its first row there: a
    twin's local expert i of block b under its global index, grouped experts' slices where they start."""
    out = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        start, value = 0, p.detach()
        found = EXPERT.fullmatch(name)
        holder = model.get_submodule(name.rpartition(".")[0])
        if found:
            block, index, rest = int(found[1]), int(found[2]), found[3]
            first = getattr(model.get_submodule(f"blocks.{block}.mlp"), "first", 0)
            name = f"blocks.{block}.mlp.experts.{first + index}.{rest}"
        elif hasattr(value, "to_local"):  # paratrain's grouped experts: Shard(0) over the expert group
            value = value.to_local()
            start = p.device_mesh.get_local_rank() * value.shape[0]  # type: ignore[attr-defined]
        else:
            start = getattr(holder, "first", 0)
        out[name] = (start, value.clone())
    return out


class _Recorded(nn.Module):
    """The workload's loss, each value kept (a rank's loss over the rows or tokens it holds)."""

    def __init__(self, inner: nn.Module, kept: list[float]) -> None:
        super().__init__()
        self.inner, self.kept = inner, kept

    def forward(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss = self.inner(outputs, targets)
        self.kept.append(float(loss.detach()))
        return loss


def _train_pair(name: str, size: str, strategy: str, reference: str) -> dict[str, Any]:
    """The twin, then paratrain's side, STEPS steps each from the seed's weights: their weights and losses (the
    twin's as this rank's own, whose mean over the ranks is the global batch's)."""
    from paratrain.bench import worker

    w = _workload(name, size)
    settings = jobs.Settings(workload=name, gpt_size=size, batch=8, steps=1, warmup=0, repeat=1)
    data = w.data(8)
    built: list[nn.Module] = []
    kept: list[float] = []
    twin = replace(w, model=lambda: built.append(w.model()) or built[-1], loss=lambda: _Recorded(w.loss(), kept))
    step = references.BUILDERS[reference](jobs.Spec(reference, 2), twin, data, settings, torch.device("cpu"))
    for _ in range(STEPS):
        step()
    ours = worker.paratrain_side(jobs.Spec(strategy, 2), replace(w, model=twin.model), data, settings)
    losses = [float(ours()) for _ in range(STEPS)]
    return {f"{name} {reference}": {"weights": _weights(built[0]), "losses": kept},
            f"{name} {strategy}": {"weights": _weights(built[1]), "losses": losses}}


def _train_both(cases: tuple[tuple[str, str, str, str], ...]) -> dict[str, Any]:
    """In each worker: every case's pair."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    out: dict[str, Any] = {}
    for case in cases:
        out.update(_train_pair(*case))
    dist.barrier()
    return out


def _one_process(name: str, size: str) -> tuple[dict[str, torch.Tensor], list[float]]:
    """The plain loop on the whole batch: the weights every side must reach, and its losses."""
    w = _workload(name, size)
    torch.manual_seed(references.SEED)
    model = w.model()
    x, y = w.data(8)
    optimizer = torch.optim.SGD(model.parameters(), lr=w.lr)
    losses = []
    for _ in range(STEPS):
        optimizer.zero_grad()
        loss = w.loss()(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    return {name: p.detach() for name, p in model.named_parameters(remove_duplicate=False)}, losses


@pytest.mark.procs
@pytest.mark.timeout(150)
def test_ep_and_cp_twins_and_paratrain_train_as_one_process() -> None:
    import paratrain

    per_rank = paratrain.launch(_train_both, CASES, nproc=2, timeout=100, all_ranks=True, accelerator="cpu")
    for name, size, strategy, reference in CASES:
        want, want_losses = _one_process(name, size)
        twin, ours = f"{name} {reference}", f"{name} {strategy}"
        twin_losses = [sum(r[twin]["losses"][i] for r in per_rank) / 2 for i in range(STEPS)]
        assert twin_losses == pytest.approx(want_losses, abs=1e-5), twin
        assert per_rank[0][ours]["losses"] == pytest.approx(want_losses, abs=1e-5), ours
        assert want_losses[-1] < want_losses[0] - 1e-3, "the steps must move the weights for the check to mean much"
        for side in (twin, ours):
            trained = {key: 0 for key in want}  # rows of each weight some rank holds
            for rank, got in enumerate(per_rank):
                for key, (start, value) in got[side]["weights"].items():
                    torch.testing.assert_close(value, want[key][start:start + value.shape[0]], rtol=0, atol=1e-5,
                                               msg=lambda m, where=f"{side} rank {rank} {key}": f"{where}: {m}")
                    trained[key] += value.shape[0] if value.dim() else 1
            assert all(trained[key] >= (want[key].shape[0] if want[key].dim() else 1) for key in want), side
