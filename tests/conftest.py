"""Test tiers share these guards: the environment is restored, process groups are destroyed, and a test
that leaves a child process behind fails.

The tiers: `quick` (pure logic and one-rank tests, `make test-quick`, the inner loop) is every test that is
not marked `procs` (starts worker processes or commands), `slow` or `gpu`, and is not in a module whose tests
all start processes. The quick tier checks its own definition: under `-m quick` a test that starts a process
fails, naming the marker to add."""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path
from typing import Any

# The suite tests CPU workers (each a "device"), identically on a machine with GPUs: they are hidden
# before torch looks for them, except for the GPU tests (`make test-gpu`: PARATRAIN_TEST_GPU=1, -m gpu).
if not os.environ.get("PARATRAIN_TEST_GPU"):
    os.environ["CUDA_VISIBLE_DEVICES"] = ""

# One thread per process, as every worker runs: the references computed in the test process then add in the
# same order whatever ran before them (a bf16 reference on 2 threads differs from 1 thread by 3e-3, so a test
# passed or failed by which earlier test had set torch's thread count), and 2 test processes on 2 cores do
# not oversubscribe them. The environment variable reaches commands the tests start, read before torch.
os.environ["OMP_NUM_THREADS"] = "1"

# `paratrain.launch` workers fork from one warm template per test run (paratrain/launcher/_zygote.py), so a
# multi-process test pays torch's import once, not per worker. What the template imports is what the tests'
# workers import lazily (DDP imports torch._dynamo; the zoo builds transformers, peft and torchvision models).
WARM_MODULES = ",".join([
    "torch", "torch._dynamo", "torch.distributed.pipelining", "torch.distributed.fsdp",
    "torch.distributed.tensor.parallel", "torch.distributed.checkpoint", "paratrain", "cloudpickle",
    "transformers.models.gpt2.modeling_gpt2", "transformers.models.llama.modeling_llama",
    "transformers.models.bert.modeling_bert", "peft", "torchvision.models",
])
os.environ.setdefault("PARATRAIN_WARM_WORKERS", WARM_MODULES)

# The matrix traces each zoo model once per run (tests/trace_cache.py), into a folder its workers share; under
# pytest-xdist the controller makes it before the test processes start, and they inherit it.
if "PARATRAIN_TEST_TRACE_CACHE" not in os.environ:
    _TRACES = tempfile.TemporaryDirectory(prefix="paratrain-test-traces-")
    os.environ["PARATRAIN_TEST_TRACE_CACHE"] = _TRACES.name

# The daemons of the Slurm test cluster that tests/test_slurm.py started are listed in this file, and stopped when
# the run ends (pytest_sessionfinish): under pytest-xdist the controller names the file before the test
# processes start, and stops the cluster after they have all ended.
os.environ.setdefault("PARATRAIN_TEST_SLURM_STARTED",
                      os.path.join(tempfile.gettempdir(), f"paratrain-test-slurm-started-{os.getpid()}"))

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

torch.set_num_threads(1)  # torch may have been imported (by a plugin) before the variable above was set

from paratrain.launcher._zygote import template_pids  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).parent))

from helpers import FULL  # noqa: E402

PROCESS_MODULES = {
    "test_collectives", "test_data_equivalence", "test_ddp", "test_ddp_tuning", "test_examples", "test_faults",
    "test_fsdp", "test_hybrid", "test_launcher", "test_notebook", "test_observe_ranks", "test_pp", "test_resume",
    "test_slurm", "test_data_parallel", "test_dropout_stats", "test_warm_run", "test_tensor_parallel",
    "test_hand_sliced", "test_resume_layouts", "test_pipeline_accumulation", "test_orphans",
}
"""Modules whose every test starts processes (the others mark such tests one by one with `procs`)."""


