"""N-D layouts beyond the matrix: HSDP (ddp+fsdp), the user's own loop (`run.backward`) under ddp+tp, a user
`tp_plan` that makes a refused model train, a forward that would silently compute the wrong heads, and
checkpoints that move between N-D layouts and `single`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import zoo
from helpers import max_diff
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


# -- checkpoints across layouts -------------------------------------------------------------------------
def _prepared(strategy: str, ckpt: str, nproc_options: dict[str, Any]) -> tuple[Any, Any, Any, dict[str, Any]]:
    case = zoo.MODELS["hf_llama"]
    run = paratrain.setup(strategy=strategy, seed=0, accelerator="cpu", timeout_s=120, checkpoint_dir=ckpt,
                          **nproc_options)
    model = case.build(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = run.prepare(model, optimizer, example=global_batches(case, 0, (2,))[0][0])
    return run, model, optimizer, {"model": model, "optimizer": optimizer, "step": 0}


def _steps(run: Any, model: Any, optimizer: Any, steps: range) -> dict[str, torch.Tensor]:
    case = zoo.MODELS["hf_llama"]
    replica, replicas = run.strategy.data_shard(run.ctx)
    batches = global_batches(case, 0, (8, 8, 8, 8))
    for step in steps:
        inputs, targets = batches[step]
        run.forward_backward(model, chunk(inputs, replicas)[replica], chunk(targets, replicas)[replica],
                             case.loss_fn)
        optimizer.step()
        optimizer.zero_grad()
    return full_state(run.unwrap(model))


def _save_then_continue(ckpt: str) -> dict[str, Any]:
    run, model, optimizer, state = _prepared("fsdp+tp", ckpt, {"tp_size": 2})
    _steps(run, model, optimizer, range(2))
    state["step"] = 2
    run.save(state)
    saved = {"weights": full_state(run.unwrap(model)), "after": _steps(run, model, optimizer, range(2, 4))}
    run.close()
    return saved


def _resume(ckpt: str, strategy: str, options: dict[str, Any]) -> dict[str, Any]:
    run, model, optimizer, state = _prepared(strategy, ckpt, options)
    assert run.load(state) and state["step"] == 2
    loaded = {"weights": full_state(run.unwrap(model)), "after": _steps(run, model, optimizer, range(2, 4))}
    run.close()
    return loaded


@pytest.mark.timeout(240)
def test_an_fsdp_tp_checkpoint_resumes_under_tp_and_single(tmp_path: Path) -> None:
    saved = paratrain.launch(_save_then_continue, str(tmp_path), nproc=4, timeout=120, accelerator="cpu")
    assert (tmp_path / "step-000000002" / "model" / ".metadata").exists()
    tp = paratrain.launch(_resume, str(tmp_path), "tp", {}, nproc=2, timeout=120, accelerator="cpu")
    one = paratrain.launch(_resume, str(tmp_path), "single", {}, nproc=1, timeout=60, accelerator="cpu")
    for resumed in (tp, one):
        assert max_diff(resumed["weights"], saved["weights"]) == 0.0
        assert max_diff(resumed["after"], saved["after"]) < 1e-5  # Adam's moments came along
    assert max_diff(saved["weights"], full_state(zoo.MODELS["hf_llama"].build(0))) > 1e-3
