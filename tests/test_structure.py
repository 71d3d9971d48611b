"""The architecture's rules, checked: strategies load lazily from one table, no strategy module imports
another, the micro-step needs no forward hooks, and the optimizer is never re-pointed after prepare."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from paratrain import strategies
from paratrain.config import STRATEGY_NAMES

SRC = Path(__file__).resolve().parents[1] / "src" / "paratrain"


@pytest.mark.procs
def test_import_loads_no_strategy_module_until_one_is_asked_for() -> None:
    code = ("import sys, paratrain; print(sorted(m for m in sys.modules if m.startswith('paratrain.strategies.'))); "
            "paratrain.strategies.get('pp'); print(sorted(m for m in sys.modules "
            "if m.startswith('paratrain.strategies.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    before, after = out.stdout.splitlines()
    assert before == "['paratrain.strategies.base']"
    assert after == "['paratrain.strategies.base', 'paratrain.strategies.pp']"


def test_one_table_lists_every_strategy_the_config_accepts() -> None:
    assert tuple(strategies.TABLE) == STRATEGY_NAMES
    for name in STRATEGY_NAMES:
        strategy = strategies.get(name)
        assert strategy.name == name
        for member in ("needs_process_group", "sharded_state", "microbatched", "scheduled"):
            assert isinstance(getattr(strategy, member), bool), (name, member)


def test_no_strategy_module_imports_another() -> None:
    modules = {p.stem for p in (SRC / "strategies").glob("*.py")} - {"__init__", "base"}
    for path in (SRC / "strategies").glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                names = {node.module} if node.module else {a.name for a in node.names}
                assert not names & modules, f"{path.name} imports strategy module(s) {names & modules}"


def test_no_forward_hooks_and_no_late_rebinding_in_the_library() -> None:
    for path in SRC.rglob("*.py"):
        text = path.read_text()
        for banned in ("register_forward_pre_hook", "_rebind_later", "getattr(self.strategy, \"sharded_state\""):
            assert banned not in text, f"{path.relative_to(SRC)} uses {banned}"
