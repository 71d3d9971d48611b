"""docs/benchmarks.md's current tables are what benchmarks/docs_tables.py makes of the results JSON they name: a
table edited by hand, or a recorded run that changed without the doc, fails here with the difference.
The fix is `python benchmarks/docs_tables.py` (then read the lines beside the table: they may need the new run's
words)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _tables() -> ModuleType:
    spec = importlib.util.spec_from_file_location("docs_tables", ROOT / "benchmarks" / "docs_tables.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["docs_tables"] = module
    spec.loader.exec_module(module)
    return module


def test_every_generated_table_matches_its_json() -> None:
    tables = _tables()
    stale = tables.stale(tables.DOC.read_text())
    assert not stale, "run `python benchmarks/docs_tables.py`:\n\n" + "\n\n".join(stale)


def test_every_table_names_its_source_and_every_block_has_a_maker() -> None:
    tables = _tables()
    text = tables.DOC.read_text()
    blocks = {m["name"]: m["body"] for m in tables.BLOCK.finditer(text)}
    assert set(blocks) == set(tables.TABLES)
    for name, body in blocks.items():
        assert "Source: [benchmarks/results/" in body, name
        assert "| --- |" in body or "| ---: |" in body, f"{name} holds no table"


def test_a_block_edited_by_hand_is_caught_and_rewritten() -> None:
    tables = _tables()
    text = tables.DOC.read_text()
    edited = text.replace("| 1 | 4.72 |", "| 1 | 4.70 |", 1)
    assert edited != text, "the fault-recovery table no longer holds the row this test edits"
    stale = tables.stale(edited)
    assert len(stale) == 1 and stale[0].startswith("fault-recovery:")
    assert tables.render(edited) == tables.render(text)


def test_an_unknown_or_missing_block_is_refused() -> None:
    tables = _tables()
    text = tables.DOC.read_text()
    with pytest.raises(ValueError, match="without a generator"):
        tables.render(text + "\n<!-- generated: nothing -->\n<!-- end generated: nothing -->\n")
    start = text.index("<!-- generated: compile-cpu -->")
    end = text.index("<!-- end generated: compile-cpu -->") + len("<!-- end generated: compile-cpu -->")
    with pytest.raises(ValueError, match="generators without a block"):
        tables.render(text[:start] + text[end:])
