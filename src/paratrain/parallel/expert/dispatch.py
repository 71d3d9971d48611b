"""Sending rows to the ranks that hold their experts and back: all-to-all over the expert-parallel group.

Rows travel through torch's differentiable `all_to_all_single`, so the backward sends each row's gradient back
the way it came: the rank that routed a token gets the gradient of its own loss with respect to that token's
hidden state, and the expert's owner gets the gradient with respect to the expert's weights from every rank's
tokens. Counts travel first (integers, no gradient), so every receive buffer is sized exactly: no capacity, no
token dropped. A listed block's calls are gathered at once (`calls`: each call's expert and rows, every rank's),
or one at a time where it calls its experts one exchange per call (`agree`).

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
        raise _differ(where, f"experts {sorted(labels)}")
    return [int(t[1]) for t in every]


def calls(labels: list[int], rows: list[int], most: int, group: Any, size: int, where: str,
          device: torch.device) -> list[list[int]] | None:
    """Every rank's expert calls of one forward of a block (`labels`, each with `rows`), gathered at once: per rank,
    the rows of each call. Refused by name where the ranks called different experts (as `agree`); None where the
    ranks made more than `most` calls (the fixed width of what is gathered)."""
    kept = min(len(labels), most)
    pad = [-1] * (most - kept)
    mine = torch.tensor([len(labels), *labels[:kept], *pad, *rows[:kept], *pad], dtype=torch.int64, device=device)
    every = [torch.empty_like(mine) for _ in range(size)]
    dist.all_gather(every, mine, group=group)
    table = torch.stack(every).tolist()
    made = {row[0] for row in table}
    if len(made) > 1:
        raise _differ(where, "calls made per rank: " + ", ".join(str(row[0]) for row in table))
    if made.pop() > most:
        return None
    for step in range(kept):
        called = {row[1 + step] for row in table}
        if len(called) > 1:
            raise _differ(where, f"call {step + 1}: experts {sorted(called)}")
    return [row[1 + most:1 + most + kept] for row in table]


def _differ(where: str, what: str) -> ParatrainError:
    return ParatrainError(
        f"expert parallelism: the ranks of one expert group called different experts of {where} at once "
        f"({what}): under ep every rank calls every expert in the same order, with no rows "
        "if none are routed to it; remove the `if not rows: continue` from the block's loop over its experts")
