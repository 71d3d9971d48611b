"""Replica groups (`paratrain run --replica-groups`, torchft): groups of CPU workers train as one process would on
the same global batches; a group SIGKILLed in any phase of a step, and again while it rejoins, restarts, recovers
from a live group and ends with the same weights, every sample trained once per epoch, the survivors' processes
untouched and never paused long; every group lost at once resumes from the last checkpoint, still exact; bad
launches are refused by name, in seconds."""

from __future__ import annotations

import json
import random
import re
import runpy
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from helpers import ROOT, max_diff, paratrain

from paratrain import strategies
from paratrain.config import make_config
from paratrain.data.plan import Layout
from paratrain.errors import ParatrainError
from paratrain.faults.replica_groups import _check_equal_shares, check_strategy
from paratrain.launcher import lighthouse
from paratrain.runtime import ReplicaGroupLaunch, free_port, read_replica_group

pytest.importorskip("torchft")

SCRIPT = str(ROOT / "tests" / "replica_groups_train.py")
LAUNCH = ReplicaGroupLaunch(index=0, count=2, lighthouse="http://127.0.0.1:1")
SAMPLES, BATCH = 192, 12
"""16 global batches an epoch; 12 rows split evenly over 1, 2, 3 or 4 groups."""
LONGEST_PAUSE_S = 10.0
"""A survivor's longest wait between two committed steps while another group dies, restarts and rejoins."""

Reference = Callable[..., dict[str, torch.Tensor]]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Reference:
    """The same script as one plain process: the weights every group must end with (one run per set of args)."""
    done: dict[tuple[str, ...], dict[str, torch.Tensor]] = {}

    def weights(*args: str) -> dict[str, torch.Tensor]:
        if args not in done:
            out = tmp_path_factory.mktemp("reference")
            argv = sys.argv
            sys.argv = [SCRIPT, "--out", str(out), *args]
            try:  # here, as a world of one: torch is already imported
                runpy.run_path(SCRIPT, run_name="__main__")
            finally:
                sys.argv = argv
            done[args] = torch.load(out / "weights-single-rank0.pt")
        return done[args]

    return weights


def _groups(out: Path, flags: tuple[str, ...] = (), args: tuple[str, ...] = (), nproc: int = 1,
            groups: int = 2) -> str:
    done = paratrain("run", "--nproc", str(nproc), "--replica-groups", str(groups), *flags, SCRIPT, "--out", str(out),
                     *args, timeout=240)
    assert done.returncode == 0, done.stdout[-5000:]
    return done.stdout


def _report(out: Path, group: int, rank: int = 0) -> dict[str, Any]:
    return json.loads((out / f"report-group{group}-rank{rank}.json").read_text())


def _pids(out: Path, group: int, rank: int = 0) -> list[str]:
    return (out / f"pids-group{group}-rank{rank}.txt").read_text().split()


