"""Splitting, balancing, micro-batch search and the memory walk: pure logic, no process group."""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from helpers import check_job
from pipeline_cases import caught
from torch import nn

from paratrain.config import Config
from paratrain.parallel.microbatch import check_even, divisors, merge, search, split, sweep
from paratrain.parallel.pipeline.balance import choose_balance, profile_layers, solve, stage_sums
from paratrain.parallel.pipeline.memory import ActivationMeter, in_flight
from paratrain.parallel.pipeline.partition import check_balance, equal_balance, layers_of, merged, split_into_stages
from paratrain.parallel.pipeline.schedules import stage_indices
from paratrain.runtime import Placement
from paratrain.strategies import get
from paratrain.strategies.base import Context


def test_stages_keep_the_original_names_and_compute_the_same() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))
    stages = split_into_stages(layers_of(model), [2, 1, 2])
    assert [list(s.state_dict()) for s in stages] == [["0.weight", "0.bias"], ["2.weight", "2.bias"],
                                                      ["4.weight", "4.bias"]]
    x = torch.randn(3, 4)
    out = x
    for stage in stages:
        out = stage(out)
    assert torch.equal(out, model(x))
    assert stages[1].layer_names == ["2"]
    assert list(merged([stages[0], stages[2]]).state_dict()) == ["0.weight", "0.bias", "4.weight", "4.bias"]
    assert stages[0].get_submodule("0") is model[0]  # the same layer objects: the optimizer still sees them


def test_balance_errors_carry_the_arithmetic() -> None:
    assert equal_balance(7, 3) == [3, 2, 2]
    assert "sum to the model's 5 layers" in caught(check_balance, [2, 2], 5, 2)
    assert "has 3 entries summing to 5" in caught(check_balance, [1, 2, 2], 5, 2)
    assert "2 layer(s) but 3 pipeline stages" in caught(solve, [1.0, 2.0], 3)
    assert "not an nn.Sequential" in caught(layers_of, nn.Linear(2, 2))


def test_solver_is_optimal_and_prefers_even_counts() -> None:
    rng = random.Random(0)
    for _ in range(200):
        n, k = rng.randint(2, 9), rng.randint(1, 4)
        if k > n:
            continue
        costs = [rng.choice([0.1, 1.0, 5.0]) * rng.random() for _ in range(n)]
        best = min(max(stage_sums(costs, b)) for b in _all_splits(n, k))
        got = solve(costs, k)
        assert sum(got) == n and len(got) == k and min(got) >= 1
        assert max(stage_sums(costs, got)) == pytest.approx(best)
    assert solve([1.0] * 8, 4) == [2, 2, 2, 2]
    assert solve([10.0, 1, 1, 1, 1, 1, 1, 1], 2) == [1, 7]


def _all_splits(n: int, k: int) -> list[list[int]]:
    out = []
    for cuts in itertools.combinations(range(1, n), k - 1):
        edges = [0, *cuts, n]
        out.append([edges[i + 1] - edges[i] for i in range(k)])
    return out


def _heavy_light(width: int) -> nn.Sequential:
    """Three heavy Linear layers, four cheap activations, one more heavy layer."""
    heavy = [nn.Linear(width, width) for _ in range(4)]
    return nn.Sequential(*heavy[:3], nn.Tanh(), nn.ReLU(), nn.Tanh(), nn.ReLU(), heavy[3])


def test_time_balance_beats_the_equal_split_on_unequal_layers() -> None:
    """Splitting by layer count puts three heavy layers in stage 0; measured time puts two on each side.
    [2, 6] beats the next best split [3, 5] as long as four activations cost less than one heavy layer. At
    width 2048 they cost ~15x less (fastest of three runs each; most of it autograd's fixed cost), so a
    preempted measurement on a loaded machine cannot flip the outcome."""
    torch.manual_seed(0)
    model = _heavy_light(2048)
    grads_before = [p.grad for p in model.parameters()]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as pipeline workers run; spinning thread pools on shared cores time nothing
    try:
        balance, costs = choose_balance("time", layers_of(model), 2, sample=torch.randn(16, 2048))
    finally:
        torch.set_num_threads(threads)
    assert balance == [2, 6]
    assert costs is not None
    seconds = [c.seconds for c in costs]
    assert max(stage_sums(seconds, balance)) < max(stage_sums(seconds, equal_balance(8, 2)))
    assert [p.grad for p in model.parameters()] == grads_before  # profiling left no gradients behind


