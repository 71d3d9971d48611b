"""FSDP2 against plain PyTorch loops written here (no paratrain code on the reference side).

Models: a small GPT (token and position embeddings as separate children, blocks in an nn.ModuleList,
attention that reshapes with `view(b, t, h, d)`, LM head tied to the token embedding, dropout p=0)
and an MLP whose layers are plain attributes. Each step's loss and every weight are compared.

Tolerances and what was observed (2 CPU cores, gloo, torch 2.14.1, losses near 12 and 0.5):
- float32, 2 and 3 workers, `forward_backward` and `model(x)` + `run.backward`, with and without
  gradient accumulation, against one process on the whole global batch: weights within 1e-6 and losses
  within 5e-6 (observed at most 1.2e-7 and 1.4e-6: the shares' gradients are summed in another order).
  A tiny GPT2LMHeadModel (tied embeddings) within 1e-6 (observed 6e-8).
- precision="bf16" (FSDP2 MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32) under
  autocast) against the same plain loop written out: a bfloat16 copy of the float32 weights runs each
  worker's share under torch.autocast, the float32 gradients are averaged and the float32 weights
  updated. Within 1e-5 (observed 0 on 2 workers, 1.2e-7 on 3). The same run is more than 1e-3 from
  the float32 run (observed 2.6e-3), so bf16 silently dropped would fail. It is 2.7e-3 to 3.4e-3 from
  the usual autocast loop on float32 weights (which is itself 9.4e-4 from float32): under FSDP2's
  policy embedding outputs, norm weights and the residual stream are bfloat16 too; bounded at 2e-2.
"""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from helpers import max_diff
from torch import nn

import paratrain
from paratrain.errors import ParatrainError
from paratrain.parallel.data_parallel.fsdp import apply_fsdp, find_units

STEPS = 4
GLOBAL_BATCH = 12
LR = 0.1


# -- the models -------------------------------------------------------------------------------------
class Attention(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in self.qkv(x).split(d, dim=2))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(d // self.heads)
        att = att.masked_fill(torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1), float("-inf"))
        return self.proj((F.softmax(att, dim=-1) @ v).transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = Attention(d, heads)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.drop = nn.Dropout(0.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.ln1(x)))
        return x + self.drop(self.mlp(self.ln2(x)))


class GPT(nn.Module):
    def __init__(self, vocab: int = 32, seq: int = 8, d: int = 16, heads: int = 2, layers: int = 2) -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(vocab, d)
        self.pos_emb = nn.Embedding(seq, d)
        self.drop = nn.Dropout(0.0)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.tok_emb.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.drop(self.tok_emb(idx) + self.pos_emb(torch.arange(idx.shape[1], device=idx.device)))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


class GPTDirectHead(GPT):
    """nanoGPT's other tying idiom: no head module, the embedding matrix used directly in forward."""

    def __init__(self) -> None:
        super().__init__()
        del self.head

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok_emb(idx) + self.pos_emb(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return F.linear(self.ln_f(x), self.tok_emb.weight)


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 32)
        self.fc3 = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


def build(name: str) -> nn.Module:
    torch.manual_seed(0)
    return {"gpt": GPT, "gpt-direct-head": GPTDirectHead, "mlp": MLP}[name]()


