"""Listed experts under expert parallelism exchange each block's rows once per forward (parallel/expert/listed.py),
against the user's own loop in one process and against one exchange per expert call.

Two ranks (gloo, forked from this process) each run their half of a batch through blocks whose forward is the
user's loop over a ModuleList of experts. Counted per block forward: one gather of the calls and one all-to-all
each way, none per call. Outputs and gradients equal the plain loop's and the per-call path's (1e-6), and the
block's side effects (a buffer, an attribute, a list) happen once. A block whose routing depends on an expert's
output is caught by its first forward's replay and runs one exchange per call, exact; one whose routing starts
depending on it later is refused by name.
"""

from __future__ import annotations

import os
import tempfile
from collections import Counter
from collections.abc import Callable
from typing import Any

import moe_cases as cases
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from paratrain.errors import ParatrainError
from paratrain.parallel.expert import dispatch, listed
from paratrain.parallel.expert.apply import Groups, apply_ep

WIDTH, ROWS, WORLD = 16, 6, 2


class MoE(nn.Module):
    """The user's loop (moe_cases.MoE) with side effects: a load buffer, a forward count, the router's logits kept
    in a list; with `jitter`, router noise from torch's generator; with `chain`, each expert's input carries the
    outputs of the experts before it (routing that depends on what an expert returns)."""

    def __init__(self, jitter: bool = False, chain: bool = False) -> None:
        super().__init__()
        self.router = nn.Linear(WIDTH, cases.EXPERTS, bias=False)
        self.experts = nn.ModuleList(cases.Expert(WIDTH) for _ in range(cases.EXPERTS))
        self.register_buffer("load", torch.zeros(cases.EXPERTS))
        self.jitter, self.chain, self.forwards = jitter, chain, 0
        self.skip: int | None = None
        """An expert the loop leaves out (`if not rows: continue` on the rank whose rows it has none of)."""
        self.logits: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        if self.jitter:
            flat = flat * (1 + 0.01 * torch.rand_like(flat))
        logits = self.router(flat)
        self.logits.append(logits)
        self.forwards += 1
        weights, chosen = F.softmax(logits, dim=-1).topk(2, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        with torch.no_grad():
            self.load += torch.bincount(chosen.reshape(-1), minlength=cases.EXPERTS)
        out, hidden = torch.zeros_like(flat), flat
        for e, expert in enumerate(self.experts):
            if e == self.skip:
                continue
            rows, slot = torch.where(chosen == e)
            y = weights[rows, slot, None] * expert(hidden[rows])
            out = out.index_add(0, rows, y)
            if self.chain:
                hidden = hidden.index_add(0, rows, y)
        return out.reshape_as(x)


def _model(**options: Any) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(MoE(**options), MoE(**options))


def _entry(rank: int, path: str, scenario: Callable[[int], None]) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=WORLD)
    try:
        scenario(rank)
    finally:
        dist.destroy_process_group()


def _in_two_ranks(scenario: Callable[[int], None]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        torch.multiprocessing.start_processes(_entry, args=(os.path.join(tmp, "store"), scenario), nprocs=WORLD,
                                              start_method="fork")


def _split(model: nn.Module) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (WORLD,))
    apply_ep(model, Groups(mesh=mesh, rank=mesh.get_local_rank(), size=WORLD, replicas=None, replica_count=1,
                           data_parallel=1))  # sums, as a loss summed over the rows gives: the plain loop's grads
    return model


def _blocks(model: nn.Module) -> list[listed.Block]:
    return [next(m.block for m in moe.experts if isinstance(m, listed._Remote)) for moe in model]