def test_memory_balance_weighs_weights_and_saved_inputs() -> None:
    """4 MiB of weights + 256 KiB saved input per heavy layer, 256 KiB per activation layer: [2, 6] holds
    8.5 / 9.5 MiB, better than [3, 5] (12.75 / 5.25) or the equal split (13.0 / 5.25)."""
    by_memory, _ = choose_balance("memory", layers_of(_heavy_light(1024)), 2, sample=torch.randn(64, 1024))
    assert by_memory == [2, 6]


def test_profile_leaves_batchnorm_statistics_and_rng_alone() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Dropout(0.5))
    stats = model[1].running_mean.clone()
    sample = torch.randn(8, 4)
    torch.manual_seed(3)
    expected = torch.rand(1)
    torch.manual_seed(3)
    costs = profile_layers(layers_of(model), sample, repeats=2)
    assert torch.equal(model[1].running_mean, stats)
    assert torch.equal(torch.rand(1), expected)
    assert costs[0].params_bytes == 20 * 4 and costs[0].activation_bytes > 0


def test_split_merge_and_even_check() -> None:
    x = torch.arange(10).reshape(10, 1)
    parts = split((x, {"y": x}), 4)
    assert [p[0].shape[0] for p in parts] == [3, 3, 2, 2]
    back = merge(parts)
    assert torch.equal(back[0], x) and torch.equal(back[1]["y"], x)
    msg = caught(check_even, 6, 4, "strategy 'pp'")
    assert "batch 6 cannot be split into 4 micro-batches" in msg and "microbatches=3" in msg
    check_even(8, 4, "pp")
    assert divisors(12) == [1, 2, 3, 4, 6, 12]


def _pipeline_curve(stages: int, t: float, o: float, slow_small: float = 0.0):
    def measure(m: int) -> float:
        return (m + stages - 1) * (t / m + o) + slow_small / m
    return measure


@pytest.mark.parametrize("stages,t,o,extra", [(2, 1.0, 0.004, 0.0), (4, 1.0, 0.002, 0.0), (2, 1.0, 0.02, 0.05),
                                              (4, 0.2, 0.01, 0.0), (2, 1.0, 0.0005, 0.0)])
def test_search_finds_near_best_for_a_fraction_of_the_sweep(stages: int, t: float, o: float, extra: float) -> None:
    """On pipeline-shaped curves (bubble falling with M, overhead rising) the search lands within 5% of
    the sweep's best while spending at most a third of the sweep's measured time."""
    measure = _pipeline_curve(stages, t, o, extra)
    cands = divisors(96)
    full = sweep(measure, cands)
    found = search(measure, cands, stages)
    assert full.curve[found.best] <= 1.05 * full.curve[full.best]
    assert sum(found.curve.values()) <= sum(full.curve.values()) / 3
    assert set(found.curve) <= set(cands)


@pytest.mark.parametrize("slope", [0.01, 0.1, 1.0])
def test_search_on_a_rising_curve(slope: float) -> None:
    """One CPU thread has no overlap: more micro-batches only add overhead, so few is best."""
    measure = lambda m: 1.0 + slope * m  # noqa: E731
    found = search(measure, divisors(64), 2)
    assert measure(found.best) <= 1.05 * measure(1)


