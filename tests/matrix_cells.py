"""The cells of the correctness matrix: every zoo model under every strategy layout, run by the user's
loop through paratrain's public API; `test_matrix.py` compares each with the plain-PyTorch reference.

One layout (a column) runs all its cells in one launch of its workers, one after the other, so worker
start-up is paid once per column. A cell returns what its rank recorded, or the refusal it met.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any

import torch
import trace_cache
import zoo
from torch.utils.data import DataLoader, Dataset
from zoo.reference import Optim, chunk, eval_batch, global_batches, rows, to_device

import paratrain
from paratrain import _forwards
from paratrain.parallel import activation_checkpoint
from paratrain.parallel import compile as compile_blocks

EVAL_ROWS = 6
CLIP = 0.05
"""max_norm of the clipping cells: below every step's gradient norm of the models they run, so they clip."""


@dataclass(frozen=True)
class Layout:
    """One column: a strategy, its workers and options, and the micro-batch counts it is tried with."""

    name: str
    strategy: str
    nproc: int = 1
    options: dict[str, Any] = field(default_factory=dict)
    microbatches: tuple[int | None, ...] = (None,)
    models: tuple[str, ...] | None = None
    """The zoo models this column runs (None: every one); tensor parallelism is for the transformers."""
    extras: tuple[str, ...] = ("clip", "loop", "ac")
    """The feature cells the column adds to its plain ones (`clip`, `loop`, activation checkpointing `ac`)."""
    sizes: tuple[int, ...] = (8, 8, 4)
    """Rows of the global batches: two full ones and a short last one (an epoch's tail). Data-parallel layouts
    end on one that does not split evenly over the replicas; pipelines split a batch into equal micro-batches."""


UNEVEN = (8, 8, 5)
"""A last batch of 5 rows: 3 and 2 over two replicas."""
PINNED = {"balance": "equal"}
"""Pipeline cuts are pinned (equal layer counts), so a cell cannot pass or fail by where a timing put the cut;
balance="time" is tested on its own (test_partition.py, test_pp.py)."""

TRANSFORMERS = ("gpt", "llama", "hf_gpt2", "hf_llama")
"""The zoo's decoders, the models tensor parallelism is for."""

LAYOUTS = [
    Layout("single", "single", sizes=UNEVEN),
    Layout("ddp", "ddp", 2, sizes=UNEVEN),
    Layout("fsdp", "fsdp", 2, sizes=UNEVEN),
    Layout("mp", "mp", 1, {"devices": ["cpu", "cpu"], **PINNED}, (1, 4)),
    Layout("pp-gpipe", "pp", 2, {"schedule": "gpipe", **PINNED}, (1, 4)),
    Layout("pp-1f1b", "pp", 2, {"schedule": "1f1b", **PINNED}, (1, 4)),
    # one micro-batch is split off before any schedule runs: tried with gpipe and mp, not again with every
    # schedule and composition (interleaved, zero-bubble, ddp+pp and ddp+mp run at M=4, where they differ)
    Layout("pp-interleaved", "pp", 2, {"schedule": "interleaved-1f1b", "stages_per_worker": 2, **PINNED}, (4,)),
    Layout("pp-zero-bubble", "pp", 2, {"schedule": "zero-bubble", "stages_per_worker": 2, **PINNED}, (4,)),
    Layout("ddp+pp", "ddp+pp", 4, {"schedule": "gpipe", **PINNED}, (4,), sizes=(16, 16, 8)),
    Layout("ddp+mp", "ddp+mp", 2, {"devices_per_worker": 2, **PINNED}, (4,), sizes=UNEVEN),
    Layout("tp", "tp", 2, models=TRANSFORMERS, sizes=UNEVEN),
    Layout("fsdp+tp", "fsdp+tp", 4, {"tp_size": 2}, models=TRANSFORMERS, sizes=UNEVEN),
    Layout("ddp+tp", "ddp+tp", 4, {"tp_size": 2}, models=TRANSFORMERS, sizes=UNEVEN),
    # pipelines of tensor-parallel stages; the transformers tensor parallelism refuses are refused before any
    # pipeline is built (the tp column holds them), so the column trains the one it shards
    # FSDP over pipeline stages (split, then each stage one FSDP2 unit over the replicas that hold it): the
    # transformers large-model training runs this way, GPT's head tied to its embedding across the two stages
    Layout("fsdp+pp", "fsdp+pp", 4, {"schedule": "1f1b", **PINNED}, (4,), models=("gpt", "llama", "hf_llama"),
           sizes=(16, 16, 8)),
    # the three axes on one mesh, 8 workers on this machine's cores: the plain cell and the global-norm clip only
    # (the loop and recomputation cells of the fsdp+pp and tp+pp columns cover what this one would add)
    Layout("fsdp+tp+pp", "fsdp+tp+pp", 8, {"tp_size": 2, "schedule": "1f1b", **PINNED}, (2,), models=("hf_llama",),
           extras=("clip",), sizes=(16, 16, 8)),
    Layout("tp+pp", "tp+pp", 4, {"tp_size": 2, "schedule": "1f1b", **PINNED}, (2,), models=("hf_llama",)),
]
BY_NAME = {layout.name: layout for layout in LAYOUTS}