def _committed(out: Path, group: int, rank: int = 0) -> list[dict[str, Any]]:
    """What one worker recorded of each step it committed (over its restarts): step, sample ids, time."""
    lines = (out / f"steps-group{group}-rank{rank}.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def _each_sample_once(records: list[dict[str, Any]], epochs: int) -> None:
    """The committed steps' rows over all workers: each global batch whole, each sample once per epoch."""
    per_step: dict[int, list[int]] = defaultdict(list)
    for record in records:
        per_step[record["step"]] += record["ids"]
    steps = SAMPLES // BATCH
    assert sorted(per_step) == list(range(epochs * steps))
    for step, ids in per_step.items():
        assert len(ids) == BATCH == len(set(ids)), (step, sorted(ids))
    for epoch in range(epochs):
        ids = [i for step in range(epoch * steps, (epoch + 1) * steps) for i in per_step[step]]
        assert sorted(ids) == list(range(SAMPLES)), epoch


@pytest.mark.procs
def test_three_groups_train_as_one_process(tmp_path: Path, reference: Reference) -> None:
    args = ("--samples", str(SAMPLES), "--global-batch", str(BATCH))
    _groups(tmp_path, args=args, groups=3)
    for group in range(3):
        assert max_diff(torch.load(tmp_path / f"weights-group{group}-rank0.pt"), reference(*args)) < 1e-6
        assert _report(tmp_path, group)["redone"] == 0
    _each_sample_once([r for g in range(3) for r in _committed(tmp_path, g)], epochs=2)


@pytest.mark.procs
@pytest.mark.parametrize("nproc", [1, 2])
def test_killed_group_restarts_and_rejoins_from_the_live_one(tmp_path: Path, reference: Reference,
                                                             nproc: int) -> None:
    """Group 1's worker dies after the backward of step 4: group 0's reduction fails, it drops that step and
    trains it again; group 1's agent restarts the group, which copies group 0's state (no checkpoint), and both
    end with the uninterrupted run's weights. With 2 workers a group, the dead worker's group peer leaves at once
    (not after torchft's timeouts), and each rank recovers from its counterpart in group 0."""
    log = _groups(tmp_path, ("--max-restarts", "1"), ("--kill", "1@4"), nproc=nproc)
    assert (tmp_path / "killed").exists(), log[-5000:]
    for rank in range(nproc):
        survivor, restarted = _report(tmp_path, 0, rank), _report(tmp_path, 1, rank)
        assert _pids(tmp_path, 0, rank) == [str(survivor["pid"])]  # never restarted
        assert len(_pids(tmp_path, 1, rank)) == 2  # restarted once
        assert survivor["redone"] >= 1 and survivor["recovered"] == 0, (survivor, restarted, log[-5000:])
        assert restarted["recovered"] == 1 and restarted["steps"] < survivor["steps"], (survivor, restarted)
        for group in (0, 1):
            assert max_diff(torch.load(tmp_path / f"weights-group{group}-rank{rank}.pt"), reference()) < 1e-6


@pytest.mark.procs
@pytest.mark.parametrize(("seed", "phase", "again"), [
    (1, "forward", "recovery"), (5, "backward", "first-step"), (7, "optimizer", "recovery")])
def test_a_group_killed_in_any_phase_and_again_while_rejoining_ends_exact(
        tmp_path: Path, reference: Reference, seed: int, phase: str, again: str) -> None:
    """Three groups; one, and the step, drawn from the seed. Its worker dies in `phase` of that step (forward or
    backward: the others' reduction fails and they redo the step; optimizer: the step has committed everywhere),
    and its restarted worker dies `again` (while it loads the live state, or in its first step after). Its third
    start recovers; every group ends with the uninterrupted run's weights, the committed steps' rows make each
    global batch once, the survivors are the processes they were and never waited long between two steps."""
    draw = random.Random(seed)
    victim, step = draw.randrange(3), draw.randrange(1, 24)
    args = ("--samples", str(SAMPLES), "--global-batch", str(BATCH), "--epochs", "3")
    log = _groups(tmp_path, ("--max-restarts", "2"),
                  (*args, "--kill", f"{victim}@{step}:{phase}", "--rejoin-kill", again, "--pace", "0.25"), groups=3)
    assert (tmp_path / "killed").exists() and (tmp_path / "killed-again").exists(), log[-5000:]
    assert len(_pids(tmp_path, victim)) == 3  # killed twice, started three times
    restarted = _report(tmp_path, victim)
    assert restarted["recovered"] == 1 and restarted["generation"] == 2, restarted
    records = []
    for group in range(3):
        assert max_diff(torch.load(tmp_path / f"weights-group{group}-rank0.pt"), reference(*args)) < 1e-6
        mine = _committed(tmp_path, group)
        records += mine
        if group == victim:
            continue
        survivor = _report(tmp_path, group)
        assert _pids(tmp_path, group) == [str(survivor["pid"])], survivor
        assert survivor["recovered"] == 0 and survivor["steps"] == 3 * SAMPLES // BATCH, survivor
        pause = max(b["t"] - a["t"] for a, b in zip(mine, mine[1:]))
        assert pause <= LONGEST_PAUSE_S, (group, pause, survivor, log[-3000:])
    _each_sample_once(records, epochs=3)


@pytest.mark.procs
def test_accumulation_windows_are_cut_over_the_groups_alive_and_a_killed_one_redone(
        tmp_path: Path, reference: Reference) -> None:
    """`grad_accum=2`: each window of a global batch is cut over the live groups' micro-batches. Group 1 dies after
    the first micro-batch of step 4's window; group 0 drops the window once its reduction fails and trains it again
    alone, in two micro-batches of the whole batch's rows; the restarted group rejoins; both end with the weights of
    one process accumulating the same windows (and of one taking each global batch whole), every sample once per
    epoch."""
    args = ("--samples", str(SAMPLES), "--global-batch", str(BATCH), "--grad-accum", "2")
    log = _groups(tmp_path, ("--max-restarts", "1"), (*args, "--kill", "1@4", "--pace", "0.25"))
    assert (tmp_path / "killed").exists(), log[-5000:]
    survivor, restarted = _report(tmp_path, 0), _report(tmp_path, 1)
    assert survivor["redone"] >= 1 and restarted["recovered"] == 1, (survivor, restarted, log[-5000:])
    assert _pids(tmp_path, 0) == [str(survivor["pid"])]
    for group in (0, 1):
        assert max_diff(torch.load(tmp_path / f"weights-group{group}-rank0.pt"), reference(*args)) < 1e-6
    plain = reference("--samples", str(SAMPLES), "--global-batch", str(BATCH))
    assert max_diff(reference(*args), plain) < 1e-5  # the same global batches' sums, accumulated or not
    _each_sample_once([r for g in range(2) for r in _committed(tmp_path, g)], epochs=2)


@pytest.mark.procs
def test_every_group_lost_resumes_from_the_last_checkpoint(tmp_path: Path, reference: Reference) -> None:
    """Every group's worker dies in the forward of step 14: no live group is left to recover from. Each agent
    restarts its group; no group finds a running one, so each loads the newest complete checkpoint group 0 wrote
    (every 4 steps, in the background: step 12, or an earlier one if the kill came first) and trains the steps
    after it again. All end with the uninterrupted run's weights; of the steps trained twice, the second
    training's rows are the ones that count, and they make each global batch once."""
    args = ("--samples", str(SAMPLES), "--global-batch", str(BATCH), "--epochs", "3")
    log = _groups(tmp_path, ("--max-restarts", "1"), (*args, "--kill-all", "14", "--save-every", "4"), groups=3)
    reports = [_report(tmp_path, group) for group in range(3)]
    resumed = {report["resumed"] for report in reports}
    assert len(resumed) == 1 and next(iter(resumed)) in (4, 8, 12), (reports, log[-5000:])
    newest: dict[int, int] = {}
    records = [r for group in range(3) for r in _committed(tmp_path, group)]
    for record in records:
        newest[record["step"]] = max(newest.get(record["step"], 0), record["gen"])
    for group, report in enumerate(reports):
        assert len(_pids(tmp_path, group)) == 2 and report["generation"] == 1 and report["recovered"] == 0, report
        assert max_diff(torch.load(tmp_path / f"weights-group{group}-rank0.pt"), reference(*args)) < 1e-6
    _each_sample_once([r for r in records if r["gen"] == newest[r["step"]]], epochs=3)


# -- sharded layouts inside each group ----------------------------------------------------------------------------
SHARDED: dict[str, tuple[tuple[str, ...], int, tuple[int, ...]]] = {
    "fsdp": (("--strategy", "fsdp"), 2, (0, 1)), "tp": (("--strategy", "tp"), 2, (0,)),
    "pp": (("--strategy", "pp", "--balance", "equal"), 2, (0,)), "fsdp+tp": (("--strategy", "fsdp+tp"), 4, (0, 2)),
    "ddp+pp": (("--strategy", "ddp+pp", "--balance", "equal"), 4, (0, 1)),
    "fsdp+pp": (("--strategy", "fsdp+pp", "--balance", "equal"), 4, (0, 1))}
"""Layouts inside a group whose ranks each hold a piece of the model: FSDP2 shards (HSDP across groups),
tensor-parallel pieces, pipeline stages, both FSDP and tensor parallelism. Rank l of every group averages its
pieces' gradients with rank l of the others, and a restarted rank copies its pieces from rank l of a live group.
Each: the script's flags, the workers a group, the ranks that load rows of their own (the others share them)."""


def _sharded_weights_match(out: Path, reference: Reference, args: tuple[str, ...], layout: str) -> None:
    """Every rank of both groups ends with the reference's weights (under a pipeline: its stage's, the stages
    together the whole model), and held only a piece of the model."""
    want = reference(*args)
    for group in (0, 1):
        stages: dict[str, torch.Tensor] = {}
        for rank in range(SHARDED[layout][1]):
            report = _report(out, group, rank)
            weights = torch.load(out / f"weights-group{group}-rank{rank}.pt")
            if "pp" in layout.split("+"):  # a stage's weights: the same on each of its data-parallel ranks
                assert all(max_diff({k: v}, {k: stages.get(k, v)}) < 1e-6 for k, v in weights.items())
                stages |= weights
                continue
            assert report["held"] < report["whole"], report  # no rank held the whole model
            assert max_diff(weights, want) < 1e-6
        if stages:
            assert max_diff(stages, want) < 1e-6


def _rows(out: Path, layout: str) -> list[dict[str, Any]]:
    """The committed steps' records of every worker that loads rows of its own (the ranks of one tensor-parallel
    group or one pipeline load the same rows: the first one's stand for them)."""
    return [r for group in (0, 1) for rank in SHARDED[layout][2] for r in _committed(out, group, rank)]


@pytest.mark.procs
@pytest.mark.parametrize("layout", SHARDED)
def test_sharded_groups_train_as_one_process(tmp_path: Path, reference: Reference, layout: str) -> None:
    """Two groups of two workers, each group laying the model out over its ranks: the plain loop's weights."""
    args = ("--samples", str(SAMPLES), "--global-batch", str(BATCH))
    flags, nproc, _ = SHARDED[layout]
    _groups(tmp_path, args=(*args, *flags), nproc=nproc)
    _sharded_weights_match(tmp_path, reference, args, layout)
    assert all(_report(tmp_path, g, r)["redone"] == 0 for g in (0, 1) for r in range(nproc))
    _each_sample_once(_rows(tmp_path, layout), epochs=2)


@pytest.mark.procs
@pytest.mark.parametrize("layout", SHARDED)
def test_a_sharded_group_killed_recovers_each_rank_from_its_counterpart(tmp_path: Path, reference: Reference,
                                                                       layout: str) -> None:
    """Group 1's rank 0 dies after the backward of step 6: group 0 redoes the step alone (all 12 rows), group 1
    restarts, and each of its ranks copies its own pieces (the model and optimizer state of its shard or stage)
    from the same rank of group 0. Both groups end with the uninterrupted run's weights; the committed steps' rows
    make each global batch once."""
    args = ("--samples", str(SAMPLES), "--global-batch", str(BATCH))
    flags, nproc, _ = SHARDED[layout]
    log = _groups(tmp_path, ("--max-restarts", "1"), (*args, *flags, "--kill", "1@6"), nproc=nproc)
    assert (tmp_path / "killed").exists(), log[-5000:]
    for rank in range(nproc):
        survivor, restarted = _report(tmp_path, 0, rank), _report(tmp_path, 1, rank)
        assert _pids(tmp_path, 0, rank) == [str(survivor["pid"])]
        assert len(_pids(tmp_path, 1, rank)) == 2
        assert survivor["redone"] >= 1 and survivor["recovered"] == 0, (survivor, restarted, log[-5000:])
        assert restarted["recovered"] == 1 and restarted["steps"] < survivor["steps"], (survivor, restarted)
    _sharded_weights_match(tmp_path, reference, args, layout)
    _each_sample_once(_rows(tmp_path, layout), epochs=2)


@pytest.mark.procs
def test_every_fsdp_group_lost_resumes_from_the_sharded_checkpoint(tmp_path: Path, reference: Reference) -> None:
    """fsdp inside 2 groups of 2 workers, every worker killed in the forward of step 14, group 0 checkpointing its
    shards every 4 steps: no live group is left, each group's ranks load their shards of the same newest checkpoint
    (torchft's step is not in it: every manager starts again at 0 together) and all end with the uninterrupted
    run's weights; the steps trained again count once."""
    args = ("--samples", str(SAMPLES), "--global-batch", str(BATCH))
    log = _groups(tmp_path, ("--max-restarts", "1"),
                  (*args, *SHARDED["fsdp"][0], "--kill-all", "14", "--save-every", "4"), nproc=2)
    reports = [_report(tmp_path, group, rank) for group in (0, 1) for rank in (0, 1)]
    resumed = {report["resumed"] for report in reports}
    assert len(resumed) == 1 and next(iter(resumed)) in (4, 8, 12), (reports, log[-5000:])
    assert all(r["generation"] == 1 and r["recovered"] == 0 for r in reports), reports
    _sharded_weights_match(tmp_path, reference, args, "fsdp")
    records = _rows(tmp_path, "fsdp")
    newest: dict[int, int] = {}
    for record in records:
        newest[record["step"]] = max(newest.get(record["step"], 0), record["gen"])
    _each_sample_once([r for r in records if r["gen"] == newest[r["step"]]], epochs=2)


# -- refusals -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("name", "why"), [
    ("mp", "a pipeline over one process's devices"), ("ddp+mp", "a pipeline over one process's devices"),
    ("cp", "context parallelism"), ("fsdp+cp", "context parallelism"), ("ep", "the experts. router statistics"),
    ("fsdp+ep", "the experts. router statistics")])
