"""Sending rows to the ranks that hold their experts and back: all-to-all over the expert-parallel group.

Rows travel through torch's differentiable `all_to_all_single`, so the backward sends each row's gradient back
the way it came: the rank that routed a token gets the gradient of its own loss with respect to that token's
hidden state, and the expert's owner gets the gradient with respect to the expert's weights from every rank's
tokens. Counts travel first (integers, no gradient), so every receive buffer is sized exactly: no capacity, no
token dropped.

    rank 0 tokens -> experts 0,1 (rank 0) | experts 2,3 (rank 1)      sorted by expert, cut by owner,
    rank 1 tokens -> experts 0,1 (rank 0) | experts 2,3 (rank 1)      exchanged, computed, exchanged back
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ...errors import ParatrainError


def counts(send: torch.Tensor, group: Any) -> torch.Tensor:
    """How many rows each rank of `group` sends this one, given how many this one sends each of them."""
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return recv


def exchange(rows: torch.Tensor, send: list[int], recv: list[int], group: Any) -> torch.Tensor:
    """`rows` cut into `send[i]` rows for rank i of `group`; returns what the ranks sent this one, in rank order."""
    from torch.distributed._functional_collectives import all_to_all_single_autograd, wait_tensor

    return wait_tensor(all_to_all_single_autograd(rows.contiguous(), recv, send, group))


def agree(label: int, rows: int, group: Any, size: int, where: str) -> list[int]:
    """Every rank of `group` is about to call the same expert (`label`): their row counts, or a refusal naming the
    block, since a rank that skipped an expert would pair its collectives with another expert's."""
    mine = torch.tensor([label, rows], dtype=torch.int64)
    every = [torch.empty_like(mine) for _ in range(size)]
    dist.all_gather(every, mine, group=group)
    labels = {int(t[0]) for t in every}
    if len(labels) > 1:
        raise ParatrainError(
            f"expert parallelism: the ranks of one expert group called different experts of {where} at once "
            f"(experts {sorted(labels)}): under ep every rank calls every expert in the same order, with no rows "
            "if none are routed to it; remove the `if not rows: continue` from the block's loop over its experts")
    return [int(t[1]) for t in every]