def test_in_flight_walk_gives_the_schedule_bound() -> None:
    gpipe = {0: ["0F0", "0F1", "0F2", "0F3", "0B0", "0B1", "0B2", "0B3"]}
    one_f_one_b = {0: ["0F0", "0F1", "0B0", "0F2", "0B1", "0F3", "0B2", "0B3"],
                   1: ["1F0", "1B0", "1F1", "1B1", "1F2", "1B2", "1F3", "1B3"]}
    assert in_flight(gpipe, 0, {0: 10}) == (4, 40)
    assert in_flight(one_f_one_b, 0, {0: 10}) == (2, 20)
    assert in_flight(one_f_one_b, 1, {1: 7}) == (1, 7)
    zero_bubble = {0: ["0F0", "0F1", "0I0", "0F2", "0W0", "0I1", "0W1", "0I2", "0W2"]}
    assert in_flight(zero_bubble, 0, {0: 1}) == (3, 3)  # released at the weight backward, not the input one


def test_activation_meter_counts_saved_storages_once_and_sees_them_freed() -> None:
    layer = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16))
    meter = ActivationMeter(exclude=[layer])
    x = torch.randn(32, 16, requires_grad=True)
    with meter.measure():
        y = layer(x).sum()
    held = meter.current
    assert held == 2 * 32 * 16 * 4  # the input, and the ReLU output (saved by ReLU and the 2nd Linear: once)
    y.backward()
    del y
    assert meter.current == 0 and meter.peak == held


def test_pipeline_layouts_are_validated_at_construction() -> None:
    msg = caught(check_job, "ddp+pp", 4, pp_size=3, microbatches=4)
    assert "world 4 is not a multiple of tp 1 x pp 3 = 3" in msg and "that divide 4" in msg
    assert "pp_size 2 != world size 4" in caught(check_job, "pp", 4, pp_size=2, microbatches=4)
    msg = caught(check_job, "pp", 2, schedule="1f1b", microbatches=1)
    assert "microbatches=1 < 2 stages" in msg
    assert "interleaved-1f1b" in caught(check_job, "pp", 2, schedule="gpipe", stages_per_worker=2, microbatches=4)
    assert "Did you mean '1f1b'" in caught(check_job, "pp", 2, schedule="1fb1", microbatches=4)
    assert "precision='bf16'" in caught(check_job, "pp", 2, microbatches=2, precision="16")
    msg = caught(check_job, "ddp+mp", 2, devices_per_worker=0)
    assert "devices_per_worker must be >= 1" in msg
    ctx = Context(config=Config(strategy="ddp+pp", microbatches=2), placement=Placement(world_size=4),
                  device=torch.device("cpu"))
    assert get("ddp+pp").data_shard(ctx) == (0, 2)
    assert stage_indices("zero-bubble", 0, 2, 2) == [0, 3] and stage_indices("interleaved-1f1b", 1, 2, 2) == [1, 3]



class _Rotary(nn.Module):
    """Positions made inside the forward under no_grad, as Hugging Face's rotary embeddings make them."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("freq", torch.linspace(0.1, 1.0, 4), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            angle = torch.arange(x.shape[1], device=x.device).float()[:, None] * self.freq[None]
        return x + angle.cos()


class _Positional(nn.Module):
    """Positions made at the top level, as the zoo's GPT and nanoGPT make them."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.rot, self.out = nn.Linear(4, 4), _Rotary(), nn.Linear(4, 4)
        self.pos = nn.Embedding(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x) + self.pos(torch.arange(x.shape[1], device=x.device))
        return self.out(self.rot(h))


def test_a_model_traced_on_the_cpu_runs_where_its_stages_are_placed() -> None:
    """torch.export writes the tracing device into the graph (`arange(..., device=cpu)`, also inside the subgraph
    of a `no_grad` region): stages placed on another device (a GPU; `meta` here) must run there, or a model
    traced on the CPU and placed on a GPU fails with torch's device mismatch (it did, on an H200)."""
    torch.manual_seed(0)
    model, x = _Positional(), torch.randn(3, 5, 4)
    want = model(x)
    stages = split_into_stages(layers_of(model, x), [2, 2])
    out = x
    for stage in stages:
        out = stage(out)
    assert torch.equal(out, want)
    for stage in stages:
        stage.to("meta")
    out = x.to("meta")
    for stage in stages:
        out = stage(out)
    assert out.device.type == "meta" and out.shape == want.shape
