"""The check that makes tensor parallelism safe: a sharded block must compute what the whole block computed.

A plan is only names and styles; whether a block's forward survives holding 1/tp of its heads is a property of its
code: `view(b, t, self.heads, d)` with the full head count fails, `view(b, t, self.heads, -1)` runs and silently
computes attention over the wrong head width, a fused projection may pack q, k and v one after another or interleave
them per head. So `prepare` runs the example batch once through the whole model in eval mode and keeps, for the
first block of each kind (each class holding planned layers), the inputs it was given. Each way of sharding that
block (a fused projection packed or interleaved; the block's size attributes whole or this rank's share:
`local_sizes`) is tried on a copy of it fed a copy of those inputs — a key/value cache included, so no cache is ever
fed twice; a block holding only the row-split half of a pair (BERT's `output`) this rank's slice of its first — and
the first way whose output and gradients equal the whole block's is kept, the same on every rank.
The copies carry weights of a trained model's size: at initialisation attention is nearly uniform, and heads grouped
wrongly would differ by less than float noise. Outputs split over the ranks (eager attention's per-head weights,
T5's position bias) are compared with this rank's slice of the whole one. A block no way makes exact is refused with
what failed: the line of its forward that raised, or by how much its output differs.
"""

from __future__ import annotations

import copy
import itertools
import linecache
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import torch
from torch import nn

from ... import _forwards
from ..._tree import tensors_in
from ...errors import ParatrainError
from ...weights.streamed import real_copy, streamed
from . import local_sizes
from .plan import FUSED

_TOLERANCE = {torch.float32: 1e-4, torch.float64: 1e-9}


def copied(value: Any) -> Any:
    """A deep copy of a block's input (tensors, a key/value cache), or the value itself where it cannot be copied."""
    try:
        return copy.deepcopy(value)
    except Exception:
        return value


@dataclass
class Seen:
    """A block's inputs (copied before it ran) and its output, from the whole model's forward."""

    args: Any = None
    kwargs: Any = None
    output: Any = None


def capture(model: nn.Module, blocks: list[str], example: Any) -> tuple[dict[str, Seen], Any]:
    """One no-grad, eval-mode forward of the whole model: each block's inputs (copied before it runs: a cache it
    updates is copied as it was) and output, and the model's output."""
    seen = {name: Seen() for name in blocks}
    modules = [model.get_submodule(name) for name in blocks]
    for module, s in zip(modules, seen.values(), strict=True):
        _forwards.replace(module, _recording(module.forward, s), REASON)
    try:
        with _eval(model), torch.no_grad(), streamed(model):
            out = model(example)
    finally:
        for module in modules:
            _forwards.restore(module)
    return seen, out


REASON = "the tensor-parallel check (one forward)"


def _recording(forward: Callable[..., Any], seen: Seen) -> Callable[..., Any]:
    def record(*args: Any, **kwargs: Any) -> Any:
        first = seen.args is None
        if first:
            seen.args, seen.kwargs = copied(args), copied(kwargs)
        out = forward(*args, **kwargs)
        if first:
            seen.output = copied(out)
        return out

    return record


class _eval:
    """The model in eval mode inside (no dropout draws), its modes restored afterwards."""

    training = False

    def __init__(self, model: nn.Module) -> None:
        self.model, self.modes = model, {m: m.training for m in model.modules()}

    def __enter__(self) -> None:
        self.model.train(self.training)

    def __exit__(self, *exc: object) -> None:
        for module, mode in self.modes.items():
            module.training = mode


class _train(_eval):
    """The model in training mode inside, its modes restored afterwards."""

    training = True


@dataclass(frozen=True)
class Way:
    """One way to shard a block: the style of its fused projections and whether its size attributes are set to
    this rank's share."""

    fused: str = "packed_colwise"
    local_sizes: bool = False


@dataclass
class Choice:
    """What the check settled for one kind of block."""

    way: Way
    sizes: dict[str, tuple[int, int]] = field(default_factory=dict)
    partial: list[str] = field(default_factory=list)
    """Whole parameters (names inside the block) whose gradients the tensor ranks sum."""


