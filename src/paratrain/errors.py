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


def unknown_name(kind: str, name: str, known: Iterable[str]) -> ParatrainError:
    known = sorted(known)
    close = difflib.get_close_matches(name, known, n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    return ParatrainError(f"unknown {kind} {name!r}.{hint} Choose one of: {', '.join(known)}.")
