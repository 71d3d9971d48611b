"""Strategy registry: names map to small objects implementing `base.Strategy`; dispatch happens here once."""

from __future__ import annotations

from ..errors import unknown_name
from .base import Context, Strategy
from .ddp import STRATEGY as _ddp
from .dp import STRATEGY as _dp
from .single import STRATEGY as _single

REGISTRY: dict[str, Strategy] = {s.name: s for s in (_single, _dp, _ddp)}


def register(strategy: Strategy) -> None:
    REGISTRY[strategy.name] = strategy


def get(name: str) -> Strategy:
    _load_optional()
    if name not in REGISTRY:
        raise unknown_name("strategy", name, REGISTRY)
    return REGISTRY[name]


def names() -> list[str]:
    _load_optional()
    return sorted(REGISTRY)


def _load_optional() -> None:
    """Strategies whose modules pull in heavier torch subsystems register on first use."""
    import importlib

    for module in ("fsdp", "mp", "pp", "hybrid"):
        try:
            importlib.import_module(f"{__name__}.{module}")
        except ModuleNotFoundError as exc:
            if exc.name != f"{__name__}.{module}":
                raise


__all__ = ["Context", "Strategy", "REGISTRY", "get", "names", "register"]
