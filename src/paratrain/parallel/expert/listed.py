"""Listed experts under expert parallelism: a user's MoE block that calls each expert of an nn.ModuleList in its
own loop, each expert held by one rank of the group.

The loop needs an expert's output before it goes on, and paratrain does not rewrite the user's routing, so the
direct way is one exchange per call (`each_call`: a row-count check and two all-to-alls for every expert of every
block). Instead each block's rows travel once per forward: the block's forward runs twice (`Block.forward`).

1. Record: every expert call keeps its input rows and returns zeros of their shape. The forward's result is
   dropped, and what it changed is put back: torch's generator and paratrain's draw counts, the buffers (swapped
   for copies while it runs) and attributes of the block's modules other than the experts.
2. Exchange (`dispatch.calls`, then two all-to-alls): every rank's calls (expert and rows) gathered at once, every
   call's rows sent to the expert's owner, each owner runs each call of its experts on every rank's rows of that
   call in rank order (the input the per-call exchange gives it, bit for bit), the results sent back.
3. Replay: the forward runs again from the same state, and each expert call returns the computed output of the
   same call, once checked to be that call (the same expert and the same input, bit for bit).

Gradients reach the hidden states through the recorded inputs (the first pass's graph) and the router through the
replay's routing weights. Routing that depends on what the experts return makes other calls in the replay: the
first forward of each block in each mode (training, evaluation) runs the three steps once more beforehand, keeping
nothing (no graph, its changes put back), and compares every rank's replay (one flag over the group). Where one
differs, the block calls its experts one exchange per call from then on, exact as before. A replay that differs in
a later forward is refused by name on the rank that sees it: it cannot tell the other ranks in time. A forward
making more than CALLS_PER_EXPERT calls per expert runs one exchange per call.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from ... import _forwards
from ..._tree import tensors_in
from ...errors import ParatrainError
from ...grad_clip import SPREAD
from .. import randomness
from . import dispatch

if TYPE_CHECKING:
    from .apply import ExpertGrads, Groups
    from .find import Experts

REASON = "expert parallelism (parallel.expert)"
CALLS_PER_EXPERT = 4
"""Calls per expert a block's forward may make and still have its rows exchanged at once (the width of the gathered
table); a forward making more calls its experts one exchange per call."""

Expert = Callable[[torch.Tensor], torch.Tensor]
_MANY = "more calls than exchanged at once"


@dataclass
class _Call:
    index: int
    rows: torch.Tensor
    out: torch.Tensor | None = None


@dataclass
class _Session:
    """One forward of a block: the calls recorded, then replayed."""

    calls: list[_Call] = field(default_factory=list)
    replay: bool = False
    each: bool = False
    """One exchange per call (a forward making too many calls, or a block whose replay differed)."""
    at: int = 0
    differs: str = ""
    """The first way the replay differed from the recording ("" while none)."""
    unequal: list[torch.Tensor] = field(default_factory=list)
    """Per replayed call, whether its input's bits differ from the recorded one's (read once, at the end)."""


@dataclass
class _Random:
    """torch's generator (CPU, and a GPU's) and paratrain's per-layer draw counts (`randomness`)."""

    cpu: torch.Tensor
    gpu: tuple[torch.device, torch.Tensor] | None
    counts: dict[tuple[str, int, int], int]

    @classmethod
    def take(cls, device: torch.device) -> _Random:
        gpu = (device, torch.cuda.get_rng_state(device)) if device.type == "cuda" else None
        return cls(torch.get_rng_state(), gpu, randomness.snapshot())

    def put(self, generator: bool, counts: bool) -> None:
        if generator:
            torch.set_rng_state(self.cpu)
            if self.gpu is not None:
                torch.cuda.set_rng_state(self.gpu[1], self.gpu[0])
        if counts:
            randomness.restore(self.counts)


