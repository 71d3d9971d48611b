"""The architecture's rules, checked: strategies load lazily from one table, no strategy module imports
another, the micro-step needs no forward hooks, the optimizer is never re-pointed after prepare, and
docs/architecture.md names every module."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

from paratrain import strategies
from paratrain.config import STRATEGY_NAMES

SRC = Path(__file__).resolve().parents[1] / "src" / "paratrain"
ARCHITECTURE = SRC.parents[1] / "docs" / "architecture.md"


@pytest.mark.procs
def test_import_loads_no_strategy_module_until_one_is_asked_for() -> None:
    code = ("import sys, paratrain; print(sorted(m for m in sys.modules if m.startswith('paratrain.strategies.'))); "
            "paratrain.strategies.get('pp'); print(sorted(m for m in sys.modules "
            "if m.startswith('paratrain.strategies.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    before, after = out.stdout.splitlines()
    assert before == "[]"  # `import paratrain` imports neither strategies nor torch (see the next test)
    assert after == "['paratrain.strategies.base', 'paratrain.strategies.nd']"  # pp: one axis of the grammar


@pytest.mark.procs
def test_the_command_line_refuses_bad_flags_without_importing_torch() -> None:
    code = ("import sys, paratrain, paratrain.cli, paratrain.runtime, paratrain.launcher.cluster, "
            "paratrain.launcher.cli_run; print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "False", out.stderr


def test_one_table_lists_every_strategy_the_config_accepts() -> None:
    from paratrain.parallel.dims import is_grammar

    # presets with a file of their own, and presets the N-D strategy serves (their words read by the grammar)
    assert set(strategies.TABLE) <= set(STRATEGY_NAMES)
    assert {n for n in STRATEGY_NAMES if n not in strategies.TABLE} == {"ddp+pp"}
    assert all(is_grammar(n) for n in STRATEGY_NAMES if n not in strategies.TABLE)
    for name in STRATEGY_NAMES:
        strategy = strategies.get(name)
        assert strategy.name == name
        for member in ("needs_process_group", "sharded_state", "microbatched", "scheduled", "comm_hooks"):
            assert isinstance(getattr(strategy, member), bool), (name, member)
        assert isinstance(strategy.axes, tuple) and strategy.in_process in (None, "stages", "replicas"), name
        assert not hasattr(strategy, "wrap"), name  # every layout is built by parallel.parallelize alone


def test_one_build_path_and_the_planner_asks_the_strategy_its_facts() -> None:
    from paratrain.planner.layout import Layout

    assert [strategies.TABLE[n] for n in ("ddp", "fsdp", "pp")] == ["nd"] * 3  # the grammar's one-axis layouts
    for name, processes, pipelined, scheduled in (("mp", 1, True, False), ("pp", 2, True, True),
                                                  ("ddp", 2, False, False), ("fsdp+tp", 4, False, False)):
        layout = Layout(strategy=name, dims=strategies.get(name).degrees(_config(name), processes)) if name != "mp" \
            else Layout(strategy=name, pp=2)
        assert (layout.processes, layout.pipelined, layout.scheduled) == (processes, pipelined, scheduled), name
    assert Layout(strategy="ddp", dp=2).grammar is False and Layout(strategy="ddp+tp", dp=2, tp=2).grammar is True
    assert "DEVICES_OF_ONE_PROCESS" not in (SRC / "planner" / "layout.py").read_text()  # no name list of a fact


def _config(name: str) -> object:
    from paratrain.config import make_config

    return make_config({"strategy": name, **({"tp_size": 2} if "tp" in name else {})})


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


def _imported(path: Path) -> set[str]:
    """Every paratrain module a file imports, at its top or inside a function, as absolute names."""
    package = ".".join(path.relative_to(SRC.parent).with_suffix("").parts[:-1])
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level else ""
            name = ".".join(filter(None, [base, node.module or ""]))
            out |= {name} | {f"{name}.{alias.name}" for alias in node.names}
        elif isinstance(node, ast.Import):
            out |= {alias.name for alias in node.names}
    return {name for name in out if name.startswith("paratrain")}


@pytest.mark.parametrize("package,other", [("planner", "bench"), ("bench", "planner")])
def test_bench_and_planner_do_not_import_each_other(package: str, other: str) -> None:
    """What both need (workloads, the timing harness, the schedule table) lives in measure/ and parallel/."""
    found = {f"{p.relative_to(SRC)}: {name}" for p in (SRC / package).glob("*.py") for name in _imported(p)
             if name == f"paratrain.{other}" or name.startswith(f"paratrain.{other}.")}
    assert not found, sorted(found)


def test_bench_and_planner_branch_on_no_strategy_name() -> None:
    """They read what a strategy says of itself (its members, its dims), so a new layout needs no edit there."""
    found = [f"{p.relative_to(SRC)}:{i}" for package in ("bench", "planner") for p in (SRC / package).glob("*.py")
             for i, line in enumerate(p.read_text().splitlines(), 1)
             if "strategy.name ==" in line or 'name == "ddp' in line]
    assert not found, found


def test_one_schedule_table() -> None:
    """The schedules the config accepts are the table's (and "auto"); torch's schedule classes are named only
    there (and in the bench's hand-written reference, which must not use paratrain's code)."""
    from paratrain.config import SCHEDULES
    from paratrain.parallel.pipeline import schedules

    assert tuple(SCHEDULES) == (*schedules.NAMES, "auto")
    classes = {row.torch_name for row in schedules.ROWS} | {row.v_torch_name for row in schedules.ROWS} - {None}
    allowed = {SRC / "parallel" / "pipeline" / "schedules.py", SRC / "bench" / "references.py"}
    found = [f"{p.relative_to(SRC)}: {c}" for p in SRC.rglob("*.py") if p not in allowed for c in classes
             if c and c in p.read_text()]
    assert not found, found


def test_forwards_are_replaced_in_one_place() -> None:
    """A module instance's forward is replaced only through paratrain/_forwards.py, which records why."""
    found = [f"{p.relative_to(SRC)}:{i}" for p in SRC.rglob("*.py") if p.name != "_forwards.py"
             for i, line in enumerate(p.read_text().splitlines(), 1) if ".forward = " in line]
    assert not found, found


