"""N-D layouts beyond the matrix: HSDP (ddp+fsdp), the user's own loop (`run.backward`) under ddp+tp, a user
`tp_plan` that makes a refused model train, and a forward that would silently compute the wrong heads.
Checkpoints across N-D layouts: tests/test_resume_layouts.py."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import zoo
from matrix_cells import full_state
from zoo.compare import mismatches
from zoo.reference import Optim, chunk, global_batches, run_reference

import paratrain

SIZES = (8, 8)
MLP_ONLY = {"blocks.*.mlp.gate": "colwise", "blocks.*.mlp.up": "colwise", "blocks.*.mlp.down": "rowwise"}
"""The zoo LLaMA's attention reshapes with its full head count (refused); its SwiGLU MLP shards cleanly."""


def _train(strategy: str, model_name: str, options: dict[str, Any], loop: str) -> dict[str, Any]:
    case = zoo.MODELS[model_name]
    run = paratrain.setup(strategy=strategy, seed=0, accelerator="cpu", timeout_s=120, **options)
    try:
        replica, replicas = run.strategy.data_shard(run.ctx)
        model = case.build(0)
        optimizer = Optim().make(model.parameters(), case)
        batches = global_batches(case, 0, SIZES)
        model, optimizer = run.prepare(model, optimizer, example=chunk(batches[0][0], replicas)[replica])
        losses, weights = [], []
        for inputs, targets in batches:
            x, y = chunk(inputs, replicas)[replica], chunk(targets, replicas)[replica]
            if loop == "backward":  # the user's own forward, as the tutorials write it
                loss = case.loss_fn(model(x), y)
                run.backward(loss)
                losses.append(float(run.all_reduce(loss.detach())))
            else:
                losses.append(float(run.forward_backward(model, x, y, case.loss_fn)))
            optimizer.step()
            optimizer.zero_grad()
            weights.append(full_state(run.unwrap(model)))
        meshes = {p.device_mesh.mesh_dim_names for p in run.unwrap(model).parameters() if hasattr(p, "to_local")}
        return {"weights": weights, "losses": losses, "meshes": meshes}
    finally:
        run.close()


def _check(model_name: str, results: list[dict[str, Any]], meshes: set[tuple[str, ...]]) -> None:
    case = zoo.MODELS[model_name]
    want = run_reference(case, global_batches(case, 0, SIZES))
    for rank, result in enumerate(results):
        assert result["meshes"] == meshes  # the parameters really are sharded over those mesh dimensions
        problems = mismatches(result["losses"], result["weights"], want, case.tolerances["fp32"])
        assert not problems, f"rank {rank}: {problems[:4]}"


@pytest.mark.timeout(180)
def test_hybrid_sharding_ddp_fsdp_trains_like_the_plain_loop() -> None:
    results = paratrain.launch(_train, "ddp+fsdp", "gpt", {"dp_replicate": 2}, "backward", nproc=4, timeout=150,
                               accelerator="cpu", all_ranks=True)
    _check("gpt", results, {("dp_replicate", "dp_shard")})


@pytest.mark.timeout(180)
def test_ddp_tp_averages_gradients_in_the_users_own_backward() -> None:
    results = paratrain.launch(_train, "ddp+tp", "hf_llama", {"tp_size": 2}, "backward", nproc=4, timeout=150,
                               accelerator="cpu", all_ranks=True)
    _check("hf_llama", results, {("tp",)})


class _WidthFromHeads(torch.nn.Module):
    """Attention that reshapes with its full head count and -1: it runs on 1/tp of the features, silently
    giving each head half its width."""

    def __init__(self) -> None:
        super().__init__()
        self.heads, self.q, self.k, self.v, self.o = 4, *(torch.nn.Linear(16, 16) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (w(x).view(b, t, self.heads, -1).transpose(1, 2) for w in (self.q, self.k, self.v))
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        return self.o(y.transpose(1, 2).reshape(b, t, -1))


def _silent_heads() -> str:
    run = paratrain.setup(strategy="tp", seed=0, accelerator="cpu", timeout_s=60)
    try:
        model = _WidthFromHeads()
        run.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), example=torch.randn(2, 3, 16))
        return "trained"
    except paratrain.ParatrainError as exc:
        return str(exc)
    finally:
        run.close()


@pytest.mark.timeout(180)
def test_a_tp_plan_of_the_users_makes_a_refused_model_train() -> None:
    results = paratrain.launch(_train, "fsdp+tp", "llama", {"tp_size": 2, "tp_plan": MLP_ONLY}, "forward_backward",
                               nproc=4, timeout=150, accelerator="cpu", all_ranks=True)
    _check("llama", results, {("dp_shard",), ("dp_shard", "tp")})
    said = paratrain.launch(_silent_heads, nproc=2, timeout=60, accelerator="cpu")
    assert "cannot shard the model's own forward (q, k, v, o): its output differs by" in said, said