def batch(name: str, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of optimizer step `step`."""
    g = torch.Generator().manual_seed(100 + step)
    if name.startswith("gpt"):
        return (torch.randint(0, 32, (GLOBAL_BATCH, 8), generator=g),
                torch.randint(0, 32, (GLOBAL_BATCH, 8), generator=g))
    return torch.randn(GLOBAL_BATCH, 16, generator=g), torch.randn(GLOBAL_BATCH, 4, generator=g)


def loss_fn(out: Any, y: torch.Tensor) -> torch.Tensor:
    out = getattr(out, "logits", out)
    if y.dtype == torch.long:
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
    return F.mse_loss(out, y)


def full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
            for k, v in model.state_dict().items()}


# -- the plain PyTorch side -------------------------------------------------------------------------
def reference(name: str, world: int = 1, bf16: bool = False) -> dict[str, list[Any]]:
    """Plain loop over the same global batches. float32: one process, the whole batch at once.
    bf16: what FSDP2's policy computes, written out: per step a bfloat16 copy of the float32 weights
    runs each of `world` shares under autocast; float32 gradients averaged; float32 weights updated."""
    model = build(name)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    losses, weights = [], []
    for step in range(STEPS):
        x, y = batch(name, step)
        if not bf16:
            loss = loss_fn(model(x), y)
            loss.backward()
            losses.append(float(loss.detach()))
        else:
            work = copy.deepcopy(model).to(torch.bfloat16)  # deepcopy keeps the tied head tied
            per, total = GLOBAL_BATCH // world, 0.0
            for r in range(world):
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    out = work(x[r * per:(r + 1) * per])
                loss = loss_fn(out.float(), y[r * per:(r + 1) * per])
                loss.backward()
                total += float(loss.detach()) / world
                for p, q in zip(model.parameters(), work.parameters(), strict=True):
                    g = q.grad.float() / world  # type: ignore[union-attr]
                    p.grad = g if p.grad is None else p.grad + g
                work.zero_grad(set_to_none=True)
            losses.append(total)
        optimizer.step()
        optimizer.zero_grad()
        weights.append(full_state(model))
    return {"losses": losses, "weights": weights}


def autocast_reference(name: str) -> dict[str, list[Any]]:
    """The usual bf16 loop: float32 weights, forward under torch.autocast, one process."""
    model = build(name)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    weights = []
    for step in range(STEPS):
        x, y = batch(name, step)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(x)
        loss_fn(out.float(), y).backward()
        optimizer.step()
        optimizer.zero_grad()
        weights.append(full_state(model))
    return {"weights": weights}


# -- the paratrain side -----------------------------------------------------------------------------
def train(name: str, style: str = "forward_backward", accum: int = 1, precision: str = "32") -> dict[str, Any]:
    """STEPS optimizer steps under fsdp; this rank takes its share of each micro-batch by hand."""
    from torch.distributed.fsdp import FSDPModule

    run = paratrain.setup(strategy="fsdp", grad_accum=accum, precision=precision, seed=0)
    model = build(name)
    model, optimizer = run.prepare(model, torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9))
    micro = GLOBAL_BATCH // accum
    per = run.per_worker_batch(GLOBAL_BATCH)
    losses, weights = [], []
    for step in range(STEPS):
        x, y = batch(name, step)
        step_loss = 0.0
        for m in range(accum):
            share = slice(m * micro + run.rank * per, m * micro + (run.rank + 1) * per)
            if style == "forward_backward":
                loss = run.forward_backward(model, x[share], y[share], loss_fn)
            else:
                local = loss_fn(model(x[share]), y[share])
                run.backward(local)
                loss = run.all_reduce(local.detach(), "mean")
            step_loss += float(loss) / accum
        optimizer.step()
        optimizer.zero_grad()
        losses.append(step_loss)
        weights.append(full_state(run.unwrap(model)))
    user = run.unwrap(model)
    out = {
        "losses": losses, "weights": weights,
        "units": sorted(n for n, m in user.named_modules() if isinstance(m, FSDPModule)),
        "tied": name == "gpt" and user.head.weight is user.tok_emb.weight,  # type: ignore[union-attr]
        "optimizer_params": sum(len(g["params"]) for g in optimizer.param_groups),
        "unique_params": len(list(user.parameters())),
        "names": sorted(user.state_dict()),
    }
    run.close()
    return out


CASES: list[tuple[str, dict[str, Any]]] = [
    ("gpt", {"style": "forward_backward"}),
    ("gpt", {"style": "backward"}),
    ("gpt", {"style": "forward_backward", "accum": 2}),
    ("gpt", {"style": "backward", "accum": 2}),
    ("mlp", {"style": "backward"}),
    ("gpt-direct-head", {"style": "forward_backward"}),
    ("gpt", {"style": "forward_backward", "precision": "bf16"}),
    ("gpt", {"style": "backward", "precision": "bf16"}),
]


def _all_cases() -> list[dict[str, Any]]:
    return [train(name, **opts) for name, opts in CASES]


@pytest.fixture(scope="module")
def references() -> dict[str, dict[str, list[Any]]]:
    refs = {name: reference(name) for name in ("gpt", "gpt-direct-head", "mlp")}
    return {**refs, "gpt-autocast": autocast_reference("gpt")}


def _steps_diff(a: list[dict[str, torch.Tensor]], b: list[dict[str, torch.Tensor]]) -> float:
    """The largest weight difference over all steps."""
    assert len(a) == len(b) > 0
    return max(max_diff(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.timeout(240)
@pytest.mark.parametrize("nproc", [2, 3])
def test_fsdp_trains_like_a_plain_loop(nproc: int, references: dict[str, dict[str, list[Any]]]) -> None:
    results = paratrain.launch(_all_cases, nproc=nproc, timeout=220, accelerator="cpu", all_ranks=True)
    bf16_ref = reference("gpt", world=nproc, bf16=True)
    gpt_names = sorted(GPT().state_dict())
    for rank_results in results:
        for (name, opts), got in zip(CASES, rank_results, strict=True):
            label = f"{name} {opts}"
            assert got["units"] == (["", "fc1", "fc2", "fc3"] if name == "mlp" else ["", "blocks.0", "blocks.1"])
            assert got["optimizer_params"] == got["unique_params"], label  # the optimizer holds every shard
            if name == "gpt":
                assert got["tied"] and got["names"] == gpt_names, label  # one Parameter, original names
            if opts.get("precision") == "bf16":
                assert _steps_diff(got["weights"], bf16_ref["weights"]) < 1e-5, label
                assert got["losses"] == pytest.approx(bf16_ref["losses"], abs=1e-5), label
                # bf16 really used: far from float32, and as far from the float32-weight autocast loop
                assert _steps_diff(got["weights"], references["gpt"]["weights"]) > 1e-3, label
                assert _steps_diff(got["weights"], references["gpt-autocast"]["weights"]) < 2e-2, label
                continue
            ref = references[name]
            assert _steps_diff(got["weights"], ref["weights"]) < 1e-6, label
            assert got["losses"] == pytest.approx(ref["losses"], abs=5e-6), label
    # the weights moved: a step that changed nothing would also "match" a run that changed nothing
    assert max_diff(results[0][0]["weights"][-1], full_state(build("gpt"))) > 1e-2
    assert max_diff(results[0][0]["weights"][-1], results[-1][0]["weights"][-1]) == 0.0  # every rank agrees


# -- choosing units ---------------------------------------------------------------------------------
class NanoGPT(nn.Module):
    """nanoGPT's layout: everything inside a ModuleDict, the blocks in a ModuleList inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.transformer = nn.ModuleDict({"wte": nn.Embedding(8, 4), "h": nn.ModuleList(Block(4, 2) for _ in range(3)),
                                          "ln_f": nn.LayerNorm(4)})
        self.lm_head = nn.Linear(4, 8, bias=False)
        self.transformer.wte.weight = self.lm_head.weight