EXTENDED = {
    # the correctness matrix: each column left here has a sibling in make test that runs its machinery
    "test_matrix.py::TestDataAndModelParallelColumns::test_every_model_matches_or_is_refused_by_name[ddp+mp]",  # mp
    "test_matrix.py::TestDataAndModelParallelColumns::test_every_model_matches_or_is_refused_by_name[ddp+tp]",  # tp
    "test_matrix.py::TestDataAndModelParallelColumns::test_every_model_matches_or_is_refused_by_name[fsdp+pp]",
    "test_matrix.py::TestDataAndModelParallelColumns::test_every_model_matches_or_is_refused_by_name[mp]",  # repro/
    "test_matrix.py::TestPipelineColumns::test_every_model_matches_or_is_refused_by_name[pp-gpipe]",  # 1f1b
    "test_matrix.py::TestPipelineColumns::test_every_model_matches_or_is_refused_by_name[pp-zero-bubble]",
    "test_matrix.py::TestPipelineColumns::test_every_model_matches_or_is_refused_by_name[pp-interleaved]",
    "test_matrix.py::TestPipelineColumns::test_every_model_matches_or_is_refused_by_name[fsdp+tp]",  # fsdp+tp+pp
    "test_matrix.py::TestPipelineColumns::test_every_model_matches_or_is_refused_by_name[tp+pp]",  # fsdp+tp+pp
    # meta builds under every layout: README's meta block (fsdp 2, init_from, export) runs in test_docs_run.py,
    # test_init_from.py and test_planner_model.py hold the one-process paths
    "test_meta_build.py",
    "test_moe.py::test_moe_layouts_match_plain_pytorch[fsdp+ep:2]",  # fsdp+ep
    "test_moe.py::test_moe_layouts_match_plain_pytorch[fsdp+tp+ep]",  # fsdp+ep, and experts under tp: archs cells
    "test_moe.py::test_a_checkpoint_resumes_with_the_experts_laid_out_anew[user-fsdp+ep-to-ep]",  # mixtral's
    "test_context_parallel.py::test_context_parallel_layouts_match_plain_pytorch[fsdp+cp-4]",  # cp-2, tp+cp-4
    "test_context_parallel.py::test_context_parallel_layouts_match_plain_pytorch[cp-4]",
    "test_context_parallel.py::test_a_checkpoint_saved_with_shares_of_every_sequence_resumes_under_another_layout[fsdp+cp]",
    # eight workers on two cores: the four-worker cells of the same machinery run in make test
    "test_context_parallel.py::test_context_parallel_layouts_match_plain_pytorch[ddp+fsdp+cp-8]",  # fsdp+cp, ddp+cp
    "test_context_parallel.py::test_context_parallel_layouts_match_plain_pytorch[fsdp+cp+pp-8]",  # cp+pp-4
    "test_context_parallel.py::test_context_parallel_layouts_match_plain_pytorch[tp+cp+pp-8]",  # cp+pp-4, tp+cp-4
    "test_context_parallel.py::test_context_parallel_layouts_match_plain_pytorch[fsdp+cp-token_mean-4]",  # cp-2's
    "test_moe.py::test_moe_layouts_match_plain_pytorch[tp+ep+pp]",  # ep+pp, and tp inside stages: tp+pp's cells
    "test_moe.py::test_moe_layouts_match_plain_pytorch[fsdp+ep+pp]",  # ep+pp, and FSDP over stages: fsdp+pp
    "test_moe.py::test_a_checkpoint_resumes_with_the_experts_laid_out_anew[mixtral-ep+pp-to-fsdp+ep]",  # cp+pp's
    "test_bench.py::test_a_failing_model_is_reported_failed_with_its_error",
    "test_launch_api.py::test_launch_from_a_script[warm]",  # test_launch_api's other warm launches
    "test_lora_export.py::test_lora_export_loads_in_peft_and_matches_plain_pytorch[pp]",  # single, fsdp
    "test_tensor_parallel.py::test_strided_tensors_are_saved_and_loaded_without_gathering_them[regions]",
    "test_tensor_parallel.py::test_fused_weights_checkpoint_whole_and_load_under_any_layout[regions]",
    "test_tensor_parallel.py::test_tp_pp_with_no_other_option_trains",  # the matrix's fsdp+tp+pp
    # a killed launcher: each way of starting workers once by group and once alone
    "test_orphans.py::test_paratrain_run_killed_leaves_no_worker[warm-group]",
    "test_orphans.py::test_paratrain_run_killed_leaves_no_worker[kept-alone]",
    "test_orphans.py::test_paratrain_run_killed_leaves_no_worker[kept-group]",
    "test_orphans.py::test_launch_killed_leaves_no_worker[spawned-alone]",
    "test_orphans.py::test_launch_killed_leaves_no_worker[warm-group]",
    "test_orphans.py::test_an_elastic_restart_is_not_the_agent_dying",  # test_resume's restarts, tied the same way
    # 2 groups of 2 workers (6 processes on 2 cores, 10 s): the [1] case runs the same kill, recovery and redo
    "test_replica_groups.py::test_killed_group_restarts_and_rejoins_from_the_live_one[2]",
    # a group killed in another phase of a step, and again in another phase of its rejoining (10 s each): the
    # [1-forward-recovery] case runs the same kills, redos and recoveries
    "test_replica_groups.py::test_a_group_killed_in_any_phase_and_again_while_rejoining_ends_exact[5-backward-first-step]",
    "test_replica_groups.py::test_a_group_killed_in_any_phase_and_again_while_rejoining_ends_exact[7-optimizer-recovery]",
    # tp and pp inside 2 groups of 2 workers, uninterrupted (25-45 s each): the kill cells of the same layouts
    # (test_a_sharded_group_killed_recovers_each_rank_from_its_counterpart[tp], [pp]) end on the same weights
    "test_replica_groups.py::test_sharded_groups_train_as_one_process[tp]",
    "test_replica_groups.py::test_sharded_groups_train_as_one_process[pp]",
    # fsdp+tp inside 2 groups of 4 workers (10 processes on 2 cores, 50 s): the [fsdp] and [tp] cells run the same
    # per-rank averaging and recovery of DTensor pieces
    "test_replica_groups.py::test_sharded_groups_train_as_one_process[fsdp+tp]",
    "test_replica_groups.py::test_a_sharded_group_killed_recovers_each_rank_from_its_counterpart[fsdp+tp]",
    # a pipeline beside ddp or fsdp inside 2 groups of 4 workers (40-45 s each): the [pp] kill cell runs the same
    # stages averaged and recovered rank by rank, the [fsdp] ones the same shards
    "test_replica_groups.py::test_sharded_groups_train_as_one_process[ddp+pp]",
    "test_replica_groups.py::test_sharded_groups_train_as_one_process[fsdp+pp]",
    "test_replica_groups.py::test_a_sharded_group_killed_recovers_each_rank_from_its_counterpart[ddp+pp]",
    "test_replica_groups.py::test_a_sharded_group_killed_recovers_each_rank_from_its_counterpart[fsdp+pp]",
    # every fsdp group lost (35-70 s): test_every_group_lost_resumes_from_the_last_checkpoint runs the same resume,
    # test_a_sharded_group_killed_recovers_each_rank_from_its_counterpart[fsdp] the same shards
    "test_replica_groups.py::test_every_fsdp_group_lost_resumes_from_the_sharded_checkpoint",
    # whole modules
    "test_resume_layouts.py",  # every layout's checkpoint under every other: test_checkpoint, test_fsdp, test_moe,
    # test_tensor_parallel and test_context_parallel each resume across layouts and world sizes in make test
    "test_pipeline_archs.py",  # library models under pp: test_architectures' CI cells (Mixtral, ViT, ConvNeXt)
}
"""The extended tier: grid cells `make test` leaves to `make test-full` (PARATRAIN_TEST_FULL=1) to stay within its
12 minutes on 2 cores. Each repeats, on another layout or variant, machinery a cell that stays runs (named beside
it where not obvious); an entry without `::` is a whole module. Deselected, never skipped: the report counts them as
deselected."""

