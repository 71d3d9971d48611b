"""Runs that are killed, preempted, resized or lose a node end where an uninterrupted run ends.

Tier 1: the loader's position across world sizes (no processes). Tier 4: `paratrain run` of
examples/resumable.py, which appends what every step trained on to a per-rank ledger and injects
faults at chosen (rank, step) points, each once (deterministic, no timing). A ledger line of a step
that was rolled back (trained after the last checkpoint, then lost) is superseded by the line of the
generation that trained that step again; counting the surviving lines counts what the final weights saw.
"""

from __future__ import annotations

import collections
import importlib.util
import json
import os
import random
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import EXAMPLES, cli_env, paratrain
from torch.utils.data import DataLoader, TensorDataset

from paratrain import ParatrainError, ShardedLoader
from paratrain.data import epoch_order
from paratrain.runtime import free_port

EXAMPLE = str(EXAMPLES / "resumable.py")
SAMPLES, EPOCHS, GLOBAL_BATCH = 72, 3, 12
STEPS = SAMPLES // GLOBAL_BATCH * EPOCHS
TOL = 1e-5
"""float32 weights of runs on different world sizes agree to ~1e-7 (observed); same world size: bit-identical."""


# -- tier 1: the position is global, so any world size continues it ------------------------------------
def _loaders(replicas: int, seed: int = 5) -> list[ShardedLoader]:
    data = TensorDataset(torch.arange(SAMPLES))
    per = GLOBAL_BATCH // replicas
    return [ShardedLoader(DataLoader(data, batch_size=per, shuffle=True), r, replicas, seed) for r in range(replicas)]


def _take(loaders: list[ShardedLoader], steps: int | None) -> list[list[int]]:
    """Global batches (all replicas' shares joined): the first `steps` of them, or the rest of the epoch."""
    if steps is None:
        shares = [[b[0].tolist() for b in loader] for loader in loaders]  # each replica runs to its epoch end
        assert len({len(s) for s in shares}) == 1
        return [sum(step, []) for step in zip(*shares)]
    its = [iter(x) for x in loaders]
    return [sum([next(it)[0].tolist() for it in its], []) for _ in range(steps)]


@pytest.mark.parametrize("before,after", [(3, 2), (2, 3), (1, 4), (4, 1)])
def test_resuming_on_another_world_size_trains_the_rest_of_the_epoch_exactly_once(before: int, after: int) -> None:
    first = _loaders(before)
    done = _take(first, 2)
    state = first[0].state_dict()
    assert all(x.state_dict() == state for x in first)  # every replica holds the same global position
    second = _loaders(after)
    for loader in second:
        loader.load_state_dict(state)
    rest = _take(second, None)
    order = epoch_order(SAMPLES, 5, 0, True)
    flat = sum(done + rest, [])
    assert sorted(flat) == list(range(SAMPLES))  # none repeated, none skipped
    # the same global batches, in the same order, as an uninterrupted run (each split among new ranks)
    uninterrupted = [sorted(order[i:i + GLOBAL_BATCH]) for i in range(0, SAMPLES, GLOBAL_BATCH)]
    assert [sorted(b) for b in done + rest] == uninterrupted
    assert all(x.epoch == 1 and x.consumed == 0 for x in second)  # and the next epoch follows


def test_a_position_from_another_dataset_or_order_is_refused() -> None:
    (loader,) = _loaders(1)
    state = {**loader.state_dict(), "consumed": 24}
    small = ShardedLoader(DataLoader(TensorDataset(torch.arange(50)), batch_size=4, shuffle=True), 0, 1, 5)
    with pytest.raises(ParatrainError, match="dataset of 72 samples but this one has 50"):
        small.load_state_dict(state)
    ordered = ShardedLoader(DataLoader(TensorDataset(torch.arange(SAMPLES)), batch_size=4), 0, 1, 5)
    with pytest.raises(ParatrainError, match="shuffle=True but this loader has shuffle=False"):
        ordered.load_state_dict(state)
    with pytest.raises(ParatrainError, match="seed 5 but this run uses seed 6"):
        _loaders(1, seed=6)[0].load_state_dict(state)


# -- tier 4 helpers ----------------------------------------------------------------------------------
def _command(tmp: Path, nproc: int, *args: str, launch: tuple[str, ...] = ()) -> list[str]:
    return [sys.executable, "-m", "paratrain.cli", "run", "--nproc", str(nproc), *launch, EXAMPLE,
            "--checkpoint-dir", str(tmp / "ckpt"), "--ledger", str(tmp / "ledger"), *args]


def _run(tmp: Path, nproc: int, *args: str, launch: tuple[str, ...] = (), timeout: float = 150) -> str:
    out = paratrain(*_command(tmp, nproc, *args, launch=launch)[3:], timeout=timeout)
    return f"rc={out.returncode}\n{out.stdout}"


def _records(folder: Path) -> list[dict[str, Any]]:
    out = []
    for file in sorted(folder.glob("rank-*.jsonl")):
        rank = int(file.stem.split("-")[1])
        out += [{**json.loads(line), "rank": rank} for line in file.read_text().splitlines()]
    return out