def test_parallel_keeps_no_module_level_state_but_the_active_run() -> None:
    """Step state lives in one object per run (parallel/step_state.py): no module of parallel/ rebinds a global
    (`global x`), keeps a registry (a module-level empty dict, list or set that fills up) or a module-level
    instance of its own state class, except the one pointer to the active run's state."""
    found = []
    for path in (SRC / "parallel").rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Global) and path.name != "step_state.py":
                found.append(f"{path.relative_to(SRC)}:{node.lineno} global {', '.join(node.names)}")
        classes = {n.name for n in tree.body if isinstance(n, ast.ClassDef)}
        for node in tree.body:
            value = node.value if isinstance(node, ast.Assign | ast.AnnAssign) else None
            if (isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id in classes
                    and path.name != "step_state.py"):
                found.append(f"{path.relative_to(SRC)}:{node.lineno} a module-level {value.func.id}")
            empty = (isinstance(value, ast.Dict | ast.List | ast.Set) and not getattr(value, "keys", None)
                     and not getattr(value, "elts", None)) or (
                isinstance(value, ast.Call) and isinstance(value.func, ast.Name)
                and value.func.id in ("dict", "list", "set", "defaultdict") and not value.args)
            if empty:
                found.append(f"{path.relative_to(SRC)}:{node.lineno} a module-level container")
    assert not found, found