LOOP_ACCUM = 2
LOOP_OPTIM = Optim(name="adamw", lr=1e-3, weight_decay=0.01)
"""The loop cells (`loop`): the training loop of a language-model fine-tune rather than plain SGD: two accumulation
micro-steps per optimizer step, the embeddings frozen (and a head tied to them), AdamW with weight decay and a
LambdaLR warm-up stepped when `run.sync_step` says the window ended."""


def loop_frozen(name: str) -> bool:
    return "emb" in name


def loop_lr(step: int) -> float:
    return min(1.0, (step + 1) / 2)


def loop_sizes(layout: Layout) -> tuple[int, ...]:
    """Global batches of the loop cells (each an accumulation window of two micro-steps): data-parallel columns end
    on a micro-step of 2 rows (1 per replica), pipelines keep whole micro-batches."""
    return (8, 8, 6) if layout.microbatches == (None,) else (layout.sizes[0],) * 3


COMPILE_BACKEND = "aot_eager"
"""The matrix's compile cells trace and compile every block through torch.compile's graph capture and autograd
(AOTAutograd) without generating kernels: the layouts' part of compiling, exactly, in seconds; inductor's code
generation (tolerance, not bit-exact) is checked in tests/test_compile.py."""


@dataclass(frozen=True)
class Cell:
    model: str
    layout: str
    microbatches: int | None
    precision: str = "fp32"
    clip: bool = False
    """The loop clips the gradients by their norm (run.clip_grad_norm_) before each step."""
    checkpointing: str = "none"
    """setup(activation_checkpointing=...): recomputation must leave every result as it was."""
    compiled: bool = False
    """setup(compile=COMPILE_BACKEND): every block (every layer of a stage) compiled, results as they were."""
    loop: bool = False
    """The fine-tuning loop (LOOP_ACCUM, loop_frozen, LOOP_OPTIM, loop_lr) instead of one SGD step per batch."""

    @property
    def label(self) -> str:
        m = f" M={self.microbatches}" if self.microbatches is not None else ""
        p = " bf16" if self.precision == "bf16" else ""
        ac = f" ac={self.checkpointing}" if self.checkpointing != "none" else ""
        extra = ((" clip" if self.clip else "") + ac + (" compiled" if self.compiled else "")
                 + (" loop" if self.loop else ""))
        return f"{self.model} / {self.layout}{m}{p}{extra}"


def spread(strategy: str, where: list[dict[str, Any]]) -> list[str]:
    """The work was really divided as the layout says: a layout that trained the whole model on every rank
    would match the reference too."""
    problems: list[str] = []
    axes = strategy.split("+")
    if strategy in ("single", "ddp"):
        problems += [f"rank {i} holds {w['local']} of {w['whole']} elements" for i, w in enumerate(where)
                     if w["local"] != w["whole"]]
    if strategy == "fsdp":
        local, whole = [w["local"] for w in where], where[0]["whole"]
        if sum(local) != whole or max(local) >= whole:
            problems.append(f"FSDP ranks hold {local} of {whole} parameter elements: not sharded")
    if "pp" in axes and "fsdp" in axes:  # each stage sharded over the ranks that hold it
        by_stage: dict[tuple[str, ...], list[dict[str, Any]]] = {}
        for w in where:
            by_stage.setdefault(tuple(w["names"]), []).append(w)
        tp = 2 if "tp" in axes else 1  # tensor-parallel ranks of a stage share its unsharded-by-tp elements
        for names, ranks in by_stage.items():
            local, whole, tp_whole = [w["local"] for w in ranks], ranks[0]["whole"], ranks[0]["tp_whole"]
            if len(ranks) < 2 or sum(local) != tp_whole + tp * (whole - tp_whole) or max(local) >= whole:
                problems.append(f"the stage holding {names[0]}..: ranks hold {local} of {whole} elements: not sharded")
    if "pp" in axes:
        held = {tuple(w["names"]) for w in where}
        every = set().union(*held)
        if len(held) != 2 or any(set(names) == every or not names for names in held):
            problems.append(f"pipeline ranks hold {len(held)} distinct parameter sets (want 2 stages, each a part)")
    if "tp" in axes:
        # tensor-sharded weights: 1/tp on each rank, and 1/(dp x tp) under FSDP, which shards the rest too
        parts = 4 if "fsdp" in axes else 2
        for i, w in enumerate(where):
            if not w["tp_whole"] or w["tp_local"] * parts != w["tp_whole"]:
                problems.append(f"rank {i} holds {w['tp_local']} of {w['tp_whole']} tensor-sharded elements "
                                f"(want 1/{parts})")
            rest_local, rest_whole = w["local"] - w["tp_local"], w["whole"] - w["tp_whole"]
            if "fsdp" in axes and not rest_local < rest_whole:
                problems.append(f"rank {i} holds {rest_local} of {rest_whole} other elements: not sharded")
    if strategy in ("mp", "ddp+mp"):
        for i, w in enumerate(where):
            if w["stage_params"] is None or len(w["stage_params"]) != 2 or 0 in w["stage_params"]:
                problems.append(f"rank {i}: stages hold {w['stage_params']} parameter elements (want 2 stages)")
    return problems


