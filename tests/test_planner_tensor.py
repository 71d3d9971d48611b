"""The planner's tensor-parallel layouts: what the profile finds a plan splits, how a layout's step and memory
follow from it, that the search offers them only where a plan exists, and that every predicted layout is one
`paratrain.setup` accepts with the same degrees. Pure logic, no processes."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from paratrain.config import make_config
from paratrain.measure import workloads
from paratrain.parallel.dims import dims_for
from paratrain.planner import cluster as clusters
from paratrain.planner import comm, costs, predict, search, transformer
from paratrain.planner.costs import LayerCost, Profile
from paratrain.planner.layout import Layout
from paratrain.planner.profile import measure


def _cluster(**changes: object) -> clusters.Cluster:
    spec = {"name": "test", "kind": "cuda", "devices_per_node": 4, "nodes": 2,
            "device": {"peak_tflops": {"32": 100, "bf16": 100}, "memory_gib": 16, "memory_bandwidth_gbps": 1000},
            "intra_node": {"bandwidth_gbps": 100, "latency_us": 2},
            "inter_node": {"bandwidth_gbps": 10, "latency_us": 10},
            "efficiency": [[1, 1.0]], "tp_overhead_us": 50, **changes}
    return clusters.from_spec(spec)


def _profile(share: float = 0.75, width: int = 64) -> Profile:
    """Four layers of 1,000 parameters, 800 of them in planned Linears; measured seconds at 8 and 4 samples."""
    layer = dict(params=1000, param_bytes=4000, flops_fwd=1e9, flops_bwd=2e9, activation_bytes=100.0,
                 output_bytes=50.0, seconds={8: (0.8, 1.6), 4: (0.5, 1.0)}, tp_share=share, tp_params=800,
                 tp_forward_reduces=(40.0,), tp_backward_reduces=(40.0, 40.0))
    return Profile(name="chain", layers=[LayerCost(name=str(i), **layer) for i in range(4)], sample_bytes=8.0,
                   tp_width=width, tp_note="plan from test")


def test_the_profile_finds_what_a_plan_splits_in_each_layer() -> None:
    torch.manual_seed(0)
    mlp = workloads.mlp(width=32, depth=4, batch=8)
    prof = measure(mlp.model(), mlp.data, mlp.loss(), [4], name="mlp", repeats=1, tp_plan=mlp.tp_plan)
    # Linear 0 colwise, ReLU between (its input is split), Linear 2 rowwise; ReLU 3 after the pair stays whole
    assert [x.tp_share for x in prof.layers] == [1.0, 1.0, 1.0, 0.0] * 2
    first, _, second, _ = prof.layers[:4]
    assert first.tp_params == 32 * 32 + 32 and second.tp_params == 32 * 32  # a row-split bias stays whole
    assert first.tp_backward_reduces == (32 * 4,) and first.tp_forward_reduces == ()
    assert second.tp_forward_reduces == (32 * 4,) and second.tp_backward_reduces == ()
    assert prof.tp_width == 32
    assert sum(len(x.tp_forward_reduces) + len(x.tp_backward_reduces) for x in prof.layers) == 4  # planned Linears

    gpt = workloads.gpt("tiny")
    cfg_model = gpt.model()
    prof = measure(cfg_model, gpt.data, gpt.loss(), [2], name="gpt", repeats=1, tp_plan=gpt.tp_plan)
    embed, *blocks, head = prof.layers
    assert embed.tp_share == head.tp_share == 0 and embed.tp_params == head.tp_params == 0
    # the head's weight is the embedding's (tied): held once, and a stage with the head alone holds its copy
    tied = cfg_model.head.proj.weight.numel()
    assert (head.shared_params, head.shared_with) == (tied, (embed.name,))
    assert prof.params == sum(p.numel() for p in cfg_model.parameters())  # distinct parameters
    assert costs.tensor_params([head], 1)[0] == head.params
    # a block's backward counted once (its two gradient passes apart would count its inner products twice):
    # the layers add up to one whole step's count
    x, y = gpt.data(2)
    with FlopCounterMode(display=False) as counted:
        gpt.loss()(cfg_model(x), y).backward()
    assert prof.flops_per_sample() * 2 == pytest.approx(counted.get_total_flops(), rel=1e-9)
    block = cfg_model.blocks[0]
    d_model, tokens = block.mlp.fc.in_features, gpt.tokens
    for x in blocks:
        assert 0.3 < x.tp_share < 1.0  # the MLP's products split, attention's fused qkv whole
        assert x.tp_params == sum(p.numel() for p in block.mlp.parameters()) - d_model
        assert x.tp_forward_reduces == x.tp_backward_reduces == (4.0 * d_model * tokens,)
    # with no plan given, the fused qkv is refused, and the refusal is what the planner says for tp layouts
    whole = measure(gpt.model(), gpt.data, gpt.loss(), [2], name="gpt", repeats=1)
    assert whole.tp_width == 0 and "fused projection" in (whole.tp_note or "")
    out = predict.predict(whole, Layout(strategy="tp", tp=2), _cluster(), 4)
    assert not out.fits and "fused projection" in (out.reason or "")


def test_a_tensor_rank_runs_its_share_and_pays_its_all_reduces() -> None:
    prof, c = _profile(), _cluster(measured_here=True)  # the profile's seconds apply
    single = predict.predict(prof, Layout(strategy="single"), c, 8, optimizer="sgd")
    tp = predict.predict(prof, Layout(strategy="tp", tp=2), c, 8, optimizer="sgd")
    # per layer: a quarter whole at 8 samples, three quarters at 4 samples' time; plus the all-reduces and
    # DTensor's cost of each of the three planned Linears' calls
    reduce = comm.collective_time(c, "all_reduce", 40.0 * 8, comm.Group(2, False))
    per_layer = 0.25 * (0.8 + 1.6) + 0.75 * (0.5 + 1.0) + 3 * reduce + 3 * 50e-6
    assert tp.compute_s + tp.exposed_comm_s == pytest.approx(4 * per_layer)
    loss = comm.collective_time(c, "all_reduce", 4, comm.Group(2, False))  # the step's loss, averaged
    assert tp.exposed_comm_s == pytest.approx(4 * 3 * reduce + loss)
    assert tp.step_s < single.step_s
    # parameters: the planned 800 of each 1,000 are halved; activations: the split share halved
    assert tp.memory.params == pytest.approx(4 * 4 * (200 + 400))
    assert tp.memory.activations == pytest.approx((4 * 100 * (1 - 0.75 / 2) + 2 * 50) * 8)


def test_a_layout_that_cannot_split_says_why() -> None:
    c = _cluster()
    no_plan = Profile(name="x", layers=_profile().layers, sample_bytes=8.0, tp_width=0,
                      tp_note="no tensor-parallel layouts: BatchNorm")
    assert "BatchNorm" in (predict.predict(no_plan, Layout(strategy="tp", tp=2), c, 8).reason or "")
    odd = _profile(width=6)
    assert "greatest common divisor 6" in (predict.predict(odd, Layout(strategy="tp", tp=4), c, 8).reason or "")
    assert search.tensor_degrees(odd, c, 4) == [2]
    assert search.tensor_degrees(no_plan, c, 4) == []
    names = {p.layout.strategy for p in search.layouts(no_plan, c, 8, devices=4)}
    assert names and not any("tp" in n for n in names)


def test_every_tensor_layout_the_search_offers_is_one_setup_accepts_with_the_same_degrees() -> None:
    prof, c = _profile(), _cluster()
    found = search.layouts(prof, c, 16, devices=8, optimizer="sgd")
    tensor = [p.layout for p in found if p.layout.tp > 1]
    assert {x.strategy for x in tensor} == {"ddp+tp", "fsdp+tp", "ddp+fsdp+tp", "tp+pp", "ddp+tp+pp", "fsdp+tp+pp"}
    assert {x.tp for x in tensor} == {2, 4}  # 8 would leave the node of 4
    for layout in tensor:
        kwargs = layout.setup_kwargs(c)
        make_config(kwargs)
        dims = dims_for(layout.strategy, layout.devices, tp_size=kwargs.get("tp_size"),
                        pp_size=kwargs.get("pp_size"), dp_replicate=kwargs.get("dp_replicate"))
        assert dims == layout.dims, layout.label
    assert Layout(strategy="ddp+tp+pp", dp=2, tp=2, pp=2, schedule="1f1b", microbatches=4).label == \
        "ddp+tp+pp 2x2x2 (1f1b, M=4)"


def test_cpu_workers_beyond_the_cores_are_predicted_slow() -> None:
    prof, loopback = _profile(), {"bandwidth_gbps": 100, "latency_us": 2}
    two = _cluster(kind="cpu", devices_per_node=2, nodes=1, inter_node=loopback)
    four = _cluster(kind="cpu", devices_per_node=4, nodes=1, inter_node=loopback)
    for layout in (Layout(strategy="fsdp+tp", dp=2, tp=2),
                   Layout(strategy="tp+pp", tp=2, pp=2, schedule="1f1b", microbatches=4)):
        shared, alone = predict.predict(prof, layout, two, 8), predict.predict(prof, layout, four, 8)
        assert shared.step_s > 1.5 * alone.step_s, layout.label  # four workers' work on two cores


def test_the_analytic_gpt_splits_as_megatron_does() -> None:
    gpt = transformer.get("gpt-7.5b")
    prof = transformer.profile(gpt, "bf16")
    block = prof.layers[1]
    h = gpt.hidden
    assert block.tp_params == pytest.approx(12 * h * h, rel=0.01)
    assert block.tp_forward_reduces == (2 * gpt.seq * h,) * 2 and len(block.tp_backward_reduces) == 2
    layout = Layout(strategy="tp", tp=8, precision="bf16")
    one = predict.predict(prof, Layout(strategy="single", precision="bf16"), clusters.load("h100-nvlink"), 8)
    eight = predict.predict(prof, layout, clusters.load("h100-nvlink"), 8)
    assert eight.memory.params < one.memory.params / 4 and eight.fits and not one.fits
