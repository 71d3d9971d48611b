"""Errors paratrain raises for bad input: each message names the fix, so a user never has to guess."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class ParatrainError(RuntimeError):
    """A configuration or launch problem detected before (or instead of) a hang."""


class CheckpointError(ParatrainError):
    """A checkpoint is missing, incomplete or corrupt."""


class CollectiveTimeout(ParatrainError):
    """A collective did not complete because some ranks never arrived."""


class RefusedOnRank(ParatrainError):
    """A refusal one rank raised ("rank 1: ..."), raised word for word on every rank (`paratrain.agreement`)."""


def unknown_name(kind: str, name: str, known: Iterable[str]) -> ParatrainError:
    known = sorted(known)
    close = difflib.get_close_matches(name, known, n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    return ParatrainError(f"unknown {kind} {name!r}.{hint} Choose one of: {', '.join(known)}.")


_MARKERS = ("timed out", "connection closed", "connection reset", "broken pipe", "gloo", "nccl",
            "processgroup", "socket", "peer")


def is_comm_failure(exc: BaseException) -> bool:
    """True for errors a collective raises when a peer is missing, dead or diverged."""
    import torch.distributed as dist

    if isinstance(exc, getattr(dist, "DistError", ())):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(m in text for m in _MARKERS)