def full_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """state_dict copies, whole tensors even where FSDP keeps DTensor shards (collective there)."""
    out = {}
    for key, value in model.state_dict().items():
        whole = getattr(value, "full_tensor", None)
        out[key] = (whole() if whole is not None else value).detach().float().cpu().clone()
    return out


class _Rows(Dataset[tuple[Any, Any]]):
    """The global batches as one sequence of rows, in order, for the user's DataLoader: paratrain's loader cuts
    it back into the same global batches and gives each replica its share, a short last batch unevenly (5 rows
    over 2 replicas: 3 and 2, each rank's loss weighted by its rows), as in the README's loop."""

    def __init__(self, batches: list[tuple[Any, Any]]) -> None:
        self.inputs, self.targets = (_cat([b[i] for b in batches]) for i in (0, 1))

    def __len__(self) -> int:
        return rows(self.inputs)

    def __getitem__(self, i: int) -> tuple[Any, Any]:
        return _row(self.inputs, i), _row(self.targets, i)


def _cat(values: list[Any]) -> Any:
    if isinstance(values[0], dict):
        return {k: torch.cat([v[k] for v in values]) for k in values[0]}
    return torch.cat(values)


def _row(value: Any, i: int) -> Any:
    return {k: v[i] for k, v in value.items()} if isinstance(value, dict) else value[i]


def placement(run: paratrain.Run, prepared: torch.nn.Module) -> dict[str, Any]:
    """Where this rank's parameters live: the names it holds, its local elements against the whole tensors'
    (an FSDP shard holds a part), and the parameters of each stage when one process drives several."""
    held = run.unwrap(prepared)
    local = whole = tp_local = tp_whole = 0
    for param in held.parameters():
        mine = param.to_local().numel() if hasattr(param, "to_local") else param.numel()
        whole += param.numel()
        local += mine
        names = getattr(getattr(param, "device_mesh", None), "mesh_dim_names", None) or ()
        if "tp" in names and param.placements[names.index("tp")].is_shard():
            tp_local, tp_whole = tp_local + mine, tp_whole + param.numel()
    inner = getattr(prepared, "module", prepared)  # ddp+mp: DDP around the one-process pipeline
    stages = getattr(inner, "stages", None)
    return {"names": sorted(name for name, _ in held.named_parameters()), "local": local, "whole": whole,
            "tp_local": tp_local, "tp_whole": tp_whole,
            "stage_params": [sum(p.numel() for p in s.parameters()) for s in stages] if stages else None}


def _units(run: paratrain.Run, prepared: torch.nn.Module) -> list[torch.nn.Module]:
    """What activation checkpointing and compile apply to: the blocks, or the layers of this rank's stages."""
    units = (activation_checkpoint.stages(prepared) if run.strategy.microbatched
             else activation_checkpoint.blocks(run.unwrap(prepared)))
    return [unit for _, unit in units]


def checkpointed(run: paratrain.Run, prepared: torch.nn.Module) -> tuple[int, int]:
    """(units whose forward runs under activation checkpointing, units)."""
    units = _units(run, prepared)
    return sum(activation_checkpoint.REASON in _forwards.replaced(u) for u in units), len(units)


