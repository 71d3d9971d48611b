"""The planner's cost model: alpha-beta collectives, cluster specs, memory accounting, the analytic GPT
against torch's FLOP counter, layer profiling, and the search's pruning. Pure logic, no processes."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch import nn

from paratrain.config import make_config
from paratrain.errors import ParatrainError
from paratrain.planner import cluster as clusters
from paratrain.planner import comm, predict, search, transformer
from paratrain.planner.costs import LayerCost, Profile
from paratrain.planner.layout import Layout
from paratrain.planner.profile import measure

GIB = 2**30


def _cluster(**changes: object) -> clusters.Cluster:
    spec = {"name": "test", "kind": "cuda", "devices_per_node": 4, "nodes": 2,
            "device": {"peak_tflops": {"32": 100, "bf16": 100}, "memory_gib": 16, "memory_bandwidth_gbps": 1000},
            "intra_node": {"bandwidth_gbps": 100, "latency_us": 2},
            "inter_node": {"bandwidth_gbps": 10, "latency_us": 10},
            "efficiency": [[1, 1.0]], **changes}
    return clusters.from_spec(spec)


def _profile(layers: int = 8, params: int = 1000, act: float = 100.0, flops: float = 1e9) -> Profile:
    layer = dict(params=params, param_bytes=4 * params, flops_fwd=flops, flops_bwd=2 * flops, weight_share=0.5,
                 activation_bytes=act, output_bytes=act / 2)
    return Profile(name="chain", layers=[LayerCost(name=str(i), **layer) for i in range(layers)], sample_bytes=8.0,
                   source="analytic")


# -- communication ----------------------------------------------------------------------------------


@pytest.mark.parametrize("p", [2, 3, 8, 64])
def test_all_reduce_follows_the_ring_formula(p: int) -> None:
    n, alpha, beta = 3e8, 5e-6, 1 / 40e9
    assert comm.time("all_reduce", n, p, alpha, beta) == pytest.approx(2 * (p - 1) / p * n * beta + 2 * (p - 1) * alpha)
    assert comm.time("all_gather", n, p, alpha, beta) == pytest.approx((p - 1) / p * n * beta + (p - 1) * alpha)
    assert comm.time("reduce_scatter", n, p, alpha, beta) == pytest.approx((p - 1) / p * n * beta + (p - 1) * alpha)
    assert comm.time("p2p", n, p, alpha, beta) == pytest.approx(n * beta + alpha)
    assert comm.time("all_reduce", n, 1, alpha, beta) == 0.0


def test_groups_that_cross_nodes_use_the_network_link() -> None:
    c = _cluster()
    n = 1e9
    inside = comm.collective_time(c, "all_reduce", n, comm.Group(4, False))
    across = comm.collective_time(c, "all_reduce", n, comm.Group(8, True))
    assert inside == pytest.approx(2 * 3 / 4 * n / 100e9 + 6 * 2e-6)
    assert across == pytest.approx(2 * 7 / 8 * n / 10e9 + 14 * 10e-6)
    # the N-D mesh, pipeline outermost, tensor innermost (4 devices a node): a stage's replicas are neighbours,
    # pipelines cross nodes first; tensor ranks push replicas apart
    assert comm.pipeline_groups(c, dp=2, pp=4) == (comm.Group(2, False), comm.Group(4, True))
    assert comm.pipeline_groups(c, dp=1, pp=8) == (comm.Group(1, False), comm.Group(8, True))
    assert comm.pipeline_groups(c, dp=4, pp=1) == (comm.Group(4, False), comm.Group(1, False))
    assert comm.pipeline_groups(c, dp=2, pp=2, tp=2) == (comm.Group(2, False), comm.Group(2, True))
    assert comm.pipeline_groups(c, dp=4, pp=1, tp=2) == (comm.Group(4, True), comm.Group(1, False))


def test_fit_recovers_alpha_and_beta_from_a_sweep() -> None:
    alpha, beta = 80e-6, 1 / 3e9
    points = [(n, comm.time("all_reduce", n, 2, alpha, beta)) for n in (4096 * 4**i for i in range(7))]
    assert comm.fit("all_reduce", 2, points) == pytest.approx((alpha, beta), rel=1e-9)
    flat = [(n, comm.time("p2p", n, 2, 0.0, beta)) for n in (1e4, 1e6, 1e8)]
    assert comm.fit("p2p", 2, flat) == pytest.approx((0.0, beta), abs=1e-15)


# -- cluster specs ----------------------------------------------------------------------------------


def test_presets_load_and_specs_round_trip_through_json_and_yaml(tmp_path: Path) -> None:
    for name in clusters.PRESETS:
        c = clusters.load(name)
        assert c.devices >= 8 and c.peak("bf16") > 1e14 and c.memory > 70 * GIB
    ib = clusters.load("h100-ib")
    assert ib.devices == 1024 and ib.inter.bandwidth < ib.intra.bandwidth
    again = clusters.load(str(clusters.write(ib, tmp_path / "ib.json")))
    assert again == ib
    yaml = pytest.importorskip("yaml")
    (tmp_path / "mine.yaml").write_text(yaml.safe_dump(ib.as_spec()))
    assert clusters.load(str(tmp_path / "mine.yaml")) == ib
    assert ib.resized(64).nodes == 8 and ib.resized(4).devices_per_node == 4


@pytest.mark.parametrize("change,message", [
    ({"nodes": 0}, "nodes must be a positive integer"),
    ({"device": {"peak_tflops": {}}}, "device.peak_tflops"),
    ({"intra_node": {"bandwidth_gbps": -1}}, "intra_node.bandwidth_gbps"),
    ({"efficiency": [[1e9, 1.5]]}, "efficiency"),
    ({"colour": "blue"}, "unknown key"),
])
def test_bad_specs_name_the_key_to_fix(change: dict[str, object], message: str) -> None:
    with pytest.raises(ParatrainError, match=message):
        _cluster(**change)


def test_unknown_preset_suggests_the_closest(tmp_path: Path) -> None:
    with pytest.raises(ParatrainError, match="Did you mean 'h100-ib'"):
        clusters.load("h100-ibx")
    with pytest.raises(ParatrainError, match="does not exist"):
        clusters.load(str(tmp_path / "missing.json"))


def test_efficiency_interpolates_in_log_flops() -> None:
    c = _cluster(efficiency=[[1e9, 0.1], [1e11, 0.5]])
    assert c.efficiency_at(1e8) == 0.1 and c.efficiency_at(1e12) == 0.5
    assert c.efficiency_at(1e10) == pytest.approx(0.3)


# -- memory accounting ------------------------------------------------------------------------------


def test_memory_of_data_parallel_layouts() -> None:
    prof, c = _profile(), _cluster()
    params = prof.params
    single = predict.predict(prof, Layout(strategy="single"), c, 16).memory
    # Adam: two float32 states and the temporary its step makes
    assert (single.params, single.grads, single.optimizer, single.temporary) == (4 * params, 4 * params,
                                                                                 8 * params, 4 * params)
    assert single.activations == pytest.approx((8 * 100 + 2 * 50) * 16)
    held = single.params + single.optimizer + single.data
    if c.kind == "cuda":  # the allocator reuses the activations' memory for gradients and the step's temporary
        assert single.phased and single.total == pytest.approx(held + max(single.activations, 8 * params))
    on_cpu = predict.predict(prof, Layout(strategy="single"), replace(c, kind="cpu"), 16).memory
    assert not on_cpu.phased and on_cpu.total == pytest.approx(held + single.activations + 8 * params)
    accumulating = predict.predict(prof, Layout(strategy="single", grad_accum=2), c, 16).memory
    assert not accumulating.phased  # gradients stay through the next micro-step's forward
    ddp = predict.predict(prof, Layout(strategy="ddp", dp=4), c, 16).memory
    assert ddp.buffers == 4 * params  # DDP's buckets copy the gradients
    assert ddp.activations == pytest.approx((8 * 100 + 2 * 50) * 4)
    fsdp = predict.predict(prof, Layout(strategy="fsdp", dp=4), c, 16).memory
    assert (fsdp.params, fsdp.optimizer, fsdp.temporary) == (params, 2 * params, params)  # sharded four ways
    sgd = predict.predict(prof, Layout(strategy="single"), c, 16, optimizer="sgd").memory
    assert sgd.optimizer == 0


def test_pipeline_memory_follows_the_schedules_in_flight_micro_batches() -> None:
    prof, c = _profile(act=100.0), _cluster()
    per_stage = 4 * 100.0 * 2  # 4 layers of 100 B per sample, micro-batches of 2 samples
    gpipe = predict.predict(prof, Layout(strategy="pp", pp=2, schedule="gpipe", microbatches=8), c, 16).memory
    one_f1b = predict.predict(prof, Layout(strategy="pp", pp=2, schedule="1f1b", microbatches=8), c, 16).memory
    assert gpipe.in_flight == 8 and one_f1b.in_flight == 2
    assert gpipe.activations == pytest.approx(8 * per_stage + 2 * 50 * 2)
    assert one_f1b.activations == pytest.approx(2 * per_stage + 2 * 50 * 2)
    assert one_f1b.params == 4 * 4 * 1000  # half the layers
    assert one_f1b.data == 8.0 * 16  # every pipeline rank holds the replica's batch


def test_cpu_pipeline_ranks_keep_the_high_water_of_their_build() -> None:
    prof = _profile(act=100.0)
    layout = Layout(strategy="pp", pp=2, schedule="1f1b", microbatches=2)
    cpu = predict.predict(prof, layout, _cluster(kind="cpu"), 16).memory
    build = prof.param_bytes + (8 * 100 + 2 * 50) * 8  # every layer's trial run on one micro-batch of 8
    assert cpu.retained == pytest.approx(build - cpu.activations - cpu.grads)
    assert predict.predict(prof, layout, _cluster(), 16).memory.retained == 0  # GPU peaks are allocator peaks


def test_the_build_is_a_peak_of_its_own_whole_on_every_rank_or_a_share_from_the_meta_device() -> None:
    prof = _profile(params=10**8)  # 8 layers of 0.4 GB: 3.2 GB of float32 weights
    whole, layer = prof.param_bytes, 4 * 10**8
    fsdp = Layout(strategy="fsdp", dp=4)
    cpu = _cluster(kind="cpu", device={"peak_tflops": {"32": 1}, "memory_gib": 3.5, "memory_bandwidth_gbps": 10})
    built = predict.predict(prof, fsdp, cpu, 16, optimizer="sgd")
    meta = predict.predict(replace(prof, built="meta"), fsdp, cpu, 16, optimizer="sgd")
    assert built.memory.build == whole + whole / 4  # the whole model, and the share the layout copies out of it
    assert meta.memory.build == whole / 4 + layer  # its share, and one layer made whole at a time
    assert built.memory.total == whole * 1.25 > meta.memory.total  # the build is the peak of the whole build
    assert not built.fits and "build 3.7" in built.reason and "meta device" in built.reason
    assert meta.fits, meta.reason
    one = predict.predict(prof, Layout(strategy="single"), cpu, 16, optimizer="sgd").memory
    assert one.build == whole and one.total > one.build  # one process: the step holds more than the build
    on_gpu = predict.predict(prof, fsdp, _cluster(), 16, optimizer="sgd").memory
    assert on_gpu.build == 0  # a whole build is host memory, which a GPU's peak does not count
    pp = Layout(strategy="pp", pp=2, schedule="1f1b", microbatches=2)
    assert predict.predict(replace(prof, built="meta"), pp, cpu, 16).memory.retained == 0  # balanced by bytes


def test_layouts_that_cannot_run_say_why() -> None:
    prof, c = _profile(layers=3), _cluster()
    assert "fewer than the 4 stages" in predict.predict(prof, Layout(strategy="pp", pp=4, microbatches=4,
                                                                      schedule="gpipe"), c, 16).reason
    assert "does not split" in predict.predict(prof, Layout(strategy="ddp", dp=3), c, 16).reason
    assert "1f1b" in predict.predict(prof, Layout(strategy="pp", pp=2, schedule="1f1b", microbatches=1), c, 16).reason
    fp16 = Layout(strategy="pp", pp=2, schedule="gpipe", microbatches=2, precision="16")
    assert "use bf16" in predict.predict(prof, fp16, c, 16).reason
    big = _profile(params=10**9)
    out = predict.predict(big, Layout(strategy="single"), c, 16)
    assert not out.fits and "GiB per worker" in out.reason


def test_setup_arguments_are_valid_paratrain_options() -> None:
    c = _cluster()
    for layout in [Layout(strategy="ddp", dp=4, grad_accum=2), Layout(strategy="fsdp", dp=8),
                   Layout(strategy="ddp+pp", dp=2, pp=4, schedule="interleaved-1f1b", stages_per_worker=2,
                         microbatches=8, precision="bf16"),
                   Layout(strategy="mp", pp=2, microbatches=4)]:
        config = make_config(layout.setup_kwargs(c))
        assert config.strategy == layout.strategy
    assert Layout(strategy="ddp+pp", dp=2, pp=4).commands(c)[0].startswith("srun --nodes 2 --ntasks-per-node 4")
    assert Layout(strategy="pp", pp=4).commands(c) == ["paratrain run --nproc 4 train.py"]


# -- the analytic GPT against torch's FLOP counter --------------------------------------------------


class _Block(nn.Module):
    def __init__(self, h: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.qkv, self.proj = nn.LayerNorm(h), nn.Linear(h, 3 * h), nn.Linear(h, h)
        self.ln2, self.fc1, self.fc2 = nn.LayerNorm(h), nn.Linear(h, 4 * h), nn.Linear(4 * h, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        a = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, h))
        return x + self.fc2(nn.functional.gelu(self.fc1(self.ln2(x))))


def test_gpt_formulas_match_torchs_flop_counter_and_parameter_count() -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    gpt = transformer.GPT(name="tiny", layers=2, hidden=64, heads=4, seq=32, vocab=100)
    block = _Block(64, 4)
    assert gpt.block_params() == sum(p.numel() for p in block.parameters())
    x = torch.randn(1, 32, 64, requires_grad=True)
    with sdpa_kernel(SDPBackend.MATH):  # attention as matrix products, which the counter sees on CPU
        with FlopCounterMode(display=False) as fwd:
            y = block(x)
        with FlopCounterMode(display=False) as bwd:
            y.sum().backward()
    prof = transformer.profile(gpt, "32")
    assert prof.layers[1].flops_fwd == fwd.get_total_flops()
    assert prof.layers[1].flops_bwd == bwd.get_total_flops()
    assert prof.params == gpt.params()
    five = transformer.get("gpt-5b")
    assert 5.0e9 < five.params() < 5.5e9  # NeMo's GPT-3 5B shape
    assert transformer.profile(five).tokens_per_sample == 2048


def test_search_prunes_a_1024_gpu_plan(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    real = search.predict
    monkeypatch.setattr(search, "predict", lambda *a, **k: calls.append(a[1]) or real(*a, **k))
    prof = transformer.profile(transformer.get("gpt-5b"), "bf16")
    found = search.layouts(prof, clusters.load("h100-ib"), 2048, precision="bf16")
    # without pruning: thousands; the tensor degrees 2, 4 and 8 add a pipeline sweep each, and every pipeline
    # degree with replicas is swept twice, its stages copied (ddp) or sharded (fsdp): about 760 in all
    assert len(calls) < 1000, f"{len(calls)} layouts predicted for 1,024 GPUs; the pruning should keep it small"
    assert {p.layout.tp for p in found} == {1, 2, 4, 8}
    best = found[0]
    assert best.fits and best.layout.devices == 1024
    assert [p.step_s for p in found if p.fits] == sorted(p.step_s for p in found if p.fits)
    ddp = next(p for p in found if p.layout.strategy == "ddp")
    assert not ddp.fits and "alone need" in ddp.reason  # 20 B/parameter of 5.3 B parameters > 80 GB
    assert 0.1 < best.mfu < 0.6 and best.tokens_per_s > 0 and math.isfinite(best.step_s)


def test_profile_measures_flops_memory_and_times_of_each_layer() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    batch = lambda b: (torch.randn(b, 8), torch.randn(b, 4))  # noqa: E731
    prof = measure(model, batch, nn.MSELoss(), [2, 4], name="tiny", repeats=1)
    first, relu, last = prof.layers
    assert [layer.params for layer in prof.layers] == [8 * 16 + 16, 0, 16 * 4 + 4]
    assert first.flops_fwd == 2 * 8 * 16 and first.flops_bwd == 2 * (2 * 8 * 16)
    assert first.weight_share == pytest.approx(0.5)
    assert first.activation_bytes == 8 * 4  # Linear keeps its input
    assert relu.output_bytes == 16 * 4
    assert set(first.seconds) == {2, 4} and all(f > 0 and b > 0 for f, b in first.seconds.values())
    assert prof.optimizer_s_per_param and prof.optimizer_s_per_param > 0
    json.dumps(prof.as_dict())
    # on a GPU the layers, each timed with the device synchronised, are scaled to the whole step where it is shorter
    from paratrain.planner.profile import _overlapped

    assert _overlapped([(1.0, 2.0), (3.0, 4.0)], 5.0) == [(0.5, 1.0), (1.5, 2.0)]
    assert _overlapped([(1.0, 2.0)], 4.0) == [(1.0, 2.0)]  # a longer step is overhead, kept apart


# -- validation bookkeeping (the runner replaced at its one seam) -------------------------------------


def test_validation_covers_the_named_layouts_and_scores_them_against_a_runner() -> None:
    from paratrain.planner import validate

    layouts = validate.local_layouts()
    labels = [layout.label for layout in layouts]
    assert labels[:3] == ["single", "ddp 2", "fsdp 2"]
    for schedule in ("gpipe", "1f1b", "interleaved-1f1b", "zero-bubble"):
        assert sorted(x.microbatches for x in layouts if x.schedule == schedule and x.strategy == "pp") == [1, 2, 4, 8]
    assert {"mp 2 (M=1)", "ddp+pp 2x2 (1f1b, M=2)", "fsdp+pp 2x2 (1f1b, M=4)"} <= set(labels)
    assert max(x.processes for x in layouts) == 4

    local = _cluster(kind="cpu", devices_per_node=2, nodes=1, measured_here=True)
    prof = _profile(layers=3)  # 3 layers: the 4-stage interleaved layouts cannot run
    chosen = [x for x in layouts if x.label in ("single", "ddp 2", "pp 2 (interleaved-1f1b, V=2, M=2)")]
    ran: list[str] = []

    def runner(layout: Layout, cluster: clusters.Cluster, settings: validate.Settings) -> validate.Measured:
        ran.append(layout.label)
        guess = predict.predict(prof, layout, cluster, settings.batch)
        return validate.Measured(step_s=guess.step_s * (1.1 if layout.strategy == "ddp" else 1.0),
                                 peak_bytes=guess.memory.total * 0.95)

    settings = validate.Settings(workload="chain", batch=8, round_size=2)
    records = validate.run(prof, local, settings, chosen, measure=runner, say=lambda text: None)
    # rounds of two layouts, each opened by single: single, [single, ddp 2]; pp cannot run, so it opens none
    assert ran == ["single", "single", "ddp 2"]
    by = {r["layout"]: r for r in records}
    assert by["pp 2 (interleaved-1f1b, V=2, M=2)"]["status"] == "cannot-run"
    assert by["ddp 2"]["step_error"] == pytest.approx(1 / 1.1 - 1)
    assert by["single"]["memory_error"] == pytest.approx(1 / 0.95 - 1)
    assert [r["round"] for r in records] == [1, 1, None]
    assert by["ddp 2"]["round_single_step_s"] == pytest.approx(predict.predict(prof, chosen[0], local, 8).step_s)
    assert by["ddp 2"]["relative_step_error"] == pytest.approx(1 / 1.1 - 1)  # single measured as predicted here
    summary = validate.summary(records)
    assert summary["layouts"] == 2 and summary["step_worst_abs_error"] == pytest.approx(1 - 1 / 1.1)
    assert summary["step_rank_correlation"] is None  # two layouts order nothing
    assert summary["relative_step_worst_abs_error"] == pytest.approx(1 - 1 / 1.1)

    # a machine twice as slow in the second round: absolute errors see the drift, errors against the round's
    # single do not
    rounds = {"n": 0}

    def drifting(layout: Layout, cluster: clusters.Cluster, settings: validate.Settings) -> validate.Measured:
        rounds["n"] += layout.strategy == "single"
        slow = 2.0 if rounds["n"] > 2 else 1.0
        return validate.Measured(step_s=predict.predict(prof, layout, cluster, 8).step_s * slow, peak_bytes=1.0)

    two = [x for x in layouts if x.label in ("single", "ddp 2", "fsdp 2")]
    drifted = validate.run(prof, local, validate.Settings(workload="chain", batch=8, round_size=2), two,
                           measure=drifting, say=lambda text: None)
    assert [round(r["step_error"], 6) for r in drifted] == [0.0, 0.0, -0.5]
    assert [round(r["relative_step_error"], 6) for r in drifted] == [0.0, 0.0, 0.0]
    assert validate.rank_correlation([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert validate.rank_correlation([1, 2, 3, 4], [40, 30, 20, 10]) == pytest.approx(-1.0)
    assert validate.rank_correlation([1, 2, 3, 4, 5], [1, 3, 2, 4, 5]) == pytest.approx(0.9)
    with pytest.raises(ParatrainError, match="--cluster local"):
        validate.run(prof, _cluster(), settings, chosen, measure=runner)


def test_gpu_validation_runs_one_worker_per_gpu_and_its_calibration_probes_run_on_any_device() -> None:
    from paratrain.planner import calibrate, calibrate_gpu, validate

    one = _cluster(kind="cuda", devices_per_node=1, nodes=1, measured_here=True)
    four = _cluster(kind="cuda", devices_per_node=4, nodes=1, measured_here=True)
    assert [x.label for x in validate.local_layouts("bf16", one)] == ["single"]
    assert [x.label for x in validate.local_layouts("32", four)] == [
        "single", "ddp 4", "fsdp 4", "tp 4", "pp 4 (1f1b, M=4)", "pp 4 (1f1b, M=8)"]
    assert all(x.processes <= 4 for x in validate.local_layouts("32", four))
    # the probes are device-generic: on the CPU they measure the CPU (a GPU's run is in docs/plan.md)
    cpu = torch.device("cpu")
    best, curve = calibrate_gpu.matmul_curve(cpu, torch.float32, sides=(16, 64), repeats=2)
    assert best > 0 and [f for f, _ in curve] == [2.0 * 16**3, 2.0 * 64**3]
    assert max(share for _, share in curve) == 1.0 and all(0 < share <= 1 for _, share in curve)
    assert calibrate.memory_bandwidth(cpu, elements=2**16) > 0


def test_fsdp_pays_its_measured_cost_per_unit() -> None:
    prof = _profile(layers=8, params=1000)
    plain = _cluster()
    costly = _cluster(fsdp_unit_overhead={"alpha_us": 1000, "beta_s_per_gb": 1.0})  # 1 ms + 1 s per GB of unit
    layout = Layout(strategy="fsdp", dp=4, grad_accum=2)
    base, more = predict.predict(prof, layout, plain, 16), predict.predict(prof, layout, costly, 16)
    per_unit = 1e-3 + 4000 / 1e9
    assert more.step_s - base.step_s == pytest.approx(2 * 8 * per_unit)  # 8 units, 2 micro-steps
    assert predict.predict(prof, Layout(strategy="ddp", dp=4), costly, 16).step_s == pytest.approx(
        predict.predict(prof, Layout(strategy="ddp", dp=4), plain, 16).step_s)
    assert clusters.from_spec(costly.as_spec()).fsdp_unit == pytest.approx(costly.fsdp_unit)


def test_sharded_pipelines_divide_the_state_and_gather_each_stage_once() -> None:
    """fsdp+pp: a pipeline rank's parameters, gradients and optimizer state divided by the replicas that shard
    its stages, the stages gathered whole with their gradients during the step, one all-gather and one
    reduce-scatter per stage where ddp+pp all-reduces, and FSDP's cost per unit paid once per stage."""
    prof, plain = _profile(layers=8, params=1000), _cluster()
    copied = predict.predict(prof, Layout(strategy="ddp+pp", dp=2, pp=2, schedule="1f1b", microbatches=4), plain, 16)
    layout = Layout(strategy="fsdp+pp", dp=2, pp=2, schedule="1f1b", microbatches=4)
    sharded = predict.predict(prof, layout, plain, 16)
    assert sharded.fits and copied.fits and sharded.layout.label == "fsdp+pp 2x2 (1f1b, M=4)"
    stage = 4 * 4 * 1000  # 4 layers of 1000 float32 parameters
    assert (sharded.memory.params, sharded.memory.grads) == (stage / 2, stage / 2)
    assert sharded.memory.optimizer == pytest.approx(copied.memory.optimizer / 2)
    assert sharded.memory.buffers == 2 * stage and copied.memory.buffers == stage
    assert sharded.optimizer_s == pytest.approx(copied.optimizer_s / 2)
    costly = _cluster(fsdp_unit_overhead={"alpha_us": 1000, "beta_s_per_gb": 1.0})
    assert predict.predict(prof, layout, costly, 16).step_s - sharded.step_s == pytest.approx(1e-3 + stage / 1e9)
    found = {p.layout.strategy for p in search.layouts(prof, plain, 16, devices=4)}
    assert {"ddp+pp", "fsdp+pp"} <= found