class Wrapped(nn.Module):
    """Blocks two levels down (as in GPT2LMHeadModel.transformer.h), a Sequential of blocks beside them."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Module()
        self.body.layers = nn.ModuleList(Block(4, 2) for _ in range(2))
        self.body.norm = nn.LayerNorm(4)
        self.tail = nn.Sequential(Block(4, 2), nn.ReLU())
        self.head = nn.Linear(4, 2)


def test_units_are_the_blocks_of_containers() -> None:
    assert find_units(GPT()) == ["blocks.0", "blocks.1"]  # tok_emb/head (tied), pos_emb, ln_f: the root
    assert find_units(NanoGPT()) == ["transformer.h.0", "transformer.h.1", "transformer.h.2"]
    assert find_units(Wrapped()) == ["body.layers.0", "body.layers.1", "tail.0"]
    assert find_units(nn.Sequential(nn.Linear(2, 3), nn.ReLU(), nn.Linear(3, 1))) == ["0", "2"]
    assert find_units(MLP()) == ["fc1", "fc2", "fc3"]  # no containers: each child with parameters
    import torchvision

    assert find_units(torchvision.models.resnet18()) == [f"layer{i}.{j}" for i in range(1, 5) for j in range(2)]


def test_tied_and_reused_modules_stay_with_the_root() -> None:
    emb, head, shared = nn.Embedding(5, 3), nn.Linear(3, 5, bias=False), nn.Linear(3, 3)
    head.weight = emb.weight
    assert find_units(nn.Sequential(emb, nn.Linear(3, 3), nn.Linear(3, 3), head)) == ["1", "2"]
    reused = nn.Module()
    reused.blocks = nn.ModuleList([shared, nn.Linear(3, 3)])
    reused.extra = shared  # the same module under two names: its parameters would be sharded twice
    assert find_units(reused) == ["blocks.1"]


def test_named_units_torch_would_refuse_are_refused_with_the_fix() -> None:
    # checked before any process group or fully_shard call: torch raises these only at the first forward
    with pytest.raises(ParatrainError, match=r"'blocks' is a ModuleList.*name its elements instead \('blocks.0', "
                                             r"'blocks.1'\)"):
        apply_fsdp(GPT(), units=["blocks"])
    with pytest.raises(ParatrainError, match=r"unit 'head': parameter 'head.weight' is the same Parameter as "
                                             r"'tok_emb.weight'.*in the root.*leave 'head' out"):
        apply_fsdp(GPT(), units=["head", "blocks.0"])
    with pytest.raises(ParatrainError, match=r"unit 'tok_emb': parameter 'tok_emb.weight'.*'head.weight'.*in unit "
                                             r"'head'.*leave 'tok_emb' and 'head' out"):
        apply_fsdp(GPT(), units=["tok_emb", "head"])
    with pytest.raises(ParatrainError, match=r"unknown fsdp unit.*'block.0'.*Did you mean 'blocks.0'"):
        apply_fsdp(GPT(), units=["block.0"])


def _refusals() -> list[str]:
    from torch.distributed.fsdp import fully_shard

    run = paratrain.setup(strategy="fsdp")
    half_block, half_root = GPT(), GPT()
    half_block.blocks[0].ln1.to(torch.bfloat16)
    half_root.ln_f.to(torch.float64)
    messages = []
    for model in (nn.ModuleList([nn.Linear(2, 2)]), half_block, half_root, fully_shard(nn.Linear(2, 2))):
        try:
            run.prepare(model)
        except ParatrainError as exc:
            messages.append(str(exc))
    run.close()
    return messages


@pytest.mark.timeout(60)
def test_models_fsdp_cannot_shard_are_refused_at_prepare() -> None:
    container, half_block, half_root, sharded = paratrain.launch(_refusals, nproc=1, timeout=50, accelerator="cpu")
    assert "the model is a ModuleList, which has no forward; pass the module whose forward" in container
    assert "unit 'blocks.0' of GPT mixes parameter dtypes" in half_block and "torch.bfloat16" in half_block
    assert "model.float()" in half_block and "precision='bf16'" in half_block
    assert "the root unit of GPT mixes parameter dtypes" in half_root and "ln_f.weight is torch.float64" in half_root
    assert "already sharded (fully_shard was applied to the model itself)" in sharded
    assert "pass the plain module" in sharded


def _fp16_overflow_in_one_shard() -> dict[str, Any]:
    run = paratrain.setup(strategy="fsdp", precision="16", seed=0)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 2))  # weight rows and bias entries: one per rank on 2 ranks
    model, optimizer = run.prepare(model, torch.optim.SGD(model.parameters(), lr=1e-3))
    start = full_state(model)
    x, y = torch.randn(4, 4, generator=torch.Generator().manual_seed(run.rank)), torch.zeros(4, 2)
    y[:, 1] = 50.0  # at the initial scale 2**16 only output 1's gradients overflow: rank 1's shard
    finite, scales, weights = [], [], []
    for _ in range(8):  # the scale halves until rank 1's gradients fit in float16
        run.forward_backward(model, x, y, F.mse_loss)
        finite.append(all(bool(p.grad.to_local().isfinite().all()) for p in model.parameters()))
        optimizer.step()
        optimizer.zero_grad()
        scales.append(run.scaler.get_scale())  # type: ignore[union-attr]
        weights.append(max_diff(full_state(model), start))
    run.close()
    return {"finite": finite, "scales": scales, "moved": weights}


@pytest.mark.timeout(60)
def test_fp16_overflow_in_one_rank_shard_skips_the_step_on_every_rank() -> None:
    rank0, rank1 = paratrain.launch(_fp16_overflow_in_one_shard, nproc=2, timeout=50, accelerator="cpu", all_ranks=True)
    assert rank0["finite"][0] and not rank1["finite"][0]  # the overflow is in rank 1's shard only ...
    assert rank0["scales"] == rank1["scales"] and rank0["scales"][0] == 2.0**15  # ... yet both back off
    assert rank0["moved"][0] == 0.0  # and neither rank stepped its shard
    assert rank0["moved"][-1] > 0.0 and rank0["moved"] == rank1["moved"], (rank0, rank1)


# -- checkpoints ------------------------------------------------------------------------------------
def _adam_steps(run: Any, model: nn.Module, optimizer: Any, steps: range, style: str) -> list[dict[str, Any]]:
    per = run.per_worker_batch(GLOBAL_BATCH)
    out = []
    for step in steps:
        x, y = batch("gpt", step)
        share = slice(run.rank * per, (run.rank + 1) * per)
        if style == "forward_backward":
            run.forward_backward(model, x[share], y[share], loss_fn)
        else:
            run.backward(loss_fn(model(x[share]), y[share]))
        optimizer.step()
        optimizer.zero_grad()
        out.append(full_state(run.unwrap(model)))
    return out


def _prepared(strategy: str, ckpt: str) -> tuple[Any, nn.Module, Any, dict[str, Any]]:
    run = paratrain.setup(strategy=strategy, seed=0, checkpoint_dir=ckpt)
    model = build("gpt")
    # eps=1e-3: a k-projection bias has an exactly-zero true gradient (softmax ignores a constant per
    # row), and Adam with a tiny eps would turn its round-off into full-size steps that differ per world size
    model, optimizer = run.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-3))
    return run, model, optimizer, {"model": model, "optimizer": optimizer, "step": 0}


def _snapshot(run: Any, model: nn.Module, optimizer: Any) -> dict[str, Any]:
    """Whole weights and Adam moments by parameter name."""
    from torch.distributed.tensor import DTensor

    def whole(t: torch.Tensor) -> torch.Tensor:
        return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()

    named = run.unwrap(model).named_parameters()
    moments = {f"{n}.{k}": whole(optimizer.state[p][k]) for n, p in named for k in ("exp_avg", "exp_avg_sq")}
    return {"weights": full_state(run.unwrap(model)), "moments": moments}


def _save_then_continue(ckpt: str) -> dict[str, Any]:
    run, model, optimizer, state = _prepared("fsdp", ckpt)
    _adam_steps(run, model, optimizer, range(2), "forward_backward")
    state["step"] = 2
    run.save(state)
    saved = _snapshot(run, model, optimizer)
    saved["after"] = _adam_steps(run, model, optimizer, range(2, 4), "forward_backward")
    run.close()
    return saved


def _resume(ckpt: str, strategy: str) -> dict[str, Any]:
    run, model, optimizer, state = _prepared(strategy, ckpt)
    assert run.load(state) and state["step"] == 2
    loaded = _snapshot(run, model, optimizer)
    loaded["after"] = _adam_steps(run, model, optimizer, range(2, 4), "backward")
    loaded["tied"] = run.unwrap(model).head.weight is run.unwrap(model).tok_emb.weight
    run.close()
    return loaded


@pytest.mark.timeout(200)
def test_sharded_checkpoint_resumes_on_another_world_size_and_under_single(tmp_path: Path) -> None:
    saved = paratrain.launch(_save_then_continue, str(tmp_path), nproc=2, timeout=90, accelerator="cpu")
    assert (tmp_path / "step-000000002" / "model" / ".metadata").exists()
    three = paratrain.launch(_resume, str(tmp_path), "fsdp", nproc=3, timeout=90, accelerator="cpu")
    one = paratrain.launch(_resume, str(tmp_path), "single", nproc=1, timeout=60, accelerator="cpu")
    for resumed in (three, one):
        assert resumed["tied"]
        assert max_diff(resumed["weights"], saved["weights"]) == 0.0
        assert max_diff(resumed["moments"], saved["moments"]) == 0.0
        assert _steps_diff(resumed["after"], saved["after"]) < 1e-6  # observed 1.2e-7
    # neither the checkpoint nor the moments are trivial
    assert max_diff(saved["weights"], full_state(build("gpt"))) > 1e-2
    assert min(float(m.abs().max()) for m in saved["moments"].values()) > 0


# -- a Hugging Face transformer -----------------------------------------------------------------------
def _gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=32, n_positions=8, n_embd=16, n_layer=2, n_head=2, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=True, bos_token_id=0,
                        eos_token_id=0)
    return GPT2LMHeadModel(config)


def _gpt2_fsdp() -> dict[str, Any]:
    from torch.distributed.fsdp import FSDPModule

    run = paratrain.setup(strategy="fsdp", seed=0)
    model = _gpt2()
    model, optimizer = run.prepare(model, torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9))
    per = run.per_worker_batch(GLOBAL_BATCH)
    weights = []
    for step in range(STEPS):
        x, y = batch("gpt", step)
        share = slice(run.rank * per, (run.rank + 1) * per)
        run.forward_backward(model, x[share], y[share], loss_fn)
        optimizer.step()
        optimizer.zero_grad()
        weights.append(full_state(model))
    units = sorted(n for n, m in model.named_modules() if isinstance(m, FSDPModule))
    tied = model.lm_head.weight is model.transformer.wte.weight
    run.close()
    return {"weights": weights, "units": units, "tied": tied}


@pytest.mark.timeout(200)
def test_hugging_face_gpt2_with_tied_embeddings() -> None:
    pytest.importorskip("transformers")
    model = _gpt2()
    assert model.lm_head.weight is model.transformer.wte.weight
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    expected = []
    for step in range(STEPS):
        x, y = batch("gpt", step)
        loss_fn(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
        expected.append(full_state(model))
    got = paratrain.launch(_gpt2_fsdp, nproc=2, timeout=180, accelerator="cpu")
    assert got["units"] == ["", "transformer.h.0", "transformer.h.1"] and got["tied"]
    assert _steps_diff(got["weights"], expected) < 1e-6
    assert max_diff(got["weights"][-1], full_state(_gpt2())) > 1e-2