@dataclass
class _State:
    """What a forward of the block's own modules may change, taken before it runs."""

    attributes: list[tuple[nn.Module, dict[str, Any]]]
    lists: list[tuple[list[Any], int]]
    buffers: list[tuple[nn.Module, str, torch.Tensor]]

    @classmethod
    def take(cls, modules: list[nn.Module]) -> _State:
        attributes = [(m, dict(m.__dict__)) for m in modules]
        lists = [(v, len(v)) for _, seen in attributes for v in seen.values() if type(v) is list]
        buffers = [(m, k, b) for m in modules for k, b in m._buffers.items() if b is not None]
        return cls(attributes, lists, buffers)

    @contextmanager
    def buffers_copied(self) -> Iterator[None]:
        """Inside, the modules update copies of their buffers (a BatchNorm's statistics, a router's load)."""
        for m, k, b in self.buffers:
            m._buffers[k] = b.clone()
        try:
            yield
        finally:
            for m, k, b in self.buffers:
                m._buffers[k] = b

    def put_attributes(self) -> None:
        """Attributes bound, and lists grown, by a forward undone (an auxiliary loss kept on the module, a count)."""
        for m, seen in self.attributes:
            for key in [k for k in m.__dict__ if k not in seen]:
                del m.__dict__[key]
            for key, value in seen.items():
                if m.__dict__.get(key) is not value:
                    m.__dict__[key] = value
        for items, length in self.lists:
            del items[length:]


_WORDS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(t: torch.Tensor) -> torch.Tensor:
    """`t`'s bits as integers: compared exactly (a NaN equals itself, -0.0 differs from 0.0)."""
    flat = t.detach().contiguous().view(-1)
    return flat.view(_WORDS.get(flat.element_size(), torch.uint8)) if flat.dtype.is_floating_point else flat


