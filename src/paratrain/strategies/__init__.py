"""Every strategy in one table: name -> module holding its `STRATEGY`, imported when first asked for.

The presets that are one axis of the grammar on every worker (`ddp`, `fsdp`, `pp`) are served by the N-D strategy
(`nd`), as every other name of the grammar is; the one-process presets (`single`, `dp`, `mp`) and `ddp+mp` have
files of their own. Every layout is built by `parallel.parallelize`; dispatch on the strategy happens here once,
and facts about a strategy are asked of the object `get` returns (`Strategy`): nothing else branches on names.
"""

from __future__ import annotations

import importlib

from ..errors import unknown_name
from .base import Context, Strategy

TABLE: dict[str, str] = {
    "single": "single", "dp": "dp", "ddp": "nd", "fsdp": "nd",
    "mp": "mp", "pp": "nd", "ddp+mp": "ddp_mp",
}


def get(name: str) -> Strategy:
    """A preset by name, or an N-D strategy from the grammar ("fsdp+tp"; a preset's words in another order
    are that preset)."""
    if name not in TABLE:
        from ..parallel.dims import canonical, is_grammar

        if not is_grammar(name):
            raise unknown_name("strategy", name, TABLE)
        name = canonical(name)
    if TABLE.get(name, "nd") == "nd":
        nd: Strategy = importlib.import_module(f"{__name__}.nd").NDStrategy(name)
        return nd
    strategy: Strategy = importlib.import_module(f"{__name__}.{TABLE[name]}").STRATEGY
    return strategy


GRAMMAR_EXAMPLES = ("tp", "fsdp+tp", "ddp+tp", "ddp+fsdp", "ep", "cp")
"""N-D layouts of the grammar offered by name beside the presets (`paratrain bench --strategies all`); any other
name of the grammar is accepted too."""


def names() -> list[str]:
    return list(TABLE)


def offered() -> list[str]:
    """The presets, then the grammar's examples: every layout a tool lists when asked for all of them."""
    return [*TABLE, *GRAMMAR_EXAMPLES]


__all__ = ["Context", "GRAMMAR_EXAMPLES", "Strategy", "TABLE", "get", "names", "offered"]