def _data(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    x, cotangent = torch.randn(WORLD * ROWS, 3, WIDTH, generator=g), torch.randn(WORLD * ROWS, 3, WIDTH, generator=g)
    share = slice(rank * ROWS, (rank + 1) * ROWS)
    return x[share], cotangent[share]


def _step(model: nn.Module, x: torch.Tensor, cotangent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The output and the input's gradient of `(model(x) * cotangent).sum()`, the weights' gradients kept."""
    x = x.clone().requires_grad_()
    out = model(x)
    (out * cotangent).sum().backward()
    assert x.grad is not None
    return out.detach(), x.grad


def _expert_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    """The gradients of the experts this rank holds."""
    return {name: p.grad for name, p in model.named_parameters() if ".experts." in name and p.grad is not None}


def _counting(counts: Counter[str]) -> Any:
    """dispatch's collectives, counted by name."""
    originals = {name: getattr(dispatch, name) for name in ("exchange", "calls", "agree")}

    def counted(name: str) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            counts[name] += 1
            return originals[name](*args, **kwargs)

        return call

    for name in originals:
        setattr(dispatch, name, counted(name))
    return originals


def _once_per_block(rank: int) -> None:
    plain, batched, per_call = _model(), _split(_model()), _split(_model())
    for block in _blocks(per_call):
        block.each.update({True, False})  # one exchange per expert call, as before
    counts: Counter[str] = Counter()
    _counting(counts)
    for step in range(2):
        x, cotangent = _data(step, rank)
        whole = torch.cat([_data(step, r)[0] for r in range(WORLD)])
        ref_out, ref_grad = _step(plain, whole, torch.cat([_data(step, r)[1] for r in range(WORLD)]))
        counts.clear()
        out, grad = _step(batched, x, cotangent)
        # per block: one gather of the calls, one all-to-all each way; nothing per call. The first forward runs
        # them twice: a forward that keeps nothing checks that the replay follows from the router alone
        assert counts == Counter(calls=2 * (2 - step), exchange=4 * (2 - step)), counts
        counts.clear()
        each_out, each_grad = _step(per_call, x, cotangent)
        assert counts == Counter(agree=2 * cases.EXPERTS, exchange=4 * cases.EXPERTS), counts
        share = slice(rank * ROWS, (rank + 1) * ROWS)
        torch.testing.assert_close(out, ref_out[share], atol=1e-6, rtol=0)
        torch.testing.assert_close(grad, ref_grad[share], atol=1e-6, rtol=0)
        torch.testing.assert_close(out, each_out, atol=1e-6, rtol=0)
        torch.testing.assert_close(grad, each_grad, atol=1e-6, rtol=0)
    router = batched[0].router.weight.grad.clone()
    dist.all_reduce(router)  # each rank's rows' share of the router's gradient
    torch.testing.assert_close(router, plain[0].router.weight.grad, atol=1e-6, rtol=0)
    torch.testing.assert_close(batched[1].router.weight.grad, per_call[1].router.weight.grad, atol=1e-6, rtol=0)
    mine, each, whole = _expert_grads(batched), _expert_grads(per_call), _expert_grads(plain)
    assert set(mine) == set(each) and len(mine) == len(whole) // WORLD
    for name, grad in mine.items():
        torch.testing.assert_close(grad, each[name], atol=1e-6, rtol=0)
        torch.testing.assert_close(grad, whole[name], atol=1e-6, rtol=0)
    for moe, reference in zip(batched, per_call):  # side effects once a forward
        assert moe.forwards == reference.forwards == 2 and len(moe.logits) == 2
        torch.testing.assert_close(moe.load, reference.load, atol=0, rtol=0)
        torch.testing.assert_close(moe.logits[-1], reference.logits[-1], atol=0, rtol=0)
    assert all(not block.each for block in _blocks(batched))


def _jitter(rank: int) -> None:
    batched, per_call = _split(_model(jitter=True)), _split(_model(jitter=True))
    for block in _blocks(per_call):
        block.each.update({True, False})
    for step in range(2):
        x, cotangent = _data(step, rank)
        torch.manual_seed(10 + step)
        out, grad = _step(batched, x, cotangent)
        after = torch.get_rng_state()
        torch.manual_seed(10 + step)
        each_out, each_grad = _step(per_call, x, cotangent)
        torch.testing.assert_close(out, each_out, atol=1e-6, rtol=0)
        torch.testing.assert_close(grad, each_grad, atol=1e-6, rtol=0)
        assert torch.equal(after, torch.get_rng_state())  # torch's generator drew once per draw
    with torch.no_grad():  # evaluation: the same exchange, no graph
        batched.eval()
        per_call.eval()
        torch.manual_seed(20)
        out = batched(x)
        torch.manual_seed(20)
        torch.testing.assert_close(out, per_call(x), atol=1e-6, rtol=0)


def _chained(rank: int) -> None:
    plain, batched = _model(chain=True), _split(_model(chain=True))
    for step in range(2):
        x, cotangent = _data(step, rank)
        whole = torch.cat([_data(step, r)[0] for r in range(WORLD)])
        ref_out, ref_grad = _step(plain, whole, torch.cat([_data(step, r)[1] for r in range(WORLD)]))
        out, grad = _step(batched, x, cotangent)
        share = slice(rank * ROWS, (rank + 1) * ROWS)
        torch.testing.assert_close(out, ref_out[share], atol=1e-6, rtol=0)
        torch.testing.assert_close(grad, ref_grad[share], atol=1e-6, rtol=0)
        assert all(block.each == {True} for block in _blocks(batched))  # found by the first forward's replay
        assert [m.forwards for m in batched] == [step + 1] * 2
    router = batched[0].router.weight.grad.clone()
    dist.all_reduce(router)
    torch.testing.assert_close(router, plain[0].router.weight.grad, atol=1e-6, rtol=0)


def _refused(rank: int) -> None:
    model = _split(_model())
    x, cotangent = _data(0, rank)
    _step(model, x, cotangent)  # the first forward: the routing follows from the router alone
    for moe in model:
        moe.chain = True  # from now on it does not
    with pytest.raises(ParatrainError, match=r"^expert parallelism: 0 made other expert calls when its forward ran "
                                             r"again: call \d+ .*independent of the experts' outputs"):
        model(x)
    skipping = _split(_model())
    skipping[0].skip = 0 if rank == 1 else None
    with pytest.raises(ParatrainError, match=r"called different experts of 0 at once \(calls made per rank: 4, 3\)"
                                             r".*if not rows: continue"):
        skipping(x)


@pytest.mark.procs
@pytest.mark.timeout(120)
@pytest.mark.parametrize("scenario", [_once_per_block, _jitter, _chained, _refused],
                         ids=["once-per-block", "jitter-and-eval", "chained-falls-back", "refused"])
def test_listed_experts_exchange_a_blocks_rows_once(scenario: Callable[[int], None]) -> None:
    _in_two_ranks(scenario)