def test_a_layout_not_built_inside_groups_is_refused_by_name(name: str, why: str) -> None:
    strategy = strategies.get(name)
    with pytest.raises(ParatrainError, match=f"strategy='{re.escape(strategy.name)}' with --replica-groups 2: {why}.*"
                                             "use strategy='ddp' or 'fsdp' inside each group"):
        check_strategy(strategy, make_config({"strategy": name}), LAUNCH)


@pytest.mark.parametrize("name", ["ddp", "fsdp", "tp", "fsdp+tp", "ddp+fsdp", "single"])
def test_layouts_whose_ranks_each_hold_one_piece_run_inside_groups(name: str) -> None:
    check_strategy(strategies.get(name), make_config({"strategy": name}), LAUNCH)


def test_a_pipeline_inside_groups_needs_a_split_every_group_makes_alike() -> None:
    """A measured balance could cut two groups' models at different layers: refused; a given one runs."""
    with pytest.raises(ParatrainError, match="balance='time': each group would measure its own stage split.*"
                                             "balance='equal'"):
        check_strategy(strategies.get("pp"), make_config({"strategy": "pp"}), LAUNCH)
    check_strategy(strategies.get("pp"), make_config({"strategy": "pp", "balance": "equal"}), LAUNCH)
    check_strategy(strategies.get("fsdp+pp"), make_config({"strategy": "fsdp+pp", "balance": [2, 1]}), LAUNCH)