class Block:
    """One listed MoE block under expert parallelism: its forward in two passes around one exchange, and the calls
    of its experts (owned ones computed here, the others held elsewhere)."""

    def __init__(self, block: nn.Module, experts: nn.ModuleList, groups: Groups, grads: ExpertGrads,
                 where: str) -> None:
        self.groups, self.grads, self.where = groups, grads, where
        self.count, self.local = len(experts), len(experts) // groups.size
        self.owned: dict[int, Expert] = {}
        inside = {id(m) for m in experts.modules()}
        self.modules = [m for m in block.modules() if id(m) not in inside]
        """The block's own modules, the experts left out: what a recording pass may change."""
        self.session: _Session | None = None
        self.checked: set[bool] = set()
        """The modes (training or not) whose first forward compared every rank's replay."""
        self.each: set[bool] = set()
        """The modes whose replay differed: their forwards call the experts one exchange per call."""

    def owner(self, index: int) -> int:
        return index // self.local

    # The expert calls, from the user's loop.

    def call(self, index: int, inner: Expert | None, x: torch.Tensor) -> torch.Tensor:
        session = self.session
        if session is None or session.each:
            return self.each_call(index, inner, x)
        if not session.replay:
            session.calls.append(_Call(index, x))
            return torch.zeros_like(x)
        return self._replayed(session, index, x)

    def _replayed(self, session: _Session, index: int, x: torch.Tensor) -> torch.Tensor:
        at, session.at = session.at, session.at + 1
        if session.differs:
            return torch.zeros_like(x)
        if at >= len(session.calls):
            session.differs = f"call {at + 1} (expert {index}) was not made the first time"
            return torch.zeros_like(x)
        call = session.calls[at]
        if call.index != index or call.rows.shape != x.shape or call.rows.dtype != x.dtype:
            session.differs = (f"call {at + 1} was expert {call.index} on rows {tuple(call.rows.shape)} the first "
                               f"time, expert {index} on rows {tuple(x.shape)} the second")
            return torch.zeros_like(x)
        if x.device.type == "cpu":  # compared at once; on a GPU read once, after the replay (one sync)
            if not torch.equal(_bits(call.rows), _bits(x)):
                session.differs = f"call {at + 1} (expert {index}) had other input rows the second time"
        else:
            session.unequal.append(torch.ne(_bits(call.rows), _bits(x)).any())
        assert call.out is not None
        return call.out

    def each_call(self, index: int, inner: Expert | None, x: torch.Tensor) -> torch.Tensor:
        """One expert's call on every rank of the group at once: every rank's rows to the owner, the results back."""
        groups, owner = self.groups, self.owner(index)
        rows = dispatch.agree(index, x.shape[0], groups.group, groups.size, self.where)
        to_owner = [x.shape[0] if r == owner else 0 for r in range(groups.size)]
        mine = rows if groups.rank == owner else [0] * groups.size
        gathered = dispatch.exchange(x, to_owner, mine, groups.group)
        computed = inner(gathered) if inner is not None else gathered
        self._check_shape(index, gathered, computed)
        out = dispatch.exchange(computed, mine, to_owner, groups.group)
        if inner is not None and out.requires_grad:
            out.register_hook(self.grads.queue)
        return out

    def _check_shape(self, index: int, rows: torch.Tensor, computed: torch.Tensor) -> None:
        if computed.shape[1:] != rows.shape[1:]:
            raise ParatrainError(
                f"expert parallelism: expert {index} of {self.where} maps rows of shape {tuple(rows.shape[1:])} to "
                f"{tuple(computed.shape[1:])}; a listed expert must keep the row shape (a feed-forward block)")

    # The block's forward.

    def forward(self, inner: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        mode = self.modules[0].training if self.modules else True
        if self.session is not None or mode in self.each:  # re-entered, or a block whose replay differed
            return self._run(inner, args, kwargs, _Session(each=True))
        device = next((t.device for t in tensors_in((args, kwargs))), torch.device("cpu"))
        if mode not in self.checked:
            self.checked.add(mode)
            if self._probe(inner, args, kwargs, device):
                self.each.add(mode)
                return self._run(inner, args, kwargs, _Session(each=True))
        out, differs = self._twice(inner, args, kwargs, device, keep=True)
        if differs == _MANY:
            return self._run(inner, args, kwargs, _Session(each=True))
        if differs:
            raise self._refusal(differs)
        return out

    def _probe(self, inner: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
               device: torch.device) -> bool:
        """Whether the replay differs on any rank of the group (one small all-reduce), from a forward that keeps
        nothing: no graph, and what it changed put back. A block's first forward in each mode runs it first, so
        a recomputation in the backward (activation checkpointing) repeats the forward that was kept."""
        with torch.no_grad():
            _, differs = self._twice(inner, args, kwargs, device, keep=False)
        t = torch.tensor([int(bool(differs) and differs != _MANY)], dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.groups.group)
        return bool(t.item())

    def _twice(self, inner: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], device: torch.device,
               keep: bool) -> tuple[Any, str]:
        """The recording pass, the exchange, the replay: (the replay's output, how it differed from the recording
        or "" or `_MANY`). Without `keep`, the replay's changes are put back too."""
        start, state = _Random.take(device), _State.take(self.modules)
        session = _Session()
        with state.buffers_copied():
            self._run(inner, args, kwargs, session)
        state.put_attributes()
        start.put(generator=False, counts=True)  # the experts draw next: torch's generator after the routing's draws
        if not self._exchange(session.calls, device):
            start.put(generator=True, counts=True)
            return None, _MANY
        after = _Random.take(device)
        start.put(generator=True, counts=False)  # the routing draws what it drew the first time
        session.replay = True
        with state.buffers_copied() if not keep else contextlib.nullcontext():
            out = self._run(inner, args, kwargs, session)
        if keep:
            after.put(generator=True, counts=False)  # torch's generator after the routing's and the experts' draws
        else:
            state.put_attributes()
            start.put(generator=True, counts=True)
        return out, self._differs(session)

    def _run(self, inner: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
             session: _Session) -> Any:
        self.session = session
        try:
            return inner(*args, **kwargs)
        finally:
            self.session = None

    def _differs(self, session: _Session) -> str:
        if session.differs:
            return session.differs
        if session.at != len(session.calls):
            return f"{len(session.calls)} expert calls the first time, {session.at} the second"
        if session.unequal and bool(torch.stack(session.unequal).any()):
            first = next(i for i, t in enumerate(session.unequal) if bool(t))
            return f"call {first + 1} (expert {session.calls[first].index}) had other input rows the second time"
        return ""

    def _refusal(self, differs: str) -> ParatrainError:
        return ParatrainError(
            f"expert parallelism: {self.where} made other expert calls when its forward ran again: {differs}. Each "
            "listed MoE block's forward runs twice under ep (its rows recorded, exchanged once, then replayed), "
            "which needs the experts it calls and their input rows to follow from the router alone, not from what "
            "an expert returned; this block's first forward did, this one did not. Make the routing independent "
            "of the experts' outputs, or write the experts in the grouped form (docs/parallelism.md, \"Expert "
            "parallelism\")")

    # The exchange.

    def _exchange(self, calls: list[_Call], device: torch.device) -> bool:
        """Every call's rows to its expert's owner and the results back, stored on the calls; False where the
        forward made more calls than the gathered table holds (then it runs one exchange per call)."""
        groups = self.groups
        labels = [c.index for c in calls]
        table = dispatch.calls(labels, [c.rows.shape[0] for c in calls], CALLS_PER_EXPERT * self.count,
                               groups.group, groups.size, self.where, device)
        if table is None:
            return False
        by_owner = [[i for i, e in enumerate(labels) if self.owner(e) == r] for r in range(groups.size)]
        mine = by_owner[groups.rank]
        send = [sum(calls[i].rows.shape[0] for i in part) for part in by_owner]
        sizes = [[table[s][i] for i in mine] for s in range(groups.size)]  # rows from rank s for each of my calls
        recv = [sum(row) for row in sizes]
        if not calls:
            return True
        sent = torch.cat([calls[i].rows for part in by_owner for i in part])
        received = dispatch.exchange(sent, send, recv, groups.group)
        computed = self._compute(received, [labels[i] for i in mine], sizes)
        back = dispatch.exchange(computed, recv, send, groups.group)
        if back.requires_grad:
            back.register_hook(self.grads.queue)
        order = [i for part in by_owner for i in part]
        for i, out in zip(order, back.split([calls[i].rows.shape[0] for i in order])):
            calls[i].out = out
        return True

    def _compute(self, received: torch.Tensor, experts: list[int], sizes: list[list[int]]) -> torch.Tensor:
        """Each of this rank's calls run on every rank's rows of it (rank order), the results laid out as received:
        by rank, then by call."""
        if not experts:
            return received
        pieces = received.split([n for row in sizes for n in row])
        count = len(experts)
        outs: list[list[torch.Tensor]] = [[] for _ in sizes]
        for j, index in enumerate(experts):
            rows = torch.cat([pieces[s * count + j] for s in range(len(sizes))])
            computed = self.owned[index](rows)
            self._check_shape(index, rows, computed)
            for s, part in enumerate(computed.split([row[j] for row in sizes])):
                outs[s].append(part)
        return torch.cat([part for row in outs for part in row])