def ways(fused: bool, has_sizes: bool) -> list[Way]:
    """The ways worth trying, in order of preference: a fused projection packed (q, then k, then v) before
    interleaved; size attributes at the rank's share before the block as written. Where both pass the first block
    of a kind, the share is what other blocks of the kind may need (T5's cross-attention builds its zero position
    bias of `self.n_heads` heads, where the first self-attention has a sharded bias table)."""
    styles = ("packed_colwise", "colwise") if fused else ("packed_colwise",)
    return [Way(f, s) for f, s in itertools.product(styles, (True, False) if has_sizes else (False,))]


Shard = Callable[[nn.Module, dict[str, str]], None]
"""shard(module, {name inside it: style}): applies the styles to a module in place."""


def choose(model: nn.Module, plan: dict[str, str], seen: dict[str, Seen], tp: int, rank: int, group: Any,
           shard: Shard, agree: Callable[[list[bool]], list[bool]]) -> dict[str, Choice]:
    """For each checked block, the first way that computes the whole block's output, and the whole parameters whose
    gradients the ranks must sum (the same on every rank)."""
    chosen: dict[str, Choice] = {}
    for name, s in seen.items():
        block = model.get_submodule(name)
        inside = _inside(plan, name)
        sizes = local_sizes.sizes(block, tp)
        options = ways(FUSED in inside.values(), bool(sizes))
        base, args = _trained_like(block), _unit(s.args)
        with _eval(base), torch.no_grad():
            whole = Seen(args, s.kwargs, base(*copied(args), **copied(s.kwargs)))
        fed = _fed(whole, base, inside, rank, tp)
        tried = [_try(base, inside, way, sizes, fed, tp, rank, shard) for way in options]
        passed = agree([why is None for why, _ in tried])
        pick = next((i for i, ok in enumerate(passed) if ok), None)
        if pick is None:  # what the code as written does (its sizes whole) says what to change
            written = next(i for i, way in enumerate(options) if not way.local_sizes)
            raise refusal(name, plan, tried[written][0] or "another rank's sharded block differs from the whole one")
        partial = _partial_gradients(name, plan, base, tried[pick][1], whole, fed, tp, rank, group, agree)
        chosen[name] = Choice(options[pick], sizes if options[pick].local_sizes else {}, partial)
    return chosen


def _fed(whole: Seen, block: nn.Module, inside: dict[str, str], rank: int, tp: int) -> Seen:
    """What the sharded block is fed: the whole block's inputs, except where its planned layers are all row-split
    Linears and its first input is as wide as theirs (BERT's `output`, whose `dense` takes the split output of the
    `intermediate` beside it): that input arrives split, so the block takes this rank's slice of it."""
    layers = [block.get_submodule(n) for n in inside]
    first = whole.args[0] if isinstance(whole.args, tuple) and whole.args else None
    if (not layers or set(inside.values()) != {"rowwise"} or not isinstance(first, torch.Tensor)
            or not first.is_floating_point() or first.dim() == 0 or first.shape[-1] % tp
            or any(type(m) is not nn.Linear or m.in_features != first.shape[-1] for m in layers)):
        return whole
    width = first.shape[-1] // tp
    return Seen((first.narrow(-1, rank * width, width), *whole.args[1:]), whole.kwargs, whole.output)


def _unit(args: Any) -> Any:
    """The block's inputs with its first (the hidden states) at unit size: a post-norm block fed an initialised
    embedding's tiny values would attend nearly uniformly whatever its weights."""
    first = args[0] if isinstance(args, tuple) and args else None
    if not isinstance(first, torch.Tensor) or not first.is_floating_point() or first.numel() < 2:
        return args
    spread = float(first.float().std())
    return (first / spread, *args[1:]) if spread > 0 else args


def _trained_like(block: nn.Module) -> nn.Module:
    """A copy of the block with weights of a trained model's size (Kaiming-scaled, the same on every rank), running
    its classes' forwards. At initialisation attention is nearly uniform, so heads grouped wrongly would change the
    output by less than float noise; sharding is exact for any weights, so the check may choose them."""
    copy_ = real_copy(block) or copy.deepcopy(block)  # a block built on the meta device: its values made real
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for module in copy_.modules():
            _forwards.strip(module)  # a copied replacement may point at the original
        for _, param in sorted(copy_.named_parameters()):
            if param.dim() >= 2 and param.is_floating_point():
                drawn = torch.randn(param.shape, generator=generator, dtype=torch.float64) / param.shape[-1] ** 0.5
                param.copy_(drawn.to(param.dtype))
    return copy_