def test_a_pipeline_global_batch_must_split_over_any_number_of_live_groups() -> None:
    loader = SimpleNamespace(layout=Layout(0, 1, 1, equal_shares=True), global_batch=8)
    with pytest.raises(ParatrainError, match="global batch 8 .* cannot be cut into 3 equal shares .* multiple of 6"):
        _check_equal_shares(loader, 3)  # type: ignore[arg-type]
    _check_equal_shares(SimpleNamespace(layout=Layout(0, 1, 1, equal_shares=True), global_batch=12), 3)  # type: ignore[arg-type]
    _check_equal_shares(SimpleNamespace(layout=Layout(0, 1, 1), global_batch=8), 3)  # type: ignore[arg-type]


def test_fp16_loss_scaling_is_refused() -> None:
    with pytest.raises(ParatrainError, match="precision='16' with --replica-groups 2"):
        check_strategy(strategies.get("ddp"), make_config({"strategy": "ddp", "precision": "16"}), LAUNCH)


def test_without_torchft_replica_groups_name_the_install(monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    import importlib.util

    from paratrain.cli import main

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchft" else real(name, *a))
    assert main(["run", "--nproc", "1", "--replica-groups", "2", SCRIPT]) == 2
    assert "pip install 'paratrain[ft]'" in capsys.readouterr().err
    with pytest.raises(ParatrainError, match=r"pip install 'paratrain\[ft\]'"):
        lighthouse.require_torchft("replica group 0 of 2")


def test_an_unreachable_lighthouse_fails_in_seconds(capsys: pytest.CaptureFixture[str]) -> None:
    from paratrain.cli import main

    port = free_port()
    start = time.monotonic()
    code = main(["run", "--nproc", "1", "--replica-group", "1", "--replica-groups", "2", "--lighthouse",
                 f"127.0.0.1:{port}", "--connect-timeout", "1", SCRIPT])
    assert code == 2 and time.monotonic() - start < 10
    assert f"cannot reach the replica-group lighthouse at 127.0.0.1:{port} within 1 s" in capsys.readouterr().err
    with pytest.raises(ParatrainError, match="paratrain lighthouse --port"):
        lighthouse.wait_until_reachable(f"127.0.0.1:{port}", 0.5)


@pytest.mark.parametrize(("flags", "message"), [
    (["--replica-groups", "2", "--replica-group", "2", "--lighthouse", "h:1"], "--replica-group 2 is out of range"),
    (["--replica-groups", "2", "--replica-group", "1"], "--replica-group 1 needs --lighthouse HOST:PORT"),
    (["--replica-groups", "2", "--nnodes", "2", "--master-port", "29500"], "start each group where it runs"),
    (["--replica-groups", "2", "--init", "file:///tmp/x"], "cannot be combined with --replica-groups"),
    (["--replica-groups", "2", "--replica-group", "0", "--lighthouse", "nonsense"], "use HOST:PORT"),
])
def test_launch_flags_that_cannot_work_are_refused(flags: list[str], message: str,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    from paratrain.cli import main

    assert main(["run", "--nproc", "1", *flags, "--dry-run", SCRIPT]) == 2
    assert message in capsys.readouterr().err


def test_the_lighthouse_starts_without_torch_and_is_reachable() -> None:
    served = lighthouse.start("127.0.0.1", 0)
    try:
        lighthouse.wait_until_reachable(served.address, 5)
    finally:
        served.shutdown()


def test_dry_run_shows_each_group_with_its_own_launcher(capsys: pytest.CaptureFixture[str]) -> None:
    from paratrain.cli import main

    assert main(["run", "--nproc", "2", "--replica-groups", "3", "--max-restarts", "2", "--dry-run", SCRIPT]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if not line.startswith("#")]
    assert len(lines) == 3
    for group, line in enumerate(lines):
        assert f"--replica-group={group} --replica-groups=3" in line and "--max-restarts=2" in line


def test_workers_read_their_group_from_the_launch() -> None:
    env = {"PARATRAIN_REPLICA_GROUP": "1", "PARATRAIN_REPLICA_GROUPS": "2", "PARATRAIN_LIGHTHOUSE": "http://h:9"}
    assert read_replica_group(env) == ReplicaGroupLaunch(1, 2, "http://h:9")
    assert read_replica_group({}) is None
    with pytest.raises(ParatrainError, match="PARATRAIN_LIGHTHOUSE"):
        read_replica_group({"PARATRAIN_REPLICA_GROUPS": "2"})
