"""Two timed samples compared with their uncertainty: a ratio of step times, its 95% bootstrap interval, and
the words the bench prints for it.

On a shared machine a step's time moves by 10-20% from one second to the next, more than the few per cent a
comparison is about, so a ratio of two medians alone states noise as fact. The sides of a comparison are
therefore timed in the same rounds (A B B A, step by step: the i-th step of one beside the i-th of the other),
and compared pair by pair: the ratio is the median of the paired ratios, a slow spell falls on both steps of a
pair and divides out, and the interval comes from resampling the pairs. (On a simulated machine drifting 5% a
step, 15 pairs: this interval is 8% wide and holds the true ratio 94% of the time; resampling the pairs for a
ratio of medians gives one 13% wide.) Samples timed apart (a layout and a `single` of another launch) compare by
their medians, each resampled on its own. The resampling draws from a fixed seed, so the same steps always give
the same interval.

A verdict ("slower", "faster") is given only when the interval excludes 1.0; otherwise the comparison is within
noise, and says how wide the noise is. A speedup is read against its bound the same way: one whose interval
reaches the bound is at its bound within noise, never "112% of its bound".
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

import torch

LEVEL = 0.95
DRAWS = 2000
SEED = 0
MIN_SAMPLES = 5
"""Fewer steps than this give no interval: a bootstrap of 3 pairs only repeats them."""

__all__ = ["LEVEL", "Ratio", "against_bound", "paired_ratio", "ratio_of_medians", "verdict"]


@dataclass(frozen=True)
class Ratio:
    """A ratio of step times (a paired ratio's median, or a ratio of medians) with its 95% interval (None: too few
    steps for one)."""

    value: float
    low: float | None
    high: float | None
    paired: bool
    samples: int

    @property
    def interval(self) -> list[float] | None:
        """[low, high], rounded, as results.json holds it."""
        return None if self.low is None or self.high is None else [round(self.low, 4), round(self.high, 4)]

    @property
    def noise(self) -> float | None:
        """Half the interval's width as a fraction of the ratio: the ± a comparison cannot see through."""
        return None if self.low is None or self.high is None else (self.high - self.low) / 2 / self.value

    def text(self) -> str:
        """`1.050, 95% CI 1.031-1.072`."""
        if self.low is None or self.high is None:
            return f"{self.value:.3f}, no interval from {self.samples} step(s)"
        return f"{self.value:.3f}, {LEVEL:.0%} CI {self.low:.3f}-{self.high:.3f}"


def _bootstrap(resampled: torch.Tensor) -> tuple[float, float]:
    """The central 95% of the resampled statistic (percentile bootstrap)."""
    tail = (1 - LEVEL) / 2
    low, high = resampled.quantile(torch.tensor([tail, 1 - tail], dtype=torch.float64)).tolist()
    return low, high


def _picks(n: int, draws: int, g: torch.Generator) -> torch.Tensor:
    return torch.randint(n, (draws, n), generator=g)


def paired_ratio(a: Sequence[float], b: Sequence[float], draws: int = DRAWS, seed: int = SEED) -> Ratio:
    """The median of the paired ratios a[i] / b[i] (a[i] and b[i] timed in one round), and its interval from
    resampling the pairs: what the bench reports, since each pair's own drift divides out of its ratio."""
    if len(a) != len(b) or not a:
        raise ValueError(f"paired steps: {len(a)} against {len(b)}; a pair needs one step of each side")
    ratios = torch.tensor([x / y for x, y in zip(a, b)], dtype=torch.float64)
    value = statistics.median(ratios.tolist())
    if len(a) < MIN_SAMPLES:
        return Ratio(value, None, None, True, len(a))
    g = torch.Generator().manual_seed(seed)
    low, high = _bootstrap(ratios[_picks(len(a), draws, g)].quantile(0.5, dim=1))
    return Ratio(value, low, high, True, len(a))


def ratio_of_medians(a: Sequence[float], b: Sequence[float], *, paired: bool, draws: int = DRAWS,
                     seed: int = SEED) -> Ratio:
    """median(a) / median(b) and its interval. `paired`: a[i] and b[i] were timed together and are resampled
    together; else (samples timed apart) each is resampled on its own."""
    if not a or not b or (paired and len(a) != len(b)):
        raise ValueError(f"cannot compare {len(a)} step(s) with {len(b)}" + (" in pairs" if paired else ""))
    value = statistics.median(a) / statistics.median(b)
    if min(len(a), len(b)) < MIN_SAMPLES:
        return Ratio(value, None, None, paired, min(len(a), len(b)))
    x, y = torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64)
    g = torch.Generator().manual_seed(seed)
    picks_a = _picks(len(a), draws, g)
    picks_b = picks_a if paired else _picks(len(b), draws, g)
    low, high = _bootstrap(x[picks_a].quantile(0.5, dim=1) / y[picks_b].quantile(0.5, dim=1))
    return Ratio(value, low, high, paired, min(len(a), len(b)))


def verdict(r: Ratio) -> str:
    """`slower (x1.050, 95% CI 1.031-1.072)` for a ratio of times whose interval lies above 1.0, `faster (...)`
    below it, else `within noise (±3.2%; x1.012, 95% CI 0.981-1.046)`."""
    if r.low is None or r.high is None:
        return f"not judged (x{r.text()})"
    if round(r.low, 3) > 1:  # as printed: no "slower" beside an interval shown from 1.000
        return f"slower (x{r.text()})"
    if round(r.high, 3) < 1:
        return f"faster (x{r.text()})"
    return f"within noise (±{r.noise:.1%}; x{r.text()})"


def against_bound(speedup: Ratio, bound: float) -> str:
    """A speedup read against the best its layout allows: `87% of its bound 1.78x`, with `(the bound within the
    noise)` when the interval reaches it; a speedup past its bound whose interval still reaches it is `at its bound
    1.60x within noise`, and one whose whole interval is past it is flagged: a bound is a ceiling, so what passes
    it is the measurement (the one-worker baseline, or caches a worker alone does not have), not the layout."""
    share = f"{speedup.value / bound:.0%} of its bound {bound:.2f}x"
    if speedup.low is None or speedup.high is None:
        return f"{share} (no interval)" if speedup.value <= bound else \
            f"past its bound {bound:.2f}x, from too few steps to tell from noise"
    low, high, value, bound = (round(x, 2) for x in (speedup.low, speedup.high, speedup.value, bound))  # as printed
    if low > bound:
        return (f"above its bound {bound:.2f}x by more than the noise: a bound is a ceiling, so the excess is the "
                f"measurement's (a slow one-worker baseline, or caches that favour the smaller shares)")
    if value > bound:
        return f"at its bound {bound:.2f}x within noise"
    return f"{share} (the bound within the noise)" if high >= bound else share