def test_a_replaced_forward_is_recorded_and_undone() -> None:
    from torch import nn

    from paratrain import _forwards
    from paratrain.precision import apply_autocast

    model = nn.Linear(2, 2)
    apply_autocast(model, "bf16", "cpu")
    _forwards.replace(model, lambda x: x, "a test's")
    assert _forwards.replaced(model) == ["autocast bf16", "a test's"]
    with _forwards.own_forwards([model]):
        assert "forward" not in model.__dict__
    _forwards.restore(model)
    _forwards.restore(model)
    assert _forwards.replaced(model) == [] and "forward" not in model.__dict__


def test_every_module_is_named_in_the_architecture_doc() -> None:
    """docs/architecture.md is where a newcomer looks up a file's one job, so it must name every module."""
    text = ARCHITECTURE.read_text()
    fence = re.compile(r"^```.*?^```", flags=re.S | re.M)  # a fenced block (the data-path diagram) is one span
    spans = fence.findall(text) + re.findall(r"`[^`]*`", fence.sub("", text))
    missing = sorted(str(p.relative_to(SRC)) for p in SRC.rglob("*.py") if p.name != "__init__.py"
                     and not any(re.search(rf"(?<!\w){re.escape(p.stem)}(?!\w)", span) for span in spans))
    assert not missing, f"modules docs/architecture.md does not name in backticks: {missing}"


def _module_imports() -> dict[str, set[str]]:
    """Each module of src/paratrain and the modules it imports when it is imported (module level, outside
    `if TYPE_CHECKING`): the imports that can form a circle. Imports inside functions run later and cannot."""
    modules = {}
    for path in SRC.rglob("*.py"):
        parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    edges: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        for node in _run_on_import(ast.parse(path.read_text()).body):
                if isinstance(node, ast.Import):
                    edges[name] |= {a.name for a in node.names if a.name in modules}
                    continue
                base = ".".join(package[: len(package) - node.level + 1] + [node.module or ""]).strip(".") \
                    if node.level else node.module or ""
                for alias in node.names:
                    target = f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                    if target in modules and target != name:
                        edges[name].add(target)
    return edges


def _run_on_import(body: list[ast.stmt]) -> list[ast.Import | ast.ImportFrom]:
    """The import statements a module runs when it is imported: at its top level, in its `if`/`try`/`with` blocks
    (not under `if TYPE_CHECKING`), not in its functions."""
    found: list[ast.Import | ast.ImportFrom] = []
    for stmt in body:
        if isinstance(stmt, ast.Import | ast.ImportFrom):
            found.append(stmt)
        elif isinstance(stmt, ast.If) and "TYPE_CHECKING" not in ast.unparse(stmt.test):
            found += _run_on_import(stmt.body) + _run_on_import(stmt.orelse)
        elif isinstance(stmt, ast.Try):
            found += _run_on_import(stmt.body + stmt.orelse + stmt.finalbody
                                    + [s for h in stmt.handlers for s in h.body])
        elif isinstance(stmt, ast.With):
            found += _run_on_import(stmt.body)
    return found


def test_no_import_circle_in_the_library() -> None:
    edges = _module_imports()
    assert len(edges) > 100 and edges["paratrain.parallel.parallelize"]  # the walk found the modules and imports
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(name: str, path: list[str]) -> None:
        state[name] = 1
        for other in sorted(edges[name]):
            assert state.get(other) != 1, "import circle: " + " -> ".join([*path, name, other])
            if other not in state:
                visit(other, [*path, name])
        state[name] = 2

    for name in sorted(edges):
        if name not in state:
            visit(name, [])


def test_no_module_imports_another_modules_private_names() -> None:
    """A private name stays in its module: one that two modules need is public in one of them (the bench's
    references share `build_model`, `train_loop`, `share_rows`). Private modules (`_forwards`) are imported whole."""
    found = []
    for path in SRC.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level >= 1 and node.module is not None:
                private = [a.name for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]
                if private and not node.module.split(".")[-1].startswith("_"):
                    found.append(f"{path.relative_to(SRC)}: from {node.module} import {', '.join(private)}")
    assert not found, found