def _gradients(module: nn.Module, seen: Seen, rank: int, tp: int) -> dict[str, torch.Tensor]:
    """The module's parameter gradients for its output's first tensor weighted by fixed random numbers (the same
    on every rank; a rank holding a slice of that output takes its slice of the numbers)."""
    with _eval(module), torch.enable_grad():
        out = module(*copied(seen.args), **copied(seen.kwargs))
    got = [t for t in tensors_in(out) if t.is_floating_point() and t.requires_grad]
    whole = [t for t in tensors_in(seen.output) if t.is_floating_point()]
    if not got or not whole:
        return {}
    numbers = torch.randn(whole[0].shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    weights = _slice_of(numbers, got[0].shape, rank, tp)
    if weights is None:
        return {}
    (got[0] * weights.to(got[0].device, got[0].dtype)).sum().backward()
    return {n: p.grad.detach() for n, p in module.named_parameters() if p.grad is not None}


def _close(got: torch.Tensor, want: torch.Tensor, largest: float) -> bool:
    """Equal up to float noise, relative to the gradient's own size (at initialisation attention is nearly uniform,
    so heads grouped wrongly change the outputs by little but the query and key weights' gradients by as much as
    they are), with a floor relative to the block's largest gradient (a key bias's gradient is zero up to noise)."""
    scale = float(want.abs().max()) if want.numel() else 0.0
    return got.shape == want.shape and bool(
        (got.double() - want.double()).abs().max() <= 1e-3 * scale + 1e-5 * largest)


def _partial_gradients(name: str, plan: dict[str, str], block: nn.Module, trial: nn.Module, seen: Seen, fed: Seen,
                       tp: int, rank: int, group: Any, agree: Callable[[list[bool]], list[bool]]) -> list[str]:
    """The block's whole parameters whose gradient each rank computes for its share of the heads (a q/k norm over
    the local heads): the ranks' gradients sum to the whole one, so they are summed over the ranks in training.
    A parameter whose gradient is neither refuses the block."""
    import torch.distributed as dist

    want, got = _gradients(copy.deepcopy(block), seen, 0, 1), _gradients(trial, fed, rank, tp)
    largest = max((float(g.abs().max()) for g in want.values() if g.numel()), default=0.0)
    flags: list[bool] = []
    for param in sorted(want):
        grad = got.get(param)
        if grad is None:
            flags += [False, False]
            continue
        if hasattr(grad, "full_tensor"):
            flags += [_close(grad.full_tensor(), want[param], largest), False]
            continue
        summed = grad.clone()
        dist.all_reduce(summed, group=group)
        flags += [_close(grad, want[param], largest), _close(summed, want[param], largest)]
    agreed = agree(flags)
    partial = []
    for i, param in enumerate(sorted(want)):
        is_whole, is_summed = agreed[2 * i], agreed[2 * i + 1]
        if is_summed and not is_whole:
            partial.append(param)
        elif not is_whole:
            raise refusal(name, plan, f"the gradient of its weight {param} on the sharded block is neither the whole "
                                      "block's nor each rank's share of it")
    return partial


def _inside(plan: dict[str, str], block: str) -> dict[str, str]:
    """The plan's entries for the layers directly under `block`, by their names inside it."""
    prefix = f"{block}." if block else ""
    return {n[len(prefix):]: s for n, s in plan.items() if n.startswith(prefix) and "." not in n[len(prefix):]}


def resolved(inside: dict[str, str], way: Way) -> dict[str, str]:
    return {n: (way.fused if s == FUSED else s) for n, s in inside.items()}


def _try(block: nn.Module, inside: dict[str, str], way: Way, sizes: dict[str, tuple[int, int]], seen: Seen,
         tp: int, rank: int, shard: Shard) -> tuple[str | None, nn.Module]:
    """(None if `block` sharded this way computes `seen.output` from `seen`'s inputs, else what went wrong; the
    sharded copy)."""
    trial = copy.deepcopy(block)
    shard(trial, resolved(inside, way))
    if way.local_sizes:
        local_sizes.scale(trial, sizes)
    try:
        with _eval(trial), torch.no_grad():
            out = trial(*copied(seen.args), **copied(seen.kwargs))
    except Exception as exc:
        return (f"its forward fails on 1/{tp} of the heads and features: {raised_at(exc)}: the line sizes a tensor "
                "by the whole model's width or head count; size it from the tensor this rank holds (chunk(3, dim=-1) "
                "for a fused projection, view(b, t, -1, head_dim) for heads)"), trial
    diff = max_diff(out, seen.output, rank, tp)
    if diff is None or diff > _TOLERANCE.get(_dtype_of(out), 1e-2):
        said = "its outputs differ in structure" if diff is None else f"its output differs by {diff:.3g}"
        return (f"{said} from the whole block on the same input: each rank holds 1/{tp} of the heads and features, "
                "and a forward that sizes its reshapes by the whole model's head count or width (view(b, t, "
                "self.heads, c // self.heads)) computes other heads; size them from the tensors (view(b, t, -1, "
                "head_dim))"), trial
    return None, trial


def raised_in(model: nn.Module, blocks: list[str], exc: BaseException) -> str:
    """The innermost of `blocks` whose forward was running when `exc` rose ("" where none was)."""
    ids = {id(model.get_submodule(name)): name for name in blocks}
    found, tb = "", exc.__traceback__
    while tb is not None:
        owner = tb.tb_frame.f_locals.get("self")
        found = ids.get(id(owner), found)
        tb = tb.tb_next
    return found


def raised_at(exc: BaseException) -> str:
    """`file:line: code (Error: message)` of the innermost frame outside torch that was running when `exc` rose."""
    tb: TracebackType | None = exc.__traceback__
    where = None
    while tb is not None:
        path = tb.tb_frame.f_code.co_filename
        if f"{os.sep}torch{os.sep}" not in path and f"{os.sep}paratrain{os.sep}" not in path:
            where = (path, tb.tb_lineno)
        tb = tb.tb_next
    message = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ''}"
    if where is None:
        return message
    path, line = where
    code = linecache.getline(path, line).strip()
    return f"{_short(path)}:{line} `{code}` ({message})"