def _effective(records: list[dict[str, Any]]) -> dict[tuple[int, int], dict[str, Any]]:
    """(step, rank) -> the record of the last generation that trained that step."""
    steps = [r for r in records if "idx" in r]
    last = {}
    for r in steps:
        last[r["step"]] = max(last.get(r["step"], 0), r["gen"])
    return {(r["step"], r["rank"]): r for r in steps if r["gen"] == last[r["step"]]}


def _assert_exactly_once(effective: dict[tuple[int, int], dict[str, Any]]) -> None:
    assert sorted({s for s, _ in effective}) == list(range(1, STEPS + 1))
    per_epoch = collections.defaultdict(list)
    for rec in effective.values():
        per_epoch[rec["epoch"]] += rec["idx"]
    counts = {e: collections.Counter(v) for e, v in per_epoch.items()}
    assert sorted(counts) == list(range(EPOCHS))
    for epoch, count in counts.items():
        assert sorted(count) == list(range(SAMPLES)) and set(count.values()) == {1}, (epoch, count.most_common(3))


def _global_batches(effective: dict[tuple[int, int], dict[str, Any]]) -> dict[int, list[int]]:
    out: dict[int, list[int]] = collections.defaultdict(list)
    for (step, _), rec in effective.items():
        out[step] += rec["idx"]
    return {s: sorted(v) for s, v in out.items()}


def _final(path: Path) -> dict[str, Any]:
    return torch.load(path, weights_only=False)  # type: ignore[no-any-return]


def _diff(a: dict[str, Any], b: dict[str, Any]) -> float:
    tensors = [(a["model"][k], b["model"][k]) for k in a["model"]]
    tensors += [(x[k], b["optimizer"]["state"][i][k]) for i, x in a["optimizer"]["state"].items() for k in x]
    return max(float((x.double() - y.double()).abs().max()) for x, y in tensors)