class _Remote(nn.Module):
    """An expert another rank of the group holds: its rows go there and come back computed."""

    def __init__(self, index: int, owner: int, block: Block) -> None:
        super().__init__()
        self.index, self.owner, self.block = index, owner, block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block.call(self.index, None, x)

    def extra_repr(self) -> str:
        return f"expert {self.index} on expert-parallel rank {self.owner}"


def split(block: nn.Module, experts_list: nn.Module, experts: Experts, groups: Groups, grads: ExpertGrads) -> None:
    """Keep this rank's experts of a listed block, the others reached through the group; the block's forward then
    exchanges its rows once (the module docstring)."""
    assert isinstance(experts_list, nn.ModuleList)
    state = Block(block, experts_list, groups, grads, experts.block or experts.path)
    for index in range(experts.count):
        owner = state.owner(index)
        if owner != groups.rank:
            experts_list[index] = _Remote(index, owner, state)
            continue
        module = experts_list[index]
        grads.params.extend(p for p in module.parameters() if p.requires_grad)
        for p in module.parameters():  # the group's ranks hold these between them (whole-model gradient norms)
            setattr(p, SPREAD, groups.group)
        state.owned[index] = module.forward
        _forwards.replace(module, _owned_forward(state, index, module.forward), REASON)
    _forwards.replace(block, _block_forward(state, block.forward), REASON)


def _owned_forward(state: Block, index: int, inner: Expert) -> Expert:
    def forward(x: torch.Tensor) -> torch.Tensor:
        return state.call(index, inner, x)

    return forward


def _block_forward(state: Block, inner: Callable[..., Any]) -> Callable[..., Any]:
    def forward(*args: Any, **kwargs: Any) -> Any:
        return state.forward(inner, args, kwargs)

    return forward
