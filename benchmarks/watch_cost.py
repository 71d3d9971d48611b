"""What the heartbeat thread (faults/watch.py) costs a training step: the time of one heartbeat (read the
main thread's frame, write one key to the job's store) over the interval between heartbeats. At the
default timeout (600 s) a rank beats every 2 s; the shortest interval is 50 ms (timeout 0.5 s).

Usage: OMP_NUM_THREADS=1 python benchmarks/watch_cost.py [OUT.json]
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from _emit import emit  # benchmarks/ is the script's folder, first on sys.path

import paratrain

BEATS = 400


def _time_beats() -> dict[str, Any]:
    run = paratrain.setup(strategy="ddp", timeout_s=600)
    watch = run._watch  # the rank's running watch: time what its thread does once per interval
    samples = []
    for _ in range(BEATS):
        start = time.perf_counter()
        watch.publish()
        samples.append(time.perf_counter() - start)
    beat = statistics.median(samples)
    out = {"beat_s": beat, "interval_s": watch.interval, "share_of_a_core": beat / watch.interval,
           "share_at_shortest_interval": beat / 0.05}
    run.close()
    return out


def main() -> None:
    res = paratrain.launch(_time_beats, nproc=2, timeout=120, all_ranks=True)
    out = {"ranks": res,
           "worst_share_of_a_core": max(r["share_of_a_core"] for r in res)}
    emit(out)


if __name__ == "__main__":
    main()