def pytest_terminal_summary(terminalreporter: Any, exitstatus: int) -> None:
    """The releases the suite ran on, at the end of every report (quiet ones too): a failure that follows a new
    release names it."""
    terminalreporter.write_line(_releases())


def _releases() -> str:
    from importlib import metadata

    found = []
    for name in ("torch", "transformers", "peft", "datasets", "torchvision"):
        try:
            found.append(f"{name} {metadata.version(name)}")
        except metadata.PackageNotFoundError:
            found.append(f"{name} not installed")
    return "releases: " + ", ".join(found)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not FULL:
        def extended(item: pytest.Item) -> bool:
            node = item.nodeid.removeprefix("tests/")
            return node in EXTENDED or node.split("::")[0] in EXTENDED

        left = [item for item in items if extended(item)]
        if left:
            config.hook.pytest_deselected(items=left)
            items[:] = [item for item in items if not extended(item)]
    for item in items:
        marks = {mark.name for mark in item.iter_markers()}
        if not marks & {"procs", "slow", "gpu"} and item.module.__name__.rsplit(".", 1)[-1] not in PROCESS_MODULES:
            item.add_marker(pytest.mark.quick)


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Stop the Slurm test cluster if this run started it (tests/test_slurm.py), unless PARATRAIN_KEEP_SLURM=1."""
    started = os.environ.get("PARATRAIN_TEST_SLURM_STARTED", "")
    if hasattr(session.config, "workerinput") or not os.path.exists(started):
        return  # an xdist test process (the controller stops it), or nothing was started
    os.remove(started)
    if os.environ.get("PARATRAIN_KEEP_SLURM") == "1":
        return
    import subprocess

    res = subprocess.run(["bash", str(ROOT / "tests" / "cluster" / "slurm_up.sh"), "--down"], capture_output=True,
                         text=True, timeout=120)
    if res.returncode != 0:
        print(f"tests/cluster/slurm_up.sh --down failed ({res.returncode}): {res.stderr.strip()}", file=sys.stderr)


@pytest.fixture
def traced_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Launches fork from the template that has traced every zoo model (helpers.fork_from_traced_template)."""
    from helpers import fork_from_traced_template

    fork_from_traced_template(monkeypatch)