def _short(path: str) -> str:
    for marker in ("site-packages" + os.sep, "src" + os.sep):
        if marker in path:
            return path.split(marker, 1)[1]
    return os.path.basename(path)


def refusal(name: str, plan: dict[str, str], what: str) -> ParatrainError:
    layers = ", ".join(n for n in plan if n.rpartition(".")[0] == name or (name and n.startswith(f"{name}.")))
    block = name or "the model's own forward"
    return ParatrainError(
        f"tensor parallelism cannot shard {block}{f' ({layers})' if layers else ''}: {what}; or pass "
        "setup(tp_plan=...) without this block")


def _dtype_of(value: Any) -> torch.dtype:
    tensors = tensors_in(value)
    return tensors[0].dtype if tensors else torch.float32


def max_diff(got: Any, want: Any, rank: int, tp: int) -> float | None:
    """Largest difference between two outputs, a tensor split over the ranks compared with this rank's slice of the
    whole one; None where they differ in structure."""
    a, b = tensors_in(got), tensors_in(want)
    if len(a) != len(b):
        return None
    worst = 0.0
    for x, y in zip(a, b, strict=True):
        x = x.full_tensor() if hasattr(x, "full_tensor") else x
        part = _slice_of(y, x.shape, rank, tp)
        if part is None:
            return None
        if x.dtype.is_floating_point and x.numel():
            worst = max(worst, (x.float() - part.float()).abs().max().item())
        elif not torch.equal(x, part):
            return float("inf")
    return worst


def _slice_of(whole: torch.Tensor, shape: torch.Size, rank: int, tp: int) -> torch.Tensor | None:
    """`whole` itself, or this rank's slice of it along the one dimension the ranks split (None: neither)."""
    if whole.shape == shape:
        return whole
    if whole.dim() != len(shape):
        return None
    split = [d for d in range(whole.dim()) if whole.shape[d] != shape[d]]
    if len(split) != 1 or whole.shape[split[0]] != shape[split[0]] * tp:
        return None
    d = split[0]
    return whole.narrow(d, rank * shape[d], shape[d])
