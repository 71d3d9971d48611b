"""Dropout masks that do not depend on the layout: not on the rank or stage that runs a layer, the world
size, the balance, or how a batch is cut into micro-batches.

torch draws dropout masks from a per-process generator, so a layer's mask changes when a balance moves
the layer to another rank, when a batch is split into micro-batches, or when another number of
workers shares the batch. Here every kept/dropped bit is a counter-based hash of

    (seed, micro-step, layer, global row, position within the row)

computed with integer tensor operations, the same on CPU and CUDA. The global row is the sample's index
in the global batch of that micro-step: a worker's share starts at `rows_before` (set by the sharded
loader) and a micro-batch further in (set by the pipeline engines). The layer is the dropout module's
path in the user's model (plus which call of it this is), or, for a traced model, the path torch.export
records for the dropout op: both name the same layer, so every strategy draws the same masks.

What is covered here: `nn.Dropout` (and `Dropout1d/2d/3d`, whole channels) modules everywhere, and their ops inside
traced models. Random functions a module calls (F.dropout, bernoulli_, rand, an attention's dropout_p) draw from
the same hash through `random_calls` (eager forwards) and `pipeline.graph_randomness` (traced stages).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from .. import _forwards
from .step_state import DropoutPosition, StepState, active

_MASK32 = 0xFFFFFFFF
_ROW_MIX = 0x9E3779B1


def _at(state: StepState | None = None) -> DropoutPosition:
    """The position of `state` (a run's), or of the active run's."""
    return (state or active()).dropout


def set_seed(seed: int, state: StepState | None = None) -> None:
    _at(state).seed = seed


def at_micro_step(step: int, state: StepState | None = None) -> None:
    """The micro-step the next forward belongs to (the run's step counter)."""
    at = _at(state)
    if step != at.step:
        at.step = step
        at.calls.clear()


def set_rows_before(rows: int, state: StepState | None = None) -> None:
    """Global rows of the current global batch that come before this worker's share (the loader sets it)."""
    _at(state).rows_before = rows


@contextmanager
def rows_offset(extra: int) -> Iterator[None]:
    """Within the block, rows start `extra` rows further into the worker's share (a micro-batch)."""
    at = _at()
    before = at.rows_before
    at.rows_before = before + extra
    try:
        yield
    finally:
        at.rows_before = before


def snapshot() -> dict[tuple[str, int, int], int]:
    """The per-layer call counts of the current micro-step (trial steps put them back afterwards)."""
    return dict(_at().calls)


def restore(calls: dict[tuple[str, int, int], int]) -> None:
    _at().calls = dict(calls)


Position = tuple[int, int, dict[tuple[str, int, int], int]]
"""Where a forward stands: micro-step, rows before this worker's share, per-layer call counts."""


def position() -> Position:
    at = _at()
    return at.step, at.rows_before, dict(at.calls)


@contextmanager
def replaying(where: Position) -> Iterator[None]:
    """Inside, forwards draw the masks they drew at `where` (a recomputation in the backward: activation
    checkpointing); the current position is back afterwards."""
    at = _at()
    now = position()
    at.step, at.rows_before, at.calls = where[0], where[1], dict(where[2])
    try:
        yield
    finally:
        at.step, at.rows_before, at.calls = now


def _mix(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (Wellons' lowbias32) on int64 tensors holding values below 2**32."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _MASK32
    return x ^ (x >> 16)


def _base(key: str, call: int) -> int:
    at = _at()
    text = f"{at.seed}/{at.step}/{key}/{call}".encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=4).digest(), "little")


def bits(shape: torch.Size, key: str, call: int, device: torch.device, rows_before: int | None = None,
         cols: torch.Tensor | None = None) -> torch.Tensor:
    """Uniform 32-bit integers (int64 values below 2**32) for a (rows, ...) tensor of layer `key`'s `call`-th draw:
    rows are numbered from `rows_before`, an element's column is its position in its row (`cols`: the positions a
    rank's slice of a wider row holds)."""
    rows = shape[0]
    per_row = 1
    for d in shape[1:]:
        per_row *= d
    start = _at().rows_before if rows_before is None else rows_before
    row = torch.arange(start, start + rows, device=device, dtype=torch.int64).view(rows, 1)
    col = torch.arange(per_row, device=device, dtype=torch.int64) if cols is None else cols.to(device)
    col = col.view(1, per_row)
    return _mix(_mix(col ^ _base(key, call)) ^ ((row * _ROW_MIX) & _MASK32))


Layout = tuple[int, int]
"""Where a drawn tensor's samples lie: (axis, entries per sample along it). (0, 1): one row per sample along dim 0;
(0, k): dim 0 holds the samples' tokens flattened sample by sample, k each ((b * t, h) is drawn as (b, t, h));
(1, 1): the sequence first, the samples along dim 1 ((t, b, h) is drawn as (b, t, h)); (0, 0): not per sample, the
whole tensor one row 0."""
ROWS: Layout = (0, 1)


def sample_layout(shape: tuple[int, ...], rows: int) -> Layout:
    """The layout of a tensor drawn in a forward of `rows` samples: dim 0 the samples; else dim 1 the samples (the
    sequence first: (t, b, h), or XLNet's (2t, b, h) positions); else dim 0 a multiple of them (tokens flattened)."""
    if rows <= 0 or not shape:
        return (0, 0)
    if shape[0] == rows:
        return ROWS
    if len(shape) > 1 and shape[1] == rows:
        return (1, 1)
    if shape[0] > rows and shape[0] % rows == 0:
        return (0, shape[0] // rows)
    return (0, 0)


def drawn_shape(shape: tuple[int, ...], layout: Layout) -> tuple[int, ...]:
    """The (samples, per sample...) shape a tensor is drawn as (one row for a tensor not per sample)."""
    axis, factor = layout
    if factor == 0:
        return (1, *shape)
    if axis == 1:
        shape = (shape[1], shape[0], *shape[2:])
    return (shape[0] // factor, factor, *shape[1:]) if factor > 1 else shape


def layout_bits(shape: tuple[int, ...], key: str, call: int, device: torch.device, layout: Layout,
                cols: torch.Tensor | None = None) -> torch.Tensor:
    """`bits` of a tensor of `shape`, drawn per sample as `layout` says (rows numbered from this worker's share)."""
    drawn = bits(torch.Size(drawn_shape(shape, layout)), key, call, device, 0 if layout[1] == 0 else None, cols)
    if layout == (1, 1):
        return drawn.view(shape[1], shape[0], *shape[2:]).transpose(0, 1)
    return drawn.view(shape)


def dropout(x: torch.Tensor, p: float, train: bool, key: str, call: int = 0, channels: bool = False,
            layout: Layout | None = None) -> torch.Tensor:
    """Dropout of `x` with the layout-independent mask of layer `key` (its `call`-th use in a forward).
    `channels` drops whole channels (dims 0-1 of the mask, as Dropout1d/2d/3d do). `layout`: where the samples lie
    (None: read from the shape and the forward's batch, `sample_layout`)."""
    if not train or p == 0.0:
        return x
    if p >= 1.0:
        return x * 0.0
    shape = tuple(x.shape[:2] if channels else x.shape)
    calls = active().random_calls
    if layout is None:
        layout = calls.layout(shape) if calls is not None else ROWS
    # a tensor-parallel rank's slice draws the whole tensor's mask at its positions
    cols = calls.cols(key, call, drawn_shape(shape, layout)[1:]) if calls is not None else None
    keep = layout_bits(shape, key, call, x.device, layout, cols) >= min(int(p * 2**32), 2**32)
    if channels:
        keep = keep.view(*shape, *([1] * (x.dim() - 2)))
    return x * (keep.to(x.dtype) * (1.0 / (1.0 - p)))


def next_call(key: str) -> int:
    at = _at()
    slot = (key, at.step, at.rows_before)
    call = at.calls.get(slot, 0)
    at.calls[slot] = call + 1
    return call


_CHANNEL_DROPOUTS = (nn.Dropout1d, nn.Dropout2d, nn.Dropout3d)


def _draw(module: nn.Module, key: str, x: torch.Tensor, channels: bool) -> torch.Tensor:
    return dropout(x, module.p, module.training, key, next_call(key), channels)  # type: ignore[arg-type]


def _draws() -> tuple[Any, Any]:
    """(module draw, graph draw): plain, or run eagerly inside compiled code once `eager_under_compile` ran."""
    eager = active().eager_draws
    return eager if eager is not None else (_draw, dropout)


def graph_dropout(x: torch.Tensor, p: float, train: bool, key: str, call: int = 0, channels: bool = False,
                  layout: Layout = ROWS) -> torch.Tensor:
    """`dropout` as a traced graph calls it (pipeline stages: `layout` read off the graph's shapes), through what
    `eager_under_compile` sets."""
    return _draws()[1](x, p, train, key, call, channels, layout)  # type: ignore[no-any-return]


def eager_under_compile() -> None:
    """From now on the active run's masks are drawn eagerly inside compiled code: their position (micro-step,
    rows, call) is Python state that torch.compile would bake into its graph and recompile for at every step,
    until it gave up and ran the whole block eagerly. Called by `setup(compile=...)`; imports torch's compiler."""
    state = active()
    if state.eager_draws is None:
        state.eager_draws = (torch.compiler.disable(_draw), torch.compiler.disable(dropout))


def _module_forward(module: nn.Module, key: str) -> Any:
    channels = isinstance(module, _CHANNEL_DROPOUTS)

    def forward(x: torch.Tensor) -> torch.Tensor:
        if not module.training or module.p == 0.0:  # an evaluation between steps draws nothing, counts no call
            return x
        return _draws()[0](module, key, x, channels)  # type: ignore[no-any-return]

    return forward


def apply_layout_dropout(model: nn.Module) -> list[str]:
    """Make every nn.Dropout module of `model` draw layout-independent masks; returns their paths."""
    names = []
    for name, module in model.named_modules():
        if type(module) in (nn.Dropout, *_CHANNEL_DROPOUTS) and "forward" not in module.__dict__:
            _forwards.replace(module, _module_forward(module, name), "layout dropout")
            names.append(name)
    return names