@pytest.fixture(autouse=True)
def _quick_starts_no_process(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under `-m quick`, starting Python (a worker, a launcher, a script) or a shell fails the test; small tools
    such as `lscpu` that a report reads stay allowed."""
    if request.config.getoption("markexpr") != "quick":
        return
    import subprocess

    start = subprocess.Popen._execute_child  # type: ignore[attr-defined]

    def guarded(self: subprocess.Popen[bytes], args: object, *rest: object, **kwargs: object) -> None:
        first = args if isinstance(args, str | bytes) else list(args)[0]  # type: ignore[call-overload]
        name = os.path.basename(os.fsdecode(first).split()[0])
        if "python" in name or name in {"paratrain", "torchrun", "srun", "sbatch", "bash", "sh"}:
            raise AssertionError(f"a quick-tier test started {name!r}: mark it @pytest.mark.procs (tests/conftest.py)")
        start(self, args, *rest, **kwargs)

    monkeypatch.setattr(subprocess.Popen, "_execute_child", guarded)


def _children() -> set[int]:
    """PIDs of live (non-zombie) descendants of this process."""
    me = os.getpid()
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z":
            parents[int(entry)] = int(fields[1])
    found, frontier = set(), {me}
    while frontier:
        frontier = {pid for pid, ppid in parents.items() if ppid in frontier} - found
        found |= frontier
    return found


@pytest.fixture(autouse=True)
def _guard():
    env = dict(os.environ)
    before = _children()
    yield
    if dist.is_initialized():
        dist.destroy_process_group()
    os.environ.clear()
    os.environ.update(env)
    from helpers import kept_template_pids

    leaked = _children() - before - template_pids() - kept_template_pids()
    if leaked:
        import signal
        import time

        time.sleep(1.0)
        leaked = _children() - before - template_pids() - kept_template_pids()
        for pid in leaked:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if leaked:
            pytest.fail(f"test left processes behind: {sorted(leaked)}")
