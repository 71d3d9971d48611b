"""The documentation's code runs: every ```python block of README.md and docs/*.md is run here, or is marked as a
fragment on the line before its fence. The markers and the preambles are described in tests/docs_preambles/README.md:

    <!-- fragment -->                                          not run (a listing of calls, a class sketch)
    <!-- run-with: nproc=2 -->                                 run on 2 workers (paratrain.launch)
    <!-- run-with: tests/docs_preambles/NAME.py nproc=2 -->    run after a preamble that defines what it uses

A block without a marker runs as it is, in one process. Each block runs in a folder of its own (its checkpoints,
logs and data files land there), on workers forked from the suite's warm template, so a block costs its own work.
"""

from __future__ import annotations

import ast
import re
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^(?P<indent> *)```python\s*$")
MARKER = re.compile(r"^\s*<!--\s*(?P<what>fragment|run-with:(?P<spec>[^>]*?))\s*-->\s*$")
TIMEOUT_S = 90



@dataclass(frozen=True)
class Block:
    document: str
    line: int
    """1-based line of the block's first line of code."""
    source: str
    marker: str | None
    """'fragment', the text after 'run-with:', or None."""

    @property
    def name(self) -> str:
        return f"{self.document}:{self.line}"

    @property
    def runs(self) -> bool:
        return self.marker != "fragment"

    def spec(self) -> tuple[list[Path], int]:
        """(preambles, workers) from the marker."""
        preambles, nproc = [], 1
        for word in (self.marker or "").split():
            if word.startswith("nproc="):
                nproc = int(word.removeprefix("nproc="))
            else:
                preambles.append(ROOT / word)
        return preambles, nproc


def blocks() -> list[Block]:
    found = []
    for path in DOCUMENTS:
        lines = path.read_text().splitlines()
        i = 0
        while i < len(lines):
            fence = FENCE.match(lines[i])
            if fence is None:
                i += 1
                continue
            end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
            marked = MARKER.match(lines[i - 1]) if i else None
            marker = None
            if marked is not None:
                marker = "fragment" if marked["what"] == "fragment" else marked["spec"].strip()
            source = textwrap.dedent("\n".join(lines[i + 1 : end])) + "\n"
            found.append(Block(str(path.relative_to(ROOT)), i + 2, source, marker))
            i = end + 1
    return found


BLOCKS = blocks()


def test_every_block_is_runnable_or_marked_and_every_marker_is_valid() -> None:
    assert len(BLOCKS) > 10, "the block scanner found too few ```python blocks"
    for block in BLOCKS:
        if block.runs:
            preambles, nproc = block.spec()
            missing = [str(p) for p in preambles if not p.is_file()]
            assert not missing, f"{block.name}: preambles that do not exist: {missing}"
            assert 1 <= nproc <= 2, f"{block.name}: nproc={nproc}; the docs' blocks run on at most 2 workers here"
    runnable = {b.name for b in BLOCKS if b.runs}
    for required in ("README.md", "docs/usage.md"):
        assert any(name.startswith(required + ":") for name in runnable), f"no block of {required} runs"


def write_files(folder: str, preambles: list[tuple[str, str]]) -> None:
    """In a worker (its imports are warm): each preamble's imports and function definitions, then its
    `files(folder)` if it has one."""
    for path, text in preambles:
        tree = ast.parse(text, path)
        tree.body = [n for n in tree.body if isinstance(n, ast.Import | ast.ImportFrom | ast.FunctionDef)]
        namespace: dict[str, Any] = {"__name__": "docs_preamble"}
        exec(compile(tree, path, "exec"), namespace)
        if "files" in namespace:
            namespace["files"](Path(folder))


def run_block(folder: str, preambles: list[tuple[str, str]], source: str, name: str, line: int) -> None:
    """In a worker: the preambles, then the block, in one namespace, in the block's folder. Tracebacks show the
    document's own line numbers."""
    import os

    os.chdir(folder)
    namespace: dict[str, Any] = {"__name__": "__main__"}
    for path, text in preambles:
        exec(compile(text, path, "exec"), namespace)
    exec(compile("\n" * (line - 1) + source, name, "exec"), namespace)


@pytest.mark.procs
@pytest.mark.timeout(TIMEOUT_S + 30)
@pytest.mark.parametrize("block", [b for b in BLOCKS if b.runs], ids=lambda b: b.name)
def test_block_runs(block: Block, tmp_path: Path) -> None:
    import paratrain

    preambles, nproc = block.spec()
    texts = [(str(p.relative_to(ROOT)), p.read_text()) for p in preambles]
    if any("def files(" in text for _, text in texts):
        paratrain.launch(write_files, str(tmp_path), texts, nproc=1, timeout=TIMEOUT_S, accelerator="cpu")
    try:
        paratrain.launch(run_block, str(tmp_path), texts, block.source, str(ROOT / block.document), block.line,
                         nproc=nproc, timeout=TIMEOUT_S, accelerator="cpu")
    except Exception as exc:
        raise AssertionError(
            f"{block.name} does not run ({type(exc).__name__}: {exc}); fix it, give it a preamble "
            "(<!-- run-with: tests/docs_preambles/NAME.py -->), or mark it <!-- fragment --> on the line before "
            "its fence") from exc