def _identical(a: dict[str, Any], b: dict[str, Any]) -> bool:
    same = all(torch.equal(a["model"][k], b["model"][k]) for k in b["model"])
    state_a, state_b = a["optimizer"]["state"], b["optimizer"]["state"]
    same = same and state_a.keys() == state_b.keys()
    same = same and all(torch.equal(state_a[i][k], state_b[i][k]) for i in state_b for k in state_b[i])
    return same and a["scheduler"] == b["scheduler"] and a["step"] == b["step"] == STEPS


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One process, plain python, no dropout: what any world size must reach (float tolerance)."""
    tmp = tmp_path_factory.mktemp("reference")
    spec = importlib.util.spec_from_file_location("resumable_example", EXAMPLE)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main(["--checkpoint-dir", str(tmp / "ckpt"), "--ledger", str(tmp / "ledger"), "--dropout", "0",
                 "--out", str(tmp / "final.pt")])
    return {"final": _final(tmp / "final.pt"), "batches": _global_batches(_effective(_records(tmp / "ledger")))}


# -- the kill test -----------------------------------------------------------------------------------
@pytest.mark.timeout(240)
def test_killed_three_times_ends_bit_identical_with_every_sample_once(tmp_path: Path) -> None:
    """2 workers SIGKILLed at seeded random (rank, step) points, one of them while writing a checkpoint."""
    rng = random.Random(4)
    first = rng.randint(1, 7)
    in_save = rng.choice([8, 12])
    last = rng.randint(in_save + 1, STEPS - 1)
    ranks = [rng.randint(0, 1) for _ in range(3)]
    plan = f"kill:{ranks[0]}@{first},kill-in-save:{ranks[1]}@{in_save},kill:{ranks[2]}@{last}"

    # the uninterrupted run goes on beside the killed one (its restarts leave the cores idle for a while)
    whole = subprocess.Popen(_command(tmp_path / "whole", 2, "--out", str(tmp_path / "whole.pt")), text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=cli_env(), start_new_session=True)
    try:
        got = _run(tmp_path / "killed", 2, "--out", str(tmp_path / "killed.pt"), "--fault", plan,
                   launch=("--max-restarts", "4"))
        want, _ = whole.communicate(timeout=120)
    finally:
        if whole.poll() is None:
            _kill_tree(whole)
    assert whole.returncode == 0, want[-3000:]
    assert got.startswith("rc=0"), got[-5000:]

    records = _records(tmp_path / "killed" / "ledger")
    faults = [(r["kind"], r["step"]) for r in sorted(records, key=lambda r: r["t"]) if r.get("event") == "fault"]
    assert faults == [("kill", first), ("kill-in-save", in_save), ("kill", last)], (plan, faults)
    starts = sorted({(r["gen"], r["step"]) for r in records if r.get("event") == "start"})
    assert len(starts) == 4  # the first run and three restarts by the elastic agent
    # after each kill the run resumed from the newest complete checkpoint (saved every 4 steps, after the
    # step's kill point); after the kill inside the save of step `in_save`, from the one before it
    resumed_at = [(first - 1) // 4 * 4, in_save - 4, (last - 1) // 4 * 4]
    assert [s for _, s in starts] == [0, *resumed_at]
    assert got.count("paratrain: resumed from") == sum(1 for s in resumed_at if s > 0)
    assert "did not arrive" in got and "has exited" in got  # survivors named the dead rank

    assert _identical(_final(tmp_path / "killed.pt"), _final(tmp_path / "whole.pt"))
    effective = _effective(records)
    _assert_exactly_once(effective)
    reference_order = _effective(_records(tmp_path / "whole" / "ledger"))
    assert {k: (v["epoch"], v["idx"]) for k, v in effective.items()} == \
        {k: (v["epoch"], v["idx"]) for k, v in reference_order.items()}  # same samples, same ranks, same order
    ckpt = tmp_path / "killed" / "ckpt"
    assert (ckpt / "latest").read_text() == "step-000000016" and not list(ckpt.glob(".tmp-*"))


# -- preemption and world-size changes ---------------------------------------------------------------
@pytest.mark.timeout(240)
def test_preempted_and_resized_3_to_2_to_3_matches_the_single_process_run(
        tmp_path: Path, reference: dict[str, Any]) -> None:
    common = ("--dropout", "0")
    # 3 workers; the launcher gets SIGTERM (a preemption): every worker saves at the same step and stops
    first = _run(tmp_path, 3, *common, "--fault", "term-launcher:0@5")
    assert first.startswith(f"rc={128 + signal.SIGTERM}") and "stopped by signal SIGTERM" in first, first[-3000:]
    ends = [r for r in _records(tmp_path / "ledger") if r.get("event") == "end"]
    assert len(ends) == 3 and all(r["stopped"] for r in ends) and len({r["step"] for r in ends}) == 1
    stopped = ends[0]["step"]
    assert stopped >= 5 and (tmp_path / "ckpt" / "latest").read_text() == f"step-{stopped:09d}"
    # 2 workers resume it; one worker alone gets SIGTERM at step `stopped + 3`: all stop there together
    second = _run(tmp_path, 2, *common, "--fault", f"term:1@{stopped + 3}")
    assert second.startswith("rc=0"), second[-3000:]
    assert (tmp_path / "ckpt" / "latest").read_text() == f"step-{stopped + 3:09d}"
    # 3 workers finish the run
    third = _run(tmp_path, 3, *common, "--out", str(tmp_path / "final.pt"))
    assert third.startswith("rc=0"), third[-3000:]

    records = _records(tmp_path / "ledger")
    starts = sorted({(r["gen"], r["step"], r["world"]) for r in records if r.get("event") == "start"})
    assert [(s, w) for _, s, w in starts] == [(0, 3), (stopped, 2), (stopped + 3, 3)]
    effective = _effective(records)
    _assert_exactly_once(effective)
    assert _global_batches(effective) == reference["batches"]  # the same global batches as one process
    assert _diff(_final(tmp_path / "final.pt"), reference["final"]) < TOL


# -- losing a node -----------------------------------------------------------------------------------
def _descendants(pid: int) -> list[int]:
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    found, frontier = [], {pid}
    while frontier:
        frontier = {p for p, pp in parents.items() if pp in frontier}
        found += sorted(frontier)
    return found


def _kill_tree(proc: subprocess.Popen[str]) -> None:
    for pid in [proc.pid, *_descendants(proc.pid)]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.communicate()


@pytest.mark.timeout(240)
def test_losing_one_of_two_nodes_continues_on_the_other(tmp_path: Path, reference: dict[str, Any]) -> None:
    """Two launchers on loopback (--nnodes 1:2); the second kills itself and its worker at step 7. The
    first node's agent restarts its worker alone, which resumes from the last checkpoint and finishes."""
    port = str(free_port())

    def node(rank: int, *extra: str) -> subprocess.Popen[str]:
        args = [sys.executable, "-m", "paratrain.cli", "run", "--nnodes", "1:2", "--nproc", "1", "--node-rank",
                str(rank), "--master-port", port, "--max-restarts", "3", EXAMPLE, "--checkpoint-dir",
                str(tmp_path / "ckpt"), "--ledger", str(tmp_path / "ledger"), "--every", "2", "--dropout", "0", *extra]
        return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=cli_env(),
                                start_new_session=True)

    survivor = node(0, "--out", str(tmp_path / "final.pt"))
    doomed = node(1, "--fault", "kill-node:*@7")
    try:
        out, _ = survivor.communicate(timeout=180)
        said, _ = doomed.communicate(timeout=30)
    finally:
        for proc in (survivor, doomed):
            if proc.poll() is None:
                _kill_tree(proc)
    assert survivor.returncode == 0, out[-4000:]
    assert doomed.returncode == -signal.SIGKILL, said[-3000:]

    records = _records(tmp_path / "ledger")
    assert [(r["kind"], r["step"]) for r in records if r.get("event") == "fault"] == [("kill-node", 7)]
    starts = sorted({(r["gen"], r["step"], r["world"]) for r in records if r.get("event") == "start"})
    assert [(s, w) for _, s, w in starts] == [(0, 2), (6, 1)]
    effective = _effective(records)
    _assert_exactly_once(effective)
    assert _global_batches(effective) == reference["batches"]
    assert _diff(_final(tmp_path / "final.pt"), reference["final"]) < TOL
