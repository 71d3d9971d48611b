"""The GPU tier (`make test-gpu`: PARATRAIN_TEST_GPU=1 pytest -m gpu): paratrain on CUDA against plain PyTorch on
the same GPU, sized for one lent H100 or H200 (16 cores) in one go, well under 8 minutes.

Every other tier runs CPU workers (tests/conftest.py hides the GPUs), so what only a GPU exercises is here: nccl
process groups, DDP and FSDP2 on a device, autocast's CUDA kernels and the fp16 GradScaler, SyncBatchNorm, a
one-process pipeline's copy streams with both stages on one GPU, a user's compiled model, and the `gpt` bench's
tokens/s and MFU against a datasheet peak. The correctness tests train the zoo (tests/zoo) through paratrain's
public API as the CPU matrix does (tests/matrix_cells.py) and hold every step's loss and weights to the zoo's
tolerances against `zoo.reference` run on the same GPU, which imports nothing of paratrain. A strategy that needs
workers gets one launch that trains all its models, one after the other.

One GPU is enough: ddp and fsdp run one nccl worker (world size 1, what a lent machine has); the BatchNorm test
runs two workers where two GPUs are visible. Without a GPU every test is skipped and says why.

Measured on one H200 (16 cores, torch 2.11.0+cu130), 2026-11-27: every test passed (after the fix to traced
pipeline stages placed on a GPU that the first run found, docs/benchmarks.md section G). Seconds per test:

| test | measured |
| --- | --- |
| single, 15 models (and the fp32 references, cached for the tests after it) | 12 s |
| ddp, 15 models fp32 + 3 bf16 + 2 fp16, one nccl worker | 37-42 s |
| fsdp, 15 models fp32 + 3 bf16, one nccl worker | 38-40 s |
| mp, both stages on cuda:0, 15 models (M=4; M=1 for BatchNorm) | 28-32 s |
| bf16 / fp16 under single, 8 cells; the same on 2 HF models | 10 s; 13 s |
| ddp BatchNorm on GPUs (SyncBatchNorm) | 12-13 s |
| torch.compile'd gpt and cnn_bn (cold inductor compile) | 34-42 s |
| gpt bench, GPT-2 small, fp32 and bf16 | 46 s + 39 s |
| in all, one after the other (make test-gpu), with tests/test_mp.py's GPU test (5 s) | about 5 min |
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sysconfig
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import helpers
import pytest
import torch
import torch.distributed as dist
import zoo
from matrix_cells import full_state
from torch import nn
from zoo.case import ZooCase
from zoo.compare import AUTOCAST_FLOOR, max_diff, mismatches
from zoo.dropout_rule import applies_to, layout_rule
from zoo.reference import (
    Optim,
    Record,
    chunk,
    eval_batch,
    global_batches,
    run_reference,
    snapshot,
    to_device,
    to_float32,
    torch_rng,
)

import paratrain

NEEDS_GPU = ("needs a CUDA GPU; the GPU tier runs with PARATRAIN_TEST_GPU=1 (make test-gpu), without which "
             "tests/conftest.py hides the GPUs")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason=NEEDS_GPU)]

DEVICE = "cuda"
"""Where the references run and what paratrain is asked for (`accelerator`); a parameter of the helpers below
only so that they can be tried on CPU while this file is developed."""
MODELS = tuple(name for name, case in zoo.MODELS.items() if not case.has(zoo.case.SLOW))
"""Every zoo model but ResNet-50 (25 M parameters: its per-step state copies would cost more than the rest)."""
SIZES = (8, 8, 4)
"""Rows of the global batches: two full ones and a short last one, as the CPU matrix trains."""
EVAL_ROWS = 6
SETUP_PRECISION = {"fp32": "32", "bf16": "bf16", "fp16": "16"}
COMPUTE_DTYPE = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
BF16_MODELS = ("gpt", "llama", "mlp", "cnn_bn")
FP16_MODELS = ("gpt", "llama", "mlp", "cnn_bn")
HF_MODELS = ("hf_gpt2", "hf_llama")
"""Under bf16/fp16 in their own test: the float32 cast must keep their ModelOutput (it once did not)."""
COMPILE_MODELS = ("gpt", "cnn_bn")
COMPILE_SIZES = (8, 8, 8)
"""Equal batches: a short last one would make torch.compile trace again with a dynamic batch dimension."""
LAUNCH_TIMEOUT_S = 240.0
BN_TYPES = nn.modules.batchnorm._BatchNorm


# -- the user's loop on one cell (in this process, or in every worker of a launch) ------------------------------


@dataclass(frozen=True)
class GpuCell:
    """One model trained one way: strategy, precision, micro-batches, and what the user did to it before prepare."""

    model: str
    strategy: str
    precision: str = "fp32"
    microbatches: int | None = None
    compiled: bool = False
    """The user's `torch.compile(model)` before prepare (paratrain has no compile option of its own)."""
    sync_bn: bool = False
    """The user's `nn.SyncBatchNorm.convert_sync_batchnorm(model)` before prepare."""

    @property
    def label(self) -> str:
        extra = [f"M={self.microbatches}" if self.microbatches is not None else "",
                 self.precision if self.precision != "fp32" else "", "compiled" if self.compiled else "",
                 "user SyncBatchNorm" if self.sync_bn else ""]
        return " ".join([f"{self.model} / {self.strategy}", *filter(None, extra)])


