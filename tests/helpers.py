"""Small in-repo harness for multi-process tests: subprocess runs of the CLI with a timeout, and
comparisons of state dicts."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

FULL = os.environ.get("PARATRAIN_TEST_FULL") == "1"
"""`make test-full`: every cell of the grids, the extended tier (tests/conftest.py EXTENDED) included."""

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"


CLI_WARM_MODULES = "torch,torch._dynamo,torch.distributed.pipelining,paratrain"
"""A command that calls `paratrain.launch` (the bench, a notebook) forks its workers from a template importing
these, started only if it launches: fewer modules than the suite's own template, so it starts in seconds."""


TWO_CORES = {
    "name": "two-cores", "kind": "cpu", "devices_per_node": 2, "nodes": 1,
    "device": {"peak_tflops": {"32": 0.08, "bf16": 0.08, "16": 0.08}, "memory_gib": 8, "memory_bandwidth_gbps": 6},
    "intra_node": {"bandwidth_gbps": 1.8, "latency_us": 420}, "efficiency": [[6.5e4, 0.18], [1e9, 0.5]],
    "overlap": 0.0, "process_gib": 0.6, "action_overhead_us": 1300, "step_overhead_us": 40, "measured_here": True,
}
"""A spec shaped like the one `--cluster local` measures on a 2-core machine, so the test skips the measuring."""


def cli_env(**extra: str) -> dict[str, str]:
    """This environment for a launched command, less any cluster's (the suite run inside a Slurm job or a pod
    must not make `paratrain run` join that job). Its `paratrain run` workers fork from the template this test
    process keeps (`kept_template`), unless `extra` names the warm modules itself (a run's own template, or
    none: spawned workers)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "PET_"))}
    env["PARATRAIN_WARM_WORKERS"] = CLI_WARM_MODULES
    if "PARATRAIN_WARM_WORKERS" not in extra:
        env["PARATRAIN_WARM_TEMPLATE"] = kept_template()
    env.update({"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
    env.update(extra)
    return env


_KEPT: list[Any] = []


def kept_template() -> str:
    """The socket of one `paratrain run` template for this test process (launcher/_warm_run.keep): each CLI run
    would otherwise start its own, importing torch and dynamo again (6.5 s of CPU a run)."""
    if not _KEPT:
        import atexit

        from paratrain.launcher import _warm_run

        _KEPT.append(_warm_run.keep(tuple(CLI_WARM_MODULES.split(","))))
        atexit.register(_KEPT[0].close)
    return str(_KEPT[0].path)


def kept_template_pids() -> set[int]:
    return {kept.proc.pid for kept in _KEPT if kept.proc.poll() is None}


def bench_here(capsys: Any, *args: str) -> tuple[int, str]:
    """`paratrain bench ARGS` run by the CLI's own entry point in this test process (capsys: pytest's fixture):
    its workers fork from the process's warm template, where the command would first start a template of its own
    (6.5 s of CPU); tests/test_bench.py runs the command itself end to end. Returns the exit code and stdout."""
    from paratrain.cli import main

    capsys.readouterr()
    code = main(["bench", *args])
    return code, capsys.readouterr().out


def run_cmd(args: list[str], timeout: float = 120, env: dict[str, str] | None = None,
            cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """Run a command to completion (killing its whole process group on timeout)."""
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env or cli_env(), cwd=cwd or ROOT, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        import signal

        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(f"command timed out after {timeout}s: {args}\n{out[-3000:]}") from None
    return subprocess.CompletedProcess(args, proc.returncode, out, "")


def paratrain(*args: str, timeout: float = 120, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return run_cmd([sys.executable, "-m", "paratrain.cli", *args], timeout=timeout, env=env)


def doc_block(marker: str, doc: str = "docs/launchers.md") -> str:
    """The fenced block that follows `<!-- marker -->` in a doc: what users copy is what a test runs."""
    text = (ROOT / doc).read_text()
    head = f"<!-- {marker} -->\n```"
    start = text.index(head) + len(head)
    body = text[text.index("\n", start) + 1 :]
    return body[: body.index("```\n")]


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def toy_data(n: int = 96, d_in: int = 16, d_out: int = 4):  # type: ignore[no-untyped-def]
    from torch.utils.data import TensorDataset

    g = torch.Generator().manual_seed(123)
    return TensorDataset(torch.randn(n, d_in, generator=g), torch.randn(n, d_out, generator=g))


def toy_model(d_in: int = 16, hidden: int = 32, d_out: int = 4) -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(d_in, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, d_out))


def train_toy(strategy: str = "single", global_batch: int = 12, epochs: int = 2, grad_accum: int = 1,
              precision: str = "32", record: bool = False, **options: object) -> dict[str, object]:
    """A few epochs of the toy regression under `strategy`; returns final weights, per-step losses and
    (with record=True) the sample indices this rank saw, for comparisons across world sizes."""
    from torch.utils.data import DataLoader

    import paratrain

    run = paratrain.setup(strategy=strategy, grad_accum=grad_accum, precision=precision, seed=7, **options)
    data = toy_data()
    indexed = torch.utils.data.TensorDataset(torch.arange(len(data)), *data.tensors)
    loader = run.prepare_loader(DataLoader(indexed, batch_size=run.per_worker_batch(global_batch), shuffle=True))
    model = toy_model()
    model, optimizer = run.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    loss_fn = torch.nn.MSELoss()
    losses, seen = [], []
    for _ in range(epochs):
        for idx, x, y in loader:
            seen.append(idx.tolist())
            loss = loss_fn(model(x), y)
            run.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(float(run.all_reduce(loss.detach(), "mean")))
    weights = {k: _full(v) for k, v in run.unwrap(model).state_dict().items()}
    out = {"weights": weights, "losses": losses, "rank": run.rank, "world": run.world_size}
    logging_data = getattr(model, "_get_ddp_logging_data", None)  # what DDP says it was built with
    if logging_data is not None:
        out["ddp"] = {k: v for k, v in logging_data().items() if isinstance(v, int | str)}
    if record:
        out["seen"] = seen
    run.close()
    return out


def shuffled_order(n: int, seed: int, epoch: int) -> list[int]:
    """An epoch's global order for DataLoader(shuffle=True) under setup(seed=seed): paratrain's documented rule
    (the docstring of src/paratrain/data/order.py), restated here rather than imported, so that a bug in the
    library's ordering shows against the references below instead of being shared by them."""
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed * 100_003 + epoch)).tolist()