def test_a_tie_between_two_stages_of_one_sharded_rank_is_not_predicted() -> None:
    """A head tied to the embedding, under zero-bubble's V (stages 0 and 3 on rank 0): FSDP would shard the
    weight in two units, which the engine refuses, so the planner gives the reason instead of a time."""
    prof = _profile(layers=8, params=1000)
    layers = [*prof.layers[:-1], replace(prof.layers[-1], shared_params=1000, shared_with=("0",))]
    tied = replace(prof, layers=layers)
    v = dict(dp=2, pp=2, schedule="zero-bubble", stages_per_worker=2, microbatches=4)
    refused = predict.predict(tied, Layout(strategy="fsdp+pp", **v), _cluster(), 16)
    assert not refused.fits and "tied to 0 in stages 0 and 3 of one rank" in (refused.reason or "")
    assert predict.predict(tied, Layout(strategy="ddp+pp", **v), _cluster(), 16).fits  # copies: one tie per rank
    assert predict.predict(prof, Layout(strategy="fsdp+pp", **v), _cluster(), 16).fits  # untied
    loop = dict(dp=2, pp=2, schedule="interleaved-1f1b", stages_per_worker=2, microbatches=4)  # 0, 3 on ranks 0, 1
    assert predict.predict(tied, Layout(strategy="fsdp+pp", **loop), _cluster(), 16).fits