def _stage_devices(device: str) -> list[str]:
    """Both pipeline stages on the first GPU: what `mp` does with one GPU, and what a lent machine has."""
    return ["cuda:0", "cuda:0"] if torch.device(device).type == "cuda" else ["cpu", "cpu"]


def _first_layer_dtype(model: nn.Module) -> dict[str, str]:
    """Filled with the dtype the first Linear/Conv2d computes in at the first forward: paratrain hands float32
    outputs back, so only inside the model can a test see that autocast (or FSDP's policy) really ran."""
    seen: dict[str, str] = {}
    layer = next((m for m in model.modules() if isinstance(m, nn.Linear | nn.Conv2d)), None)
    if layer is not None:
        def record(module: nn.Module, args: Any, output: Any) -> None:
            if isinstance(output, torch.Tensor):
                seen.setdefault("dtype", str(output.dtype))

        layer.register_forward_hook(record)
    return seen


def _plain_names(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A compiled module's state_dict under the user's module's names (torch.compile prefixes `_orig_mod.`)."""
    return {k.removeprefix("_orig_mod."): v for k, v in state.items()}


def _all_dtensors(model: nn.Module) -> bool:
    from torch.distributed.tensor import DTensor

    return all(isinstance(p, DTensor) for p in model.parameters())


def run_cell(cell: GpuCell, sizes: tuple[int, ...] = SIZES, device: str = DEVICE) -> dict[str, Any]:
    """The user's loop through paratrain's public API on one cell: losses and whole weights after every step, an
    evaluation pass, and what the run was made of (backend, devices, BatchNorm types, compute dtype, scale)."""
    case = zoo.MODELS[cell.model]
    options: dict[str, Any] = {}
    if cell.strategy == "mp":  # the cut pinned, as in the CPU matrix: no cell passes or fails by a timing's cut
        options.update(devices=_stage_devices(device), balance="equal")
    if cell.microbatches is not None:
        options["microbatches"] = cell.microbatches
    run = paratrain.setup(strategy=cell.strategy, seed=0, precision=SETUP_PRECISION[cell.precision],
                          accelerator=torch.device(device).type, timeout_s=120, **options)
    try:
        replica, replicas = run.strategy.data_shard(run.ctx)
        batches = global_batches(case, 0, sizes)
        model = case.build(0)
        if cell.sync_bn:
            model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
        if cell.compiled:
            model = torch.compile(model)
        optimizer = Optim().make(model.parameters(), case)
        mine = chunk(batches[0][0], replicas)[replica]
        model, optimizer = run.prepare(model, optimizer, example=to_device(mine, run.device))
        user = run.unwrap(model)
        sharded = _all_dtensors(user)  # now: after a forward without backward, FSDP2 leaves the root unsharded
        seen = _first_layer_dtype(user) if cell.strategy != "mp" and not cell.compiled else {}
        losses, weights = [], []
        for inputs, targets in batches:
            inputs, targets = (to_device(chunk(v, replicas)[replica], run.device) for v in (inputs, targets))
            losses.append(float(run.forward_backward(model, inputs, targets, case.loss_fn)))
            optimizer.step()
            optimizer.zero_grad()
            weights.append(_plain_names(full_state(user)))
        eval_loss = None
        if cell.microbatches in (None, 1) and cell.precision == "fp32" and not cell.compiled:
            x, y = eval_batch(case, rows=EVAL_ROWS)
            x, y = (to_device(chunk(v, replicas)[replica], run.device) for v in (x, y))
            eval_loss = float(run.evaluate(model, x, y, case.loss_fn))
        return {
            "losses": losses, "weights": weights, "eval_loss": eval_loss, "rank": run.rank,
            "backend": dist.get_backend() if dist.is_initialized() else None,
            "world": dist.get_world_size() if dist.is_initialized() else 1,
            "device": str(run.device), "devices": [str(d) for d in run.strategy.devices(run.ctx)],
            "norms": sorted({type(m).__name__ for m in user.modules() if isinstance(m, BN_TYPES)}),
            "sharded": sharded, "dtype": seen.get("dtype"),
            "scale": run.scaler.get_scale() if run.scaler is not None else None,
        }
    finally:
        run.close()


def run_cells(cells: list[GpuCell], sizes: tuple[int, ...] = SIZES, device: str = DEVICE) -> dict[str, Any]:
    """Every cell in this process: ("ok", result), ("refused", message) for a ParatrainError, or ("error",
    traceback) for anything else, so one broken cell is reported beside the others instead of hiding them."""
    out: dict[str, Any] = {}
    for cell in cells:
        try:
            out[cell.label] = ("ok", run_cell(cell, sizes, device))
        except paratrain.ParatrainError as exc:
            out[cell.label] = ("refused", str(exc))
        except Exception:
            out[cell.label] = ("error", traceback.format_exc())
    return out


def launch_cells(monkeypatch: pytest.MonkeyPatch, cells: list[GpuCell], nproc: int,
                 sizes: tuple[int, ...] = SIZES) -> list[dict[str, Any]]:
    """One launch of `nproc` GPU workers training every cell; each rank's outcomes. The workers start as fresh
    processes rather than forks of the suite's warm template (conftest.py), so that CUDA is first touched in a
    new process, the one way torch documents as safe whatever a template imported."""
    monkeypatch.delenv("PARATRAIN_WARM_WORKERS", raising=False)
    return paratrain.launch(run_cells, cells, sizes, DEVICE, nproc=nproc, accelerator="cuda",  # type: ignore[no-any-return]
                            timeout=LAUNCH_TIMEOUT_S, all_ranks=True)


# -- the plain-PyTorch references, on the same GPU ----------------------------------------------------------------


def _dropout_rule(case: ZooCase) -> Any:
    return layout_rule if applies_to(case.build(0)) else torch_rng


@cache
def fp16_reference(model: str, sizes: tuple[int, ...], device: str) -> tuple[Record, float]:
    """`zoo.reference` in float16 (it knows fp32 and bf16): autocast around the forward, outputs cast to float32
    and the loss taken outside it, torch.amp.GradScaler with its defaults; also the scale after the last step."""
    case = zoo.MODELS[model]
    rule = _dropout_rule(case)
    net = case.build(0).to(device)
    opt = Optim().make(net.parameters(), case)
    scaler = torch.amp.GradScaler(torch.device(device).type)
    record = Record(initial=snapshot(net))
    for step, (inputs, targets) in enumerate(global_batches(case, 0, sizes)):
        inputs, targets = to_device(inputs, device), to_device(targets, device)
        net.train()
        rule(net, 0, step)
        with torch.autocast(torch.device(device).type, dtype=torch.float16):
            out = to_float32(net(inputs))
        loss = case.loss_fn(out, targets)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        record.losses.append(loss.item())
        record.weights.append(snapshot(net))
    return record, float(scaler.get_scale())


@cache
def reference(model: str, precision: str, sizes: tuple[int, ...], device: str) -> Record:
    """The plain loop of `zoo.reference` on `device` (evaluated in fp32 only, as the cells are)."""
    if precision == "fp16":
        return fp16_reference(model, sizes, device)[0]
    case = zoo.MODELS[model]
    evaluate = eval_batch(case, rows=EVAL_ROWS) if precision == "fp32" else None
    return run_reference(case, global_batches(case, 0, sizes), precision=precision, device=device,
                         dropout=_dropout_rule(case), evaluate=evaluate)


def _tolerance(cell: GpuCell) -> zoo.Tolerance:
    """fp16 is held to the bf16 tolerance: both sides run the same float16 kernels, which are finer than bf16's."""
    return zoo.MODELS[cell.model].tolerances["fp32" if cell.precision == "fp32" else "bf16"]


def _untrained(record: Record) -> bool:
    last = record.weights[-1]
    return all(torch.equal(last[k], v) for k, v in record.initial.items() if v.is_floating_point())


def compare(cell: GpuCell, results: list[dict[str, Any]], sizes: tuple[int, ...] = SIZES,
            device: str = DEVICE) -> list[str]:
    """Where a cell's ranks leave the reference: losses, weights, evaluation, lost weights; that the products
    ran in the cell's precision; for bf16 that it is not float32 in disguise; for fp16 that the GradScaler
    skipped and rescaled exactly as the reference's did."""
    want = reference(cell.model, cell.precision, sizes, device)
    tol = _tolerance(cell)
    problems: list[str] = []
    for r in results:
        tag = f"rank {r['rank']}"
        problems += [f"{tag}: {p}" for p in mismatches(r["losses"], r["weights"], want, tol)]
        evaluated = r["eval_loss"] is not None and want.eval_loss is not None
        if evaluated and not abs(r["eval_loss"] - want.eval_loss) <= tol.loss:
            problems.append(f"{tag}: evaluation loss {r['eval_loss']:.6g} vs reference {want.eval_loss:.6g}")
        dtype = str(COMPUTE_DTYPE[cell.precision])
        if r["dtype"] is not None and r["dtype"] != dtype:
            problems.append(f"{tag}: the first layer computed in {r['dtype']}, not {dtype}")
        if (r["scale"] is not None) != (cell.precision == "fp16"):
            problems.append(f"{tag}: GradScaler scale {r['scale']} (a scaler belongs to fp16 only)")
    held = set().union(*(r["weights"][-1].keys() for r in results))
    lost = sorted(set(want.weights[-1]) - held)
    if lost:
        problems.append(f"no rank holds {lost}")
    if cell.precision == "bf16":
        fp32 = reference(cell.model, "fp32", sizes, device).weights[-1]
        common = {k: v for k, v in results[0]["weights"][-1].items() if k in fp32}
        if max_diff(common, fp32) <= AUTOCAST_FLOOR:
            problems.append(f"bf16 weights are within {AUTOCAST_FLOOR:g} of the float32 reference's: autocast did "
                            "not run")
    if cell.precision == "fp16":
        _, scale = fp16_reference(cell.model, sizes, device)
        problems += [f"rank {r['rank']}: GradScaler scale {r['scale']} after the last step, reference {scale}"
                     for r in results if r["scale"] != scale]
        if _untrained(want):
            problems.append("the fp16 reference skipped every step (non-finite gradients): the cell tests nothing")
    return problems


Extra = Callable[[GpuCell, list[dict[str, Any]]], list[str]]


def verdicts(cells: list[GpuCell], outcomes: list[dict[str, Any]], sizes: tuple[int, ...] = SIZES,
             refused: dict[GpuCell, str] | None = None, extra: Extra | None = None, device: str = DEVICE) -> list[str]:
    """One line per cell that failed: raised, refused unexpectedly (or trained where a refusal was expected),
    or left the reference; `extra` adds a test's own checks of the results."""
    failures = []
    for cell in cells:
        got = [o[cell.label] for o in outcomes]
        kinds = {kind for kind, _ in got}
        expected = (refused or {}).get(cell)
        if "error" in kinds:
            failures.append(f"{cell.label}: raised\n{next(v for k, v in got if k == 'error')[-2500:]}")
        elif "refused" in kinds:
            message = next(v for k, v in got if k == "refused")
            if expected is None or expected not in message:
                failures.append(f"{cell.label}: refused ({message[:400]}); expected {expected or 'to train'!r}")
        elif expected is not None:
            failures.append(f"{cell.label}: trained, but the refusal {expected!r} was expected")
        else:
            results = [v for _, v in got]
            problems = compare(cell, results, sizes, device) + (extra(cell, results) if extra else [])
            if problems:
                failures.append(f"{cell.label}: " + "; ".join(problems[:4]))
    return failures


def _on_gpu(cell: GpuCell, results: list[dict[str, Any]]) -> list[str]:
    return [f"rank {r['rank']} trained on {r['device']}" for r in results if not r["device"].startswith("cuda")]


def _nccl(world: int) -> Extra:
    def check(cell: GpuCell, results: list[dict[str, Any]]) -> list[str]:
        return _on_gpu(cell, results) + [f"rank {r['rank']}: backend {r['backend']!r}, world size {r['world']} "
                                         f"(expected nccl, {world})"
                                         for r in results if (r["backend"], r["world"]) != ("nccl", world)]

    return check


def _report(failures: list[str], cells: list[GpuCell]) -> str:
    return f"{len(failures)} of {len(cells)} cells:\n" + "\n".join(failures)


# -- the tests ------------------------------------------------------------------------------------------------------


@pytest.mark.timeout(240)
def test_single_trains_every_model_like_plain_pytorch_on_the_gpu() -> None:
    cells = [GpuCell(m, "single") for m in MODELS]
    failures = verdicts(cells, [run_cells(cells)], extra=_on_gpu)
    assert not failures, _report(failures, cells)


@pytest.mark.timeout(300)
def test_ddp_over_nccl_at_world_size_1_matches_plain_pytorch(monkeypatch: pytest.MonkeyPatch) -> None:
    """DDP's reducer on the GPU (nccl, one worker), the zoo in fp32, and autocast/GradScaler under DDP."""
    cells = [GpuCell(m, "ddp") for m in MODELS]
    cells += [GpuCell(m, "ddp", "bf16") for m in ("gpt", "llama", "mlp")]
    cells += [GpuCell(m, "ddp", "fp16") for m in ("gpt", "mlp")]
    failures = verdicts(cells, launch_cells(monkeypatch, cells, nproc=1), extra=_nccl(1))
    assert not failures, _report(failures, cells)


@pytest.mark.timeout(300)
def test_fsdp_over_nccl_at_world_size_1_matches_plain_pytorch(monkeypatch: pytest.MonkeyPatch) -> None:
    """FSDP2 on the GPU (nccl, one worker): every parameter a DTensor, the zoo in fp32, and bf16 (FSDP's
    mixed-precision policy under autocast) against plain autocast."""
    def sharded(cell: GpuCell, results: list[dict[str, Any]]) -> list[str]:
        return _nccl(1)(cell, results) + [f"rank {r['rank']}: not every parameter is a DTensor (not sharded by FSDP2)"
                                          for r in results if not r["sharded"]]

    cells = [GpuCell(m, "fsdp") for m in MODELS] + [GpuCell(m, "fsdp", "bf16") for m in ("gpt", "llama", "mlp")]
    failures = verdicts(cells, launch_cells(monkeypatch, cells, nproc=1), extra=sharded)
    assert not failures, _report(failures, cells)


@pytest.mark.timeout(240)
def test_mp_with_both_stages_on_one_gpu_matches_plain_pytorch() -> None:
    """`mp` on one GPU (devices=["cuda:0", "cuda:0"]), four micro-batches pipelined through both stages; BatchNorm
    models at one micro-batch (over several they are refused by name, device-independent: the CPU matrix checks
    that). M=1 elsewhere adds little here: tracing the models costs host time that the CPU matrix already spends."""
    def one_gpu(cell: GpuCell, results: list[dict[str, Any]]) -> list[str]:
        return [f"stages on {r['devices']}" for r in results if r["devices"] != ["cuda:0", "cuda:0"]]

    cells = [GpuCell(m, "mp", microbatches=1 if zoo.MODELS[m].has(zoo.case.BATCHNORM) else 4) for m in MODELS]
    failures = verdicts(cells, [run_cells(cells)], extra=one_gpu)
    assert not failures, _report(failures, cells)


@pytest.mark.timeout(240)
def test_bf16_and_fp16_match_plain_autocast_and_grad_scaler() -> None:
    """setup(precision="bf16") against torch.autocast(bfloat16), and "16" against autocast(float16) with
    torch.amp.GradScaler: same losses and weights, the products in the low dtype, bf16 weights farther than
    AUTOCAST_FLOOR from float32's, and the scaler's scale equal to the plain loop's after the last step."""
    cells = [GpuCell(m, "single", "bf16") for m in BF16_MODELS] + [GpuCell(m, "single", "fp16") for m in FP16_MODELS]
    failures = verdicts(cells, [run_cells(cells)], extra=_on_gpu)
    assert not failures, _report(failures, cells)


@pytest.mark.timeout(120)
def test_bf16_and_fp16_keep_hugging_face_model_outputs() -> None:
    """The same checks on transformers models, whose forward returns a ModelOutput the loss reads by attribute."""
    cells = [GpuCell(m, "single", p) for m in HF_MODELS for p in ("bf16", "fp16")]
    failures = verdicts(cells, [run_cells(cells)], extra=_on_gpu)
    assert not failures, _report(failures, cells)


@pytest.mark.timeout(240)
def test_ddp_batchnorm_on_gpus_is_exact(monkeypatch: pytest.MonkeyPatch) -> None:
    """paratrain turns BatchNorm into SyncBatchNorm for data-parallel CUDA workers (parallel/batchnorm.py), and
    only when there are several: one worker's statistics are already the global batch's. So with one GPU the
    conversion itself is checked on a CUDA device directly, ddp keeps plain BatchNorm and trains exactly, and a
    model the user converted to SyncBatchNorm trains exactly too; with two GPUs the two workers' BatchNorm
    layers are SyncBatchNorm and match one process on the whole batch."""
    from paratrain.parallel.batchnorm import for_replicas

    converted = for_replicas(zoo.MODELS["cnn_bn"].build(0), "exact", torch.device("cuda", 0), 2, True, "ddp")
    assert {type(m) for m in converted.modules() if isinstance(m, BN_TYPES)} == {nn.SyncBatchNorm}

    nproc = min(2, torch.cuda.device_count())
    cells = [GpuCell("cnn_bn", "ddp"), GpuCell("cnn_bn", "ddp", sync_bn=True)]
    norms = {cells[0]: ["SyncBatchNorm" if nproc > 1 else "BatchNorm2d"], cells[1]: ["SyncBatchNorm"]}

    def layers(cell: GpuCell, results: list[dict[str, Any]]) -> list[str]:
        return _nccl(nproc)(cell, results) + [f"rank {r['rank']}: BatchNorm layers are {r['norms']}, expected "
                                              f"{norms[cell]}" for r in results if r["norms"] != norms[cell]]

    failures = verdicts(cells, launch_cells(monkeypatch, cells, nproc), extra=layers)
    assert not failures, _report(failures, cells)


def _compiled(build: Callable[[int], nn.Module]) -> Callable[[int], nn.Module]:
    return lambda seed: torch.compile(build(seed))  # type: ignore[return-value]


def compiled_runs(models: tuple[str, ...], sizes: tuple[int, ...], device: str) -> dict[str, Any]:
    """In one worker: per model, the plain loop on `torch.compile(model)`, then paratrain's `single` with the
    user's compiled model, and how many graphs dynamo compiled for each (a recompilation every step shows here)."""
    from torch._dynamo.utils import counters

    out: dict[str, Any] = {}
    for name in models:
        case = zoo.MODELS[name]
        try:
            before = counters["stats"]["unique_graphs"]
            plain = run_reference(dataclasses.replace(case, build=_compiled(case.build)),
                                  global_batches(case, 0, sizes), device=device)
            want = Record(losses=plain.losses, initial=_plain_names(plain.initial),
                          weights=[_plain_names(w) for w in plain.weights])
            middle = counters["stats"]["unique_graphs"]
        except Exception:
            out[name] = ("error", traceback.format_exc())
            continue
        cell = GpuCell(name, "single", compiled=True)
        got = run_cells([cell], sizes, device)[cell.label]
        graphs = {"plain": middle - before, "paratrain": counters["stats"]["unique_graphs"] - middle}
        out[name] = ("ok", {"reference": want, "paratrain": got, "graphs": graphs})
    return out


def _compiler_missing() -> str | None:
    """Why torch.compile cannot build GPU kernels here, if it cannot: Triton compiles a small C launcher per
    kernel, which needs a C compiler and Python's headers (a machine problem, not paratrain's)."""
    compilers = [c for c in (os.environ.get("CC"), "cc", "gcc", "clang") if c]
    if not any(shutil.which(c) for c in compilers):
        return "torch.compile's Triton kernels need a C compiler (cc, gcc or clang) on PATH; none is there"
    header = Path(sysconfig.get_paths()["include"]) / "Python.h"
    if not header.exists():
        return f"torch.compile's Triton kernels need Python's headers; {header} is missing (install python3-dev)"
    return None


@pytest.mark.timeout(360)
def test_compiled_model_trains_like_plain_pytorch(monkeypatch: pytest.MonkeyPatch) -> None:
    """paratrain has no compile option: a user compiles the model before prepare. Under `single` it must then
    train like the same compiled model in a plain loop and like the eager reference, within the fp32 tolerance.
    Runs in a worker, so inductor's compile processes end with it (the suite fails a test that leaves any)."""
    missing = _compiler_missing()
    if missing:
        pytest.skip(missing)
    monkeypatch.delenv("PARATRAIN_WARM_WORKERS", raising=False)
    out = paratrain.launch(compiled_runs, COMPILE_MODELS, COMPILE_SIZES, DEVICE, nproc=1, accelerator="cuda",
                           timeout=330)
    failures, recompiled = [], []
    for name in COMPILE_MODELS:
        kind, value = out[name]
        if kind != "ok":
            failures.append(f"{name}: the plain compiled loop raised\n{value[-2500:]}")
            continue
        kind, got = value["paratrain"]
        if kind != "ok":
            failures.append(f"{name}: paratrain with the compiled model {kind}\n{got[-2500:]}")
            continue
        tol = zoo.MODELS[name].tolerances["fp32"]
        eager = reference(name, "fp32", COMPILE_SIZES, DEVICE)
        for what, want in (("the plain compiled loop", value["reference"]), ("the eager reference", eager)):
            problems = mismatches(got["losses"], got["weights"], want, tol)
            if problems:
                failures.append(f"{name} vs {what} (dynamo graphs {value['graphs']}): " + "; ".join(problems[:4]))
        graphs = value["graphs"]
        _save_for_docs("compile", name, {"dynamo_graphs": graphs, "steps": len(COMPILE_SIZES)})
        if graphs["paratrain"] > max(1, graphs["plain"]):
            recompiled.append(f"{name}: {graphs['paratrain']} graphs in {len(COMPILE_SIZES)} steps "
                              f"(the plain loop: {graphs['plain']})")
    assert not failures, "\n".join(failures)
    # past dynamo's recompile limit (8) a model that recompiles every step silently runs eager; paratrain's
    # dropout once made dynamo guard on the micro-step counter even at p=0
    assert not recompiled, "; ".join(recompiled)


# -- the gpt bench: tokens/s and MFU on this GPU ------------------------------------------------------------------


def _save_for_docs(section: str, key: str, value: Any) -> None:
    """Merge `value` into the JSON file named by PARATRAIN_GPU_RESULTS, if set, for the person who runs the tier
    to copy into the docs (docs/benchmarks.md, section G); nothing is written otherwise."""
    path = os.environ.get("PARATRAIN_GPU_RESULTS")
    if not path:
        return
    file = Path(path)
    data = json.loads(file.read_text()) if file.exists() and file.stat().st_size else {}
    data.setdefault(section, {})[key] = {"created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **value}
    file.parent.mkdir(parents=True, exist_ok=True)
    file.write_text(json.dumps(data, indent=1) + "\n")


BENCH_RUNS = {"single", "ddp", "torch-ddp", "no-comm"}
"""What `--strategies single,ddp --workers 1` measures: paratrain's single and ddp, the hand-written DDP loop,
and `no-comm`, which on one worker is the hand-written plain loop (no DDP, nothing exchanged)."""


@pytest.mark.timeout(420)
@pytest.mark.parametrize("precision", ["32", "bf16"])
def test_gpt_bench_measures_tokens_per_s_and_mfu(precision: str, tmp_path: Path) -> None:
    """`paratrain bench --workload gpt` (GPT-2 small, 8 x 1024 tokens) on this GPU: paratrain's single and ddp
    beside hand-written loops on the same GPU, each with positive tokens/s and an MFU in (0, 1) against the
    datasheet peak in bench/mfu.py. No timing is asserted; the numbers go to PARATRAIN_GPU_RESULTS if set."""
    from paratrain.bench import schema
    from paratrain.measure import gpt

    out = tmp_path / "bench"
    args = ["bench", "--workload", "gpt", "--gpt-size", "gpt2", "--strategies", "single,ddp", "--workers", "1",
            "--precision", precision, "--timeout", "300", "--out", str(out)]
    proc = helpers.paratrain(*args, timeout=400)
    assert proc.returncode == 0, proc.stdout[-4000:]
    results = json.loads((out / "results.json").read_text())
    schema.validate(results)
    peak = results["machine"]["peak"]
    assert peak["flops_per_s"], f"no MFU: {peak['source']}"
    assert peak["dtype"] == ("bf16" if precision == "bf16" else "fp32"), peak
    cfg = gpt.SIZES["gpt2"]
    assert results["workload"]["flops_per_step"] == gpt.flops_per_token(cfg) * results["global_batch"] * cfg.seq
    runs = {r["strategy"]: r for r in results["runs"]}
    assert set(runs) == BENCH_RUNS and all(r["workers"] == 1 for r in runs.values()), sorted(runs)
    for name, run in runs.items():
        assert run["status"] == "ok", run
        assert run["tokens_per_s"] > 0 and 0 < run["mfu"] < 1, (name, run["tokens_per_s"], run["mfu"])
        assert run["tokens_per_s"] == pytest.approx(run["samples_per_s"] * cfg.seq, rel=1e-3)
    numbers = {name: {k: run[k] for k in ("median_step_s", "spread_s", "samples_per_s", "tokens_per_s", "mfu",
                                          "peak_memory_mb", "vs_reference")} for name, run in runs.items()}
    _save_for_docs("gpt_bench", {"32": "fp32"}.get(precision, precision), {
        "command": results["command"], "gpus": results["machine"]["gpus"], "torch": results["machine"]["torch"],
        "peak": peak, "flops_per_step": results["workload"]["flops_per_step"], "runs": numbers,
        "single_vs_handwritten": round(runs["single"]["median_step_s"] / runs["no-comm"]["median_step_s"], 4),
        "results_json": results,
    })
