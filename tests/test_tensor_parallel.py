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
    """Attention that reshapes with its head-count attribute and -1: on 1/tp of the features it would silently give
    each head half its width, unless the attribute holds the rank's share of the heads (which paratrain sets, and
    checks). `literal` writes the head count as a number instead, which no attribute can fix."""

    def __init__(self, literal: bool = False) -> None:
        super().__init__()
        self.heads, self.literal = 4, literal
        self.q, self.k, self.v, self.o = (torch.nn.Linear(16, 16) for _ in range(4))

    def split_heads(self, z: torch.Tensor) -> torch.Tensor:  # read in a helper, as OpenAI GPT's attention does
        b, t, _ = z.shape
        return z.view(b, t, 4 if self.literal else self.heads, -1).transpose(1, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (self.split_heads(w(x)) for w in (self.q, self.k, self.v))
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        return self.o(y.transpose(1, 2).reshape(b, t, -1))


def _heads_model(literal: bool) -> tuple[str, list[dict[str, torch.Tensor]]]:
    """A few SGD steps under tp 2: (what prepare said, the whole weights after each step)."""
    run = paratrain.setup(strategy="tp", seed=0, accelerator="cpu", timeout_s=60)
    try:
        torch.manual_seed(0)
        model = _WidthFromHeads(literal)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        x = torch.randn(2, 3, 16, generator=torch.Generator().manual_seed(1))
        model, optimizer = run.prepare(model, optimizer, example=x)
        weights = []
        for _ in range(2):
            run.forward_backward(model, x, x, torch.nn.functional.mse_loss)
            optimizer.step()
            optimizer.zero_grad()
            weights.append(full_state(run.unwrap(model)))
        return "trained", weights
    except paratrain.ParatrainError as exc:
        return str(exc), []
    finally:
        run.close()


@pytest.mark.timeout(180)
def test_tp_pp_with_no_other_option_trains() -> None:
    """The defaults train: the tensor degree beside the pipeline, and the fewest micro-batches 1F1B runs."""
    results = paratrain.launch(_train, "tp+pp", "hf_llama", {}, "forward_backward", nproc=4, timeout=150,
                               accelerator="cpu", all_ranks=True)
    _check("hf_llama", results, {("tp",)})


@pytest.mark.timeout(180)
def test_a_tp_plan_of_the_users_makes_a_refused_model_train() -> None:
    results = paratrain.launch(_train, "fsdp+tp", "llama", {"tp_size": 2, "tp_plan": MLP_ONLY}, "forward_backward",
                               nproc=4, timeout=150, accelerator="cpu", all_ranks=True)
    _check("llama", results, {("dp_shard",), ("dp_shard", "tp")})


@pytest.mark.timeout(180)
def test_head_counts_become_the_ranks_share_or_the_block_is_refused() -> None:
    said, weights = paratrain.launch(_heads_model, False, nproc=2, timeout=60, accelerator="cpu")
    assert said == "trained"
    torch.manual_seed(0)  # the same steps in plain PyTorch
    model = _WidthFromHeads()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(2, 3, 16, generator=torch.Generator().manual_seed(1))
    for step in range(2):
        torch.nn.functional.mse_loss(model(x), x).backward()
        optimizer.step()
        optimizer.zero_grad()
        for key, value in model.state_dict().items():
            assert torch.allclose(weights[step][key], value, atol=1e-6), (step, key)
    said, _ = paratrain.launch(_heads_model, True, nproc=2, timeout=60, accelerator="cpu")
    assert "cannot shard the model's own forward (q, k, v, o): its output differs by" in said, said




def _adam_state(run: paratrain.Run, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Whole weights and both Adam moments by parameter name (collective where they are DTensors)."""
    from paratrain.checkpoint.sharded import base_optimizer

    held = run.unwrap(model)
    base = base_optimizer(optimizer)
    out = {f"w.{k}": v for k, v in full_state(held).items()}
    for name, p in held.named_parameters():
        for moment in ("exp_avg", "exp_avg_sq"):
            value = base.state[p][moment]
            out[f"{moment}.{name}"] = (value.full_tensor() if hasattr(value, "full_tensor") else value).clone()
    return out


def _strided_checkpoint(strategy: str, options: dict[str, Any], folder: str, save: bool) -> dict[str, Any]:
    """Hugging Face GPT-2 (its Conv1D attention fused as q, k, v: a strided DTensor under tensor parallelism) with
    AdamW: one step then saved, or a fresh model loaded from what was saved."""
    case = zoo.MODELS["hf_gpt2"]
    run = paratrain.setup(strategy=strategy, seed=0, accelerator="cpu", timeout_s=120, checkpoint_dir=folder,
                          **options)
    try:
        replica, replicas = run.strategy.data_shard(run.ctx)
        model = case.build(0 if save else 1)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        (x, y), = global_batches(case, 0, (8,))
        x, y = chunk(x, replicas)[replica], chunk(y, replicas)[replica]
        model, optimizer = run.prepare(model, optimizer, example=x)
        state = {"model": model, "optimizer": optimizer, "step": 0}
        if save:
            run.forward_backward(model, x, y, case.loss_fn)
            optimizer.step()
            optimizer.zero_grad()
            state["step"] = 1
            run.save(state)
        else:
            run.load(state)
            assert state["step"] == 1
        return _adam_state(run, model, optimizer)
    finally:
        run.close()


@pytest.mark.timeout(240)
def test_fused_weights_checkpoint_whole_and_load_under_any_layout(tmp_path: Any) -> None:
    """A checkpoint of strided DTensors (written whole, each rank taking its pieces back) loads into another tensor
    degree and into one process, weights and Adam's moments exactly as saved."""
    folder = str(tmp_path)
    saved = paratrain.launch(_strided_checkpoint, "fsdp+tp", {"tp_size": 2}, folder, True, nproc=4, timeout=200,
                             accelerator="cpu")
    for strategy, nproc in (("tp", 2), ("single", 1)):
        loaded = paratrain.launch(_strided_checkpoint, strategy, {}, folder, False, nproc=nproc, timeout=200,
                                  accelerator="cpu")
        assert sorted(loaded) == sorted(saved)
        for key, value in saved.items():
            assert torch.equal(loaded[key], value), (strategy, key)