def plain_train(build: Callable[[], torch.nn.Module], inputs: torch.Tensor, targets: torch.Tensor, *, seed: int,
                global_batch: int, epochs: int, lr: float, momentum: float = 0.0,
                precision: str = "32") -> dict[str, Any]:
    """The loop a user writes without paratrain, in one process, that every strategy must reproduce: the model
    built right after torch.manual_seed(seed) (what setup(seed=...) does), consecutive global batches of the
    epoch's order (a short last one kept, its loss the mean over its own rows), one SGD step per global batch,
    MSE. bf16 autocasts the forward only and computes the loss in float32, as a plain AMP loop does. Nothing
    of paratrain is imported, so it cannot share a bug with the library's `single` strategy."""
    if precision not in ("32", "bf16"):
        raise ValueError(f"precision {precision!r}: use '32' or 'bf16'")
    with torch.random.fork_rng(devices=[]):  # the caller's RNG stream is left as it was
        torch.manual_seed(seed)
        model = build()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    loss_fn = torch.nn.MSELoss()
    losses = []
    for epoch in range(epochs):
        order = torch.tensor(shuffled_order(len(inputs), seed, epoch))
        for rows in order.split(global_batch):
            x, y = inputs[rows], targets[rows]
            if precision == "bf16":
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    out = model(x)
                out = out.float()
            else:
                out = model(x)
            loss = loss_fn(out, y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
    return {"weights": {k: v.detach().clone() for k, v in model.state_dict().items()}, "losses": losses}


def plain_toy(global_batch: int = 12, epochs: int = 2, precision: str = "32") -> dict[str, Any]:
    """`train_toy`'s run as a plain PyTorch loop: the reference for every strategy's toy run."""
    inputs, targets = toy_data().tensors
    return plain_train(toy_model, inputs, targets, seed=7, global_batch=global_batch, epochs=epochs, lr=0.1,
                       momentum=0.9, precision=precision)


class ExampleToy(torch.nn.Module):
    """examples/toy.py's ToyModel, restated (same layers, same state_dict names) because that script imports
    paratrain; if the example changes, the comparisons with `plain_example_toy` fail rather than drift."""

    def __init__(self) -> None:
        super().__init__()
        self.net1 = torch.nn.Linear(10, 10)
        self.relu = torch.nn.ReLU()
        self.net2 = torch.nn.Linear(10, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net2(self.relu(self.net1(x)))


def plain_example_toy(global_batch: int = 12, epochs: int = 2) -> dict[str, torch.Tensor]:
    """Final weights of examples/toy.py at its defaults (seed 0, SGD lr 0.1 without momentum, shuffle=True),
    trained by `plain_train`: the reference for the launcher tests and tests/cluster/train.py."""
    inputs = torch.randn(96, 10, generator=torch.Generator().manual_seed(1))
    targets = torch.randn(96, 5, generator=torch.Generator().manual_seed(2))
    return plain_train(ExampleToy, inputs, targets, seed=0, global_batch=global_batch, epochs=epochs,
                       lr=0.1)["weights"]  # type: ignore[no-any-return]


def _full(value: torch.Tensor) -> torch.Tensor:
    """A whole tensor from a possibly sharded one (FSDP2 keeps DTensor shards)."""
    full = getattr(value, "full_tensor", None)
    return (full() if full is not None else value).detach().clone()


def check_job(strategy: str, world: int = 1, **options: object) -> None:
    """What `setup` checks before any process group starts: the options (validated config), then the
    strategy's own check for a job of `world` CPU workers."""
    from paratrain.config import make_config
    from paratrain.runtime import Placement
    from paratrain.strategies import get
    from paratrain.strategies.base import Context

    ctx = Context(config=make_config({"strategy": strategy, **options}),
                  placement=Placement(world_size=world, local_world_size=world), device=torch.device("cpu"))
    get(strategy).check(ctx)


def fork_from_traced_template(patch: Any) -> None:
    """Launches made under `patch` (a pytest MonkeyPatch) fork from a template that has traced every zoo model
    (tests/matrix_warm.py), one per test process: the correctness matrix and the resume grid share it."""
    tests = str(Path(__file__).parent)
    patch.setenv("PARATRAIN_WARM_WORKERS", os.environ.get("PARATRAIN_WARM_WORKERS", "torch") + ",matrix_warm")
    patch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [tests, os.environ.get("PYTHONPATH")])))


def refused_list(path: Path) -> tuple[dict[str, str], int]:
    """A list of refused cells (label -> text the refusal must contain) and the count recorded with it: each line a
    cell's label, `|`, the text; `# cells: N` the count, which may only fall."""
    cells, recorded = {}, -1
    for line in path.read_text().splitlines():
        if line.startswith("# cells:"):
            recorded = int(line.split(":", 1)[1])
        elif line.strip() and not line.startswith("#"):
            label, reason = (part.strip() for part in line.split("|", 1))
            cells[label] = reason
    return cells, recorded


def alive(pid: int) -> bool:
    """Running, not a zombie (an orphan reaped by nobody is dead all the same)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
