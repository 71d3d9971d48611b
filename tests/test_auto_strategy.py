"""`setup(strategy="auto")` on several processes: `prepare(..., example=)` asks the planner for this world's
fastest layout, prints the choice with its runner-up, and trains it to the weights of the plain PyTorch loop
(whatever it chose: every layout does). Which layout wins is timing, so the switching itself is also run with
the planner's answer fixed (a pipeline: the loader's share changes from half the batch to all of it)."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
import torch
from helpers import EXAMPLES, TWO_CORES, cli_env, max_diff, plain_example_toy, run_cmd
from torch.utils.data import DataLoader, TensorDataset

from paratrain.data import ShardedLoader
from paratrain.errors import ParatrainError
from paratrain.planner import choose
from paratrain.planner import cluster as clusters
from paratrain.planner.layout import Layout
from paratrain.planner.predict import Prediction

TOY = str(EXAMPLES / "toy.py")
AUTO_LINE = re.compile(r"paratrain: strategy auto -> (.+?) \(predicted ([0-9.]+) s/step; runner-up (.+?) ([0-9.]+) s; ")


@pytest.fixture(scope="module")
def plain_weights() -> dict[str, torch.Tensor]:
    return plain_example_toy()


def _spec(tmp_path: Path) -> str:
    path = tmp_path / "two-cores.json"
    path.write_text(json.dumps(TWO_CORES))
    return str(path)


def test_only_layouts_of_this_world_with_the_scripts_accumulation_are_candidates() -> None:
    found = [Prediction(Layout(strategy="pp", pp=2, schedule="1f1b", microbatches=2), step_s=0.01),
             Prediction(Layout(strategy="ddp", dp=2, grad_accum=2), step_s=0.011),
             Prediction(Layout(strategy="ddp+pp", dp=2, pp=2, schedule="1f1b", microbatches=2), step_s=0.012),
             Prediction(Layout(strategy="single"), step_s=0.013),
             Prediction(Layout(strategy="fsdp", dp=2), step_s=0.014, fits=False),
             Prediction(Layout(strategy="ddp", dp=2), step_s=0.02)]
    labels = [p.layout.label for p in choose.ranked(found, world=2, grad_accum=1, pipelines=True)]
    assert labels == ["pp 2 (1f1b, M=2)", "ddp 2"]
    assert [p.layout.label for p in choose.ranked(found, world=2, grad_accum=1, pipelines=False)] == ["ddp 2"]


def test_the_line_names_the_pick_the_runner_up_and_why() -> None:
    best = Prediction(Layout(strategy="ddp", dp=2), step_s=0.010, compute_s=0.008, exposed_comm_s=0.001)
    other = Prediction(Layout(strategy="fsdp", dp=2), step_s=0.014, compute_s=0.008, exposed_comm_s=0.005)
    line = choose.describe(best, other, 1.5)
    match = AUTO_LINE.match(line)
    assert match and match.groups() == ("ddp 2", "0.0100", "fsdp 2", "0.0140"), line
    assert "less exposed communication, 4.0 ms" in line and "planned in 1.5 s" in line


def test_the_example_is_cut_or_repeated_to_each_profiled_size() -> None:
    example = (torch.arange(6.0).reshape(3, 2), torch.tensor(7.0))
    grown = choose.resized(example, 7)
    assert grown[0].shape == (7, 2) and torch.equal(grown[0][3:6], example[0]) and grown[1] is example[1]
    assert torch.equal(choose.resized(example, 2)[0], example[0][:2])
    with pytest.raises(ParatrainError, match="first dimension"):
        choose.rows(torch.tensor(1.0))


def test_a_relaid_loader_yields_what_one_prepared_for_that_layout_yields() -> None:
    data = TensorDataset(torch.arange(40.0).reshape(20, 2))
    relaid = ShardedLoader(DataLoader(data, batch_size=3, shuffle=True), 1, 2, seed=5)
    relaid.relayout(0, 1, equal_shares=True)
    direct = ShardedLoader(DataLoader(data, batch_size=6, shuffle=True), 0, 1, seed=5, equal_shares=True)
    assert relaid.batch_size == 6 and relaid.global_batch == 6
    assert [b[0].tolist() for b in relaid] == [b[0].tolist() for b in direct]
    with pytest.raises(ParatrainError, match="before the first batch"):
        relaid.relayout(0, 2, equal_shares=False)
    odd = ShardedLoader(DataLoader(data, batch_size=5), 0, 1, seed=5)
    with pytest.raises(ParatrainError, match="multiple of 2"):
        odd.relayout(0, 2, equal_shares=False)


def test_the_machine_is_measured_once_then_read_from_the_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    measured: list[str] = []

    def fake_calibrate(kind: str, path: Path) -> None:  # the real one starts processes (tested end to end below)
        measured.append(kind)
        clusters.write(clusters.from_spec(TWO_CORES), path)

    monkeypatch.setenv(choose.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.delenv(choose.CLUSTER_ENV, raising=False)
    monkeypatch.setattr(choose, "_calibrate", fake_calibrate)
    said: list[str] = []
    first, second = choose.machine("cpu", said.append), choose.machine("cpu", said.append)
    assert measured == ["cpu"] and choose.cache_path("cpu").exists()
    assert second.intra.latency == pytest.approx(first.intra.latency) and second.name == first.name
    assert len(said) == 1 and "measures this machine once" in said[0]
    monkeypatch.setenv(choose.CLUSTER_ENV, "h100-nvlink")
    assert choose.machine("cpu", said.append).kind == "cuda" and measured == ["cpu"]
    for_two = choose.for_world(clusters.load("h100-ib"), world=4, nodes=2)
    assert (for_two.nodes, for_two.devices_per_node, for_two.devices) == (2, 2, 4)


@pytest.mark.procs
def test_auto_trains_the_planners_choice_to_the_plain_loops_weights(tmp_path: Path, plain_weights: dict) -> None:
    out = tmp_path / "w.pt"
    env = cli_env(PARATRAIN_CLUSTER=_spec(tmp_path))
    res = run_cmd([sys.executable, "-m", "paratrain.cli", "run", "--nproc", "2", TOY, "--strategy", "auto",
                   "--save-weights", str(out)], timeout=120, env=env)
    assert res.returncode == 0, res.stdout[-3000:]
    lines = [line for line in res.stdout.splitlines() if "strategy auto ->" in line]
    assert len(lines) == 1 and AUTO_LINE.search(lines[0]), res.stdout[-3000:]
    assert max_diff(torch.load(out), plain_weights) < 2e-6, lines[0]


FIXED = """import os, runpy, sys
from paratrain.planner import choose
options = {"strategy": "pp", "microbatches": 2, "schedule": "1f1b"}
choose.plan = lambda *a, **k: choose.Choice(setup=options, line="paratrain: strategy auto -> pp 2 (fixed)")
sys.argv = [sys.argv[1], *sys.argv[2:]]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.mark.procs
def test_a_switch_to_a_pipeline_shares_the_batch_anew_and_matches(tmp_path: Path, plain_weights: dict) -> None:
    script = tmp_path / "fixed_plan.py"
    script.write_text(FIXED)
    out = tmp_path / "w.pt"
    res = run_cmd([sys.executable, "-m", "paratrain.cli", "run", "--nproc", "2", str(script), TOY, "--strategy",
                   "auto", "--forward-backward", "--save-weights", str(out)], timeout=120, env=cli_env())
    assert res.returncode == 0, res.stdout[-3000:]
    assert "paratrain: strategy auto -> pp 2 (fixed)" in res.stdout
    stage0 = torch.load(out)  # rank 0 holds the first stage only: the model was split, not copied
    assert sorted(stage0) == ["net1.bias", "net1.weight"], sorted(stage0)
    # the first stage's weights depend on the second's gradients, so they match only if the whole step did
    assert max_diff(stage0, {k: plain_weights[k] for k in stage0}) < 2e-6
