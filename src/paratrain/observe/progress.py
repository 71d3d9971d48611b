"""A tqdm progress bar on stderr that stays out of the way: shown only on a terminal unless asked for,
and lines printed while it is shown go above it instead of through it."""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Iterator
from typing import IO, Any


def wanted(show: bool | None, stream: IO[str] | None = None) -> bool:
    """`show`, or when None whether `stream` (stderr) is a terminal."""
    if show is not None:
        return show
    stream = stream if stream is not None else sys.stderr
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


class Bar:
    """A bar counting to `total` (unknown: a counter without ETA); inert when not shown."""

    def __init__(self, show: bool | None, *, total: int | None = None, initial: int = 0, unit: str = "step",
                 desc: str | None = None) -> None:
        self._bar: Any = None
        if wanted(show):
            from tqdm import tqdm

            self._bar = tqdm(total=total, initial=initial, unit=unit, desc=desc, file=sys.stderr,
                             dynamic_ncols=True, smoothing=0.1)

    @property
    def shown(self) -> bool:
        return self._bar is not None

    def advance(self, to: int | None = None, by: int = 0, total: int | None = None, postfix: str = "") -> None:
        """Move to position `to` (or `by` forward), with a new total (for the ETA) and text after the bar."""
        if self._bar is None:
            return
        if total is not None and total != self._bar.total:
            self._bar.total = total
        if postfix:
            self._bar.set_postfix_str(postfix, refresh=False)
        step = (to - self._bar.n) if to is not None else by
        if step > 0:
            self._bar.update(step)
        else:
            self._bar.refresh()

    @contextlib.contextmanager
    def outside(self) -> Iterator[None]:
        """Print inside this block without breaking the bar (it is cleared, then redrawn below)."""
        if self._bar is None:
            yield
            return
        from tqdm import tqdm

        with tqdm.external_write_mode():  # clears bars on stderr too when printing to stdout
            yield

    @contextlib.contextmanager
    def above(self) -> Iterator[None]:
        """Everything printed to stdout inside the block, from any thread (a launcher forwarding its workers'
        lines), goes above the bar a whole line at a time; the bar is closed at the end."""
        if self._bar is None:
            yield
            return
        lines = _Lines(sys.stdout)
        try:
            with contextlib.redirect_stdout(lines):  # type: ignore[type-var]
                yield
        finally:
            lines.write("\n" if lines.pending else "")
            self.close()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


class _Lines:
    """stdout while a bar is shown: complete lines are written with the bar cleared and then redrawn (a bar
    redrawn after half a line would be wiped together with it)."""

    def __init__(self, stream: IO[str]) -> None:
        self.stream = stream
        self.pending = ""
        self._lock = threading.Lock()

    def write(self, text: str) -> int:
        from tqdm import tqdm

        with self._lock:
            self.pending += text
            if "\n" in self.pending:
                done, _, self.pending = self.pending.rpartition("\n")
                with tqdm.external_write_mode():
                    self.stream.write(done + "\n")
                    self.stream.flush()
        return len(text)

    def flush(self) -> None:
        self.stream.flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)
