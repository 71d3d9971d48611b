"""N-D layouts beyond the matrix: HSDP (ddp+fsdp), the user's own loop (`run.backward`) under ddp+tp, a user
`tp_plan` that makes a refused model train, and a forward that would silently compute the wrong heads; checkpoints
of strided DTensors (fused projections, FSDP over tensor parallelism): exact across layouts, and saved and loaded
without gathering them. Checkpoints across N-D layouts: tests/test_resume_layouts.py."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import zoo
from matrix_cells import full_state
from zoo.compare import mismatches
from zoo.reference import Optim, chunk, global_batches, run_reference

import paratrain
from paratrain.checkpoint import strided

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


def _strided_checkpoint(strategy: str, options: dict[str, Any], folder: str, save: bool,
                        native: bool = True) -> dict[str, Any]:
    """Hugging Face GPT-2 (its Conv1D attention fused as q, k, v: a strided DTensor under tensor parallelism) with
    AdamW: one step then saved, or a fresh model loaded from what was saved (`native`: see
    `_strided_save_load_memory`)."""
    strided.NATIVE = native
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
@pytest.mark.parametrize("native", [True, False], ids=["regions", "plain-split"])
def test_fused_weights_checkpoint_whole_and_load_under_any_layout(tmp_path: Any, native: bool) -> None:
    """A checkpoint of strided DTensors (each rank writing its pieces as regions of the whole tensor, or on an older
    torch a plain split of it) loads into the same layout, another tensor degree and one process, weights and
    Adam's moments exactly as saved."""
    if native and not strided.NATIVE:
        pytest.skip("this torch's DCP takes one region per tensor")
    folder = str(tmp_path)
    saved = paratrain.launch(_strided_checkpoint, "fsdp+tp", {"tp_size": 2}, folder, True, native, nproc=4,
                             timeout=200, accelerator="cpu")
    for strategy, nproc in (("fsdp+tp", 4), ("tp", 2), ("single", 1)):
        options = {"tp_size": 2} if strategy == "fsdp+tp" else {}
        loaded = paratrain.launch(_strided_checkpoint, strategy, options, folder, False, native, nproc=nproc,
                                  timeout=200, accelerator="cpu")
        assert sorted(loaded) == sorted(saved)
        for key, value in saved.items():
            assert torch.equal(loaded[key], value), (strategy, key)


def _resident() -> tuple[int, int]:
    """(resident bytes now, peak resident bytes since the last `_reset_peak`): /proc/self/statm and VmHWM."""
    import os

    with open("/proc/self/statm") as f:
        now = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    with open("/proc/self/status") as f:
        peak = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    return now, peak


def _reset_peak() -> None:
    """Free memory goes back to the system (else a phase reusing what an earlier one freed looks free), then VmHWM
    starts again from the resident set now."""
    import ctypes

    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _mmap_large() -> None:
    """Every allocation above 1 MiB its own mapping, unmapped when freed (glibc otherwise raises its threshold to
    the largest block freed and keeps such blocks), so the resident set follows the tensors alive."""
    import ctypes

    ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD


def _strided_save_load_memory(folder: str, native: bool) -> dict[str, Any]:
    """Under fsdp+tp 2 x 2, four Linear(d, 4d) -> GELU -> Linear(4d, d) blocks with SGD momentum: the first Linear
    of each block (weight, bias and their momenta) is a strided DTensor (FSDP's shard of a column-parallel one),
    half of the state. How much each of `run.save` and `run.load` adds to the rank's resident set at its peak,
    and whether the load gave every local piece back exactly (`native`: DCP's regions of one local tensor; else
    the older torch's plain-split fallback)."""
    from torch.distributed.tensor import DTensor

    strided.NATIVE = native
    _mmap_large()
    # a blocking save: one written in the background first copies the rank's share to CPU memory, by design
    run = paratrain.setup(strategy="fsdp+tp", tp_size=2, seed=0, accelerator="cpu", timeout_s=120,
                          checkpoint_dir=folder, async_save=False)
    try:
        d = 1024
        torch.manual_seed(0)
        model = torch.nn.Sequential(*(torch.nn.Sequential(torch.nn.Linear(d, 4 * d), torch.nn.GELU(),
                                                          torch.nn.Linear(4 * d, d)) for _ in range(4)))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        x = torch.randn(2, d, generator=torch.Generator().manual_seed(run.rank // 2))
        model, optimizer = run.prepare(model, optimizer, example=x)
        run.forward_backward(model, x, x, torch.nn.functional.mse_loss)
        optimizer.step()
        optimizer.zero_grad()
        held = [t for p in run.unwrap(model).parameters() for t in (p, optimizer.state[p]["momentum_buffer"])]
        assert all(isinstance(t, DTensor) for t in held)
        whole = [t.numel() * t.element_size() for t in held]
        out = {"share": sum(t.to_local().numel() * t.element_size() for t in held), "largest": max(whole),
               "strided": sum(w for w, t in zip(whole, held) if strided._is_strided(t)), "total": sum(whole)}
        before = [t.to_local().clone() for t in held]
        state = {"model": model, "optimizer": optimizer, "step": 1}
        _reset_peak()
        start, _ = _resident()
        run.save(state)
        out["save"] = _resident()[1] - start
        with torch.no_grad():
            for t in held:
                t.to_local().zero_()
        _reset_peak()
        start, _ = _resident()
        run.load(state)
        out["load"] = _resident()[1] - start
        out["restored"] = all(torch.equal(t.to_local(), b) for t, b in zip(held, before))
        return out
    finally:
        run.close()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("native", [True, False], ids=["regions", "plain-split"])
def test_strided_tensors_are_saved_and_loaded_without_gathering_them(tmp_path: Any, native: bool) -> None:
    """run.save and run.load of strided DTensors stay within the sharded goal (a rank holds at most its share,
    a quarter more, and the largest tensor): DCP writes and reads each rank's regions of them in place (torch
    >= 2.14), or (older torch) they are re-split plainly one tensor at a time. Writing them whole, as before, made
    every rank hold all of them at once: the whole of half the state, 4x its share here."""
    if native and not strided.NATIVE:
        pytest.skip("this torch's DCP takes one region per tensor")
    results = paratrain.launch(_strided_save_load_memory, str(tmp_path), native, nproc=4, timeout=250,
                               accelerator="cpu", all_ranks=True)
    for rank, got in enumerate(results):
        assert got["restored"], f"rank {rank}: the load did not give back the saved pieces"
        assert got["strided"] >= got["total"] / 2  # strided tensors are half the state: whole, 2x a rank's share
        bound = 0.25 * got["share"] + got["largest"]
        if not native:  # a second copy of the rank's share of the strided tensors, and one tensor gathered (its
            bound += got["strided"] / 4 + 2 * got["largest"]  # pieces and their join)
        for phase in ("save", "load"):
            assert got[phase] <= bound, (f"rank {rank}: {phase} added {got[phase] / 1e6:.1f} MB to the resident set, "
                                         f"more than {bound / 1e6:.1f} MB (share {got['share'] / 1e6:.1f} MB, "
                                         f"strided tensors whole {got['strided'] / 1e6:.1f} MB)")


REGION_CASES = [((8, 6), "strided0,shard0"), ((10, 6), "strided0,shard0"), ((7, 9), "shard0,strided1"),
                ((3, 8, 12), "replicate,strided2"), ((4, 6, 10), "shard0,strided2"), ((5, 12), "strided1,replicate")]
"""(whole shape, placements on a 2 x 2 mesh): FSDP over a column-parallel weight, evenly and not; a fused q/k/v
weight under fsdp+tp; an expert's gate/up weight under tp, and under fsdp+tp; one replicated over the other axis."""


def _placement(name: str) -> Any:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    if name == "replicate":
        return Replicate()
    dim = int(name[-1])
    return _StridedShard(dim, split_factor=3 if dim == 1 else 2) if name.startswith("strided") else Shard(dim)


def _regions_of_pieces() -> list[str]:
    """On a 2 x 2 mesh: each case's whole tensor (distinct values) split by DTensor; this rank's regions must each
    equal their place in the whole tensor, cover its local piece exactly once, and (all ranks) every element of the
    whole tensor as often as it is replicated."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    dist.init_process_group("gloo")
    try:
        mesh = init_device_mesh("cpu", (2, 2))
        problems = []
        for shape, names in REGION_CASES:
            placements = [_placement(n) for n in names.split(",")]
            whole = torch.arange(int(torch.tensor(shape).prod())).view(shape)
            piece = distribute_tensor(whole, mesh, placements, src_data_rank=None)
            local, found = piece.to_local(), strided.regions(piece)
            seen = torch.zeros_like(local)
            for g, lo, size in found:
                at_local = tuple(slice(o, o + s) for o, s in zip(lo, size))
                at_whole = tuple(slice(o, o + s) for o, s in zip(g, size))
                if not torch.equal(local[at_local], whole[at_whole]):
                    problems.append(f"{shape} {names}: region {g} {size} holds other values")
                seen[at_local] += 1
            if not bool((seen == 1).all()):
                problems.append(f"{shape} {names}: the regions cover the local piece unevenly")
            every: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(every, found)
            count = torch.zeros(shape, dtype=torch.long)
            for regions in every:
                for g, _, size in regions:
                    count[tuple(slice(o, o + s) for o, s in zip(g, size))] += 1
            copies = 2 if "replicate" in names else 1
            if not bool((count == copies).all()):
                problems.append(f"{shape} {names}: the ranks' regions do not tile the whole tensor")
        return problems
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_a_strided_piece_is_found_as_regions_of_the_whole_tensor() -> None:
    for rank, problems in enumerate(paratrain.launch(_regions_of_pieces, nproc=4, timeout=100, accelerator="cpu",
                                                     all_ranks=True)):
        assert not problems, f"rank {rank}: {problems}"
