"""Mixtures of experts: which modules they are (`find`), experts split over ranks with tokens sent to them
(`apply`, `dispatch`: the `ep` axis of a strategy), and router statistics over the global batch under any layout
(`router_stats`)."""

from __future__ import annotations

from .router_stats import global_rows

__all__ = ["global_rows"]