def test_validation_passes_measure_every_layout_again_in_reverse_order() -> None:
    """With passes, a slow minute falls on other neighbours in each pass: the record keeps each pass's time and
    reports their median, and the summary compares the passes with each other (the measurement's own noise)."""
    from paratrain.planner import validate

    local = _cluster(kind="cpu", devices_per_node=2, nodes=1, measured_here=True)
    prof = _profile(layers=3)
    layouts = [x for x in validate.local_layouts() if x.label in ("single", "ddp 2", "fsdp 2")]
    ran: list[str] = []

    def runner(layout: Layout, cluster: clusters.Cluster, settings: validate.Settings) -> validate.Measured:
        ran.append(layout.label)
        slow = 1.5 if len(ran) > 4 and layout.strategy == "ddp" else 1.0  # ddp hits a slow minute in pass 2
        return validate.Measured(step_s=predict.predict(prof, layout, cluster, settings.batch).step_s * slow,
                                 peak_bytes=float(len(ran)))

    settings = validate.Settings(workload="chain", batch=8, passes=2)
    records = validate.run(prof, local, settings, layouts, measure=runner, say=lambda text: None)
    assert ran == ["single", "single", "ddp 2", "fsdp 2", "single", "fsdp 2", "ddp 2", "single"]
    by = {r["layout"]: r for r in records}
    guess = predict.predict(prof, layouts[1], local, 8).step_s
    assert by["ddp 2"]["measured_passes_s"] == pytest.approx([guess, 1.5 * guess])
    assert by["ddp 2"]["measured_step_s"] == pytest.approx(1.25 * guess)  # the median of the two passes
    assert by["single"]["measured_peak_bytes"] == 8.0  # the largest peak of its passes
    summary = validate.summary(records)
    assert summary["pass_worst_disagreement"] == pytest.approx(0.5)
    assert summary["pass_median_disagreement"] == pytest.approx(0.0)
    assert "pass 1 vs pass 2" in validate.table(records, "now")