def compiled_units(run: paratrain.Run, prepared: torch.nn.Module) -> tuple[int, int]:
    """(units that run compiled, units)."""
    units = _units(run, prepared)
    return sum(compile_blocks.is_compiled(u) for u in units), len(units)


def frames_given_up() -> int:
    """Frames dynamo gave up compiling in this process so far (past its recompile limit they run eagerly):
    a compiled cell whose blocks silently ran eagerly would match the reference too."""
    import sys

    if "torch._dynamo" not in sys.modules:
        return 0
    from torch._dynamo.utils import counters

    return int(counters["frames"]["total"] - counters["frames"]["ok"])


def run_cell(cell: Cell) -> dict[str, Any]:
    """The user's loop on one cell: losses and weights after every step, then an evaluation pass."""
    layout = BY_NAME[cell.layout]
    case = zoo.MODELS[cell.model]
    options = dict(layout.options)
    if cell.microbatches is not None:
        options["microbatches"] = cell.microbatches
    if cell.checkpointing != "none":
        options["activation_checkpointing"] = cell.checkpointing
    if cell.compiled:
        options["compile"] = COMPILE_BACKEND
    if cell.loop:
        options["grad_accum"] = LOOP_ACCUM
    gave_up = frames_given_up()
    run = paratrain.setup(strategy=layout.strategy, seed=0, precision={"fp32": "32", "bf16": "bf16"}[cell.precision],
                          timeout_s=120,
                          accelerator="cpu", **options)
    try:
        replica, replicas = run.strategy.data_shard(run.ctx)
        sizes = loop_sizes(layout) if cell.loop else layout.sizes
        batches = global_batches(case, 0, sizes)
        model = case.build(0)
        for name, param in model.named_parameters():
            if cell.loop and loop_frozen(name):
                param.requires_grad_(False)  # what the model froze itself (LoRA's base weights) stays frozen
        optim = LOOP_OPTIM if cell.loop else Optim()
        optimizer = optim.make([p for p in model.parameters() if p.requires_grad], case)
        mine = chunk(batches[0][0], replicas * (LOOP_ACCUM if cell.loop else 1))[replica]
        with trace_cache.for_case(cell.model):
            model, optimizer = run.prepare(model, optimizer, example=to_device(mine, run.device))
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, loop_lr) if cell.loop else None
        slow = case.has(zoo.case.SLOW)
        losses, weights = [], []
        per_worker = run.per_worker_batch(sizes[0])
        loader = run.prepare_loader(DataLoader(_Rows(batches), batch_size=per_worker))
        left, summed, counted = sum(sizes), 0.0, 0  # the window's loss: its micro-steps' losses weighted by rows
        for inputs, targets in loader:
            inputs, targets = to_device(inputs, run.device), to_device(targets, run.device)
            micro_rows = min(per_worker * replicas, left)
            left -= micro_rows
            summed += float(run.forward_backward(model, inputs, targets, case.loss_fn)) * micro_rows
            counted += micro_rows
            if cell.clip:
                run.clip_grad_norm_(model, CLIP)
            optimizer.step()
            optimizer.zero_grad()
            if not run.sync_step:
                continue
            if schedule is not None:
                schedule.step()
            losses.append(summed / counted)
            summed, counted = 0.0, 0
            if not slow or len(losses) == len(batches):
                weights.append(full_state(run.unwrap(model)))
        result: dict[str, Any] = {"losses": losses, "weights": weights, "rank": run.rank, "eval_loss": None,
                                  "where": placement(run, model), "checkpointed": checkpointed(run, model),
                                  "compiled": (*compiled_units(run, model), frames_given_up() - gave_up)}
        if cell.microbatches in (None, 1) and cell.precision == "fp32":
            x, y = eval_batch(case, rows=EVAL_ROWS)
            x, y = (to_device(chunk(v, replicas)[replica], run.device) for v in (x, y))
            result["eval_loss"] = float(run.evaluate(model, x, y, case.loss_fn))
        return result
    finally:
        run.close()


def run_column(cells: list[Cell]) -> dict[str, Any]:
    """Every cell of one column in these workers: its result, or ("refused", message) for a ParatrainError.
    A refusal is raised on every rank alike, so the ranks stay in step for the next cell."""
    out: dict[str, Any] = {}
    for cell in cells:
        try:
            out[cell.label] = ("ok", run_cell(cell))
        except paratrain.ParatrainError as exc:
            out[cell.label] = ("refused", str(exc))
            print(f"{cell.label}: refused: {str(exc)[:300]}", file=sys.stderr)  # shown if the ranks disagree
    return out