def test_a_meta_model_is_profiled_a_layer_at_a_time_and_stays_on_meta() -> None:
    import meta_cases as cases

    from paratrain import weights
    from paratrain.planner import choose
    from paratrain.planner.profile import measure

    x, _ = cases.data()
    with torch.device("meta"):
        model = cases.build("llama")
    made: list[int] = []
    real = weights.real_layer(model, weights.source_for(model, 0, None), torch.device("cpu"))

    def counted(layer: nn.Module) -> nn.Module:
        made.append(sum(p.numel() for p in layer.parameters()))
        return real(layer)

    def run(m: nn.Module, **kw: object) -> Profile:
        return measure(m, lambda b: (choose.resized(x, b), None), choose._StandInLoss(), [2, 4], name="llama",
                       optimizer="sgd", repeats=1, device=torch.device("cpu"), **kw)  # type: ignore[arg-type]

    with pytest.raises(ParatrainError, match="meta device"):
        run(model)
    meta = run(model, real=counted)
    plain = run(cases.build("llama"))
    assert meta.built == "meta" and plain.built == "whole"
    assert [(c.name, c.params) for c in meta.layers] == [(c.name, c.params) for c in plain.layers]
    assert made == [c.params for c in meta.layers]  # each layer made real once, alone
    assert weights.has_meta(model) and all(p.is_meta for p in model.parameters())
    assert all(c.seconds[4][0] > 0 for c in meta.layers) and meta.tp_width == plain.tp_width
    for ours, theirs in zip(meta.layers, plain.layers):  # counted on meta, within attention's kernel choice
        assert ours.flops_fwd == pytest.approx(theirs.flops_fwd, rel=0.15), ours.name
