"""The simulators on cases with known answers: pipeline schedules from torch's own action lists,
DDP's bucketed all-reduce beside the backward, FSDP's gathers. Pure logic, no processes."""

from __future__ import annotations

import pytest

from paratrain.errors import ParatrainError
from paratrain.parallel.pipeline import simulate as S
from paratrain.planner import overlap


def _equal(k: int, forward: float = 1.0, backward: float = 2.0, **kw: float) -> list[S.StageCost]:
    return [S.StageCost(forward=forward, backward=backward, **kw) for _ in range(k)]


def _run(schedule: str, pp: int, micro: int, costs: list[S.StageCost], per_worker: int = 1,
         **kw: float) -> S.PipelineRun:
    order = S.pipeline_order(schedule, pp, per_worker, micro)
    return S.simulate(order, costs, S.stage_ranks(schedule, pp, per_worker), **kw)


@pytest.mark.parametrize("k,m", [(2, 1), (2, 4), (3, 5), (4, 8), (8, 3)])
def test_gpipe_with_equal_stages_gives_k_m_over_m_plus_k_minus_1(k: int, m: int) -> None:
    f, b = 0.7, 1.3
    run = _run("gpipe", k, m, _equal(k, f, b))
    one_device = m * k * (f + b)  # the whole model on one device: every stage's work, every micro-batch
    assert one_device / run.step == pytest.approx(k * m / (m + k - 1), rel=1e-12)
    assert run.bubble == pytest.approx((k - 1) / (m + k - 1), rel=1e-12)
    assert run.in_flight == [m] * k  # GPipe holds every micro-batch until the backward starts


@pytest.mark.parametrize("k,m", [(2, 2), (3, 4), (4, 8), (4, 16)])
def test_1f1b_has_gpipes_bubble_but_holds_at_most_k_minus_rank_micro_batches(k: int, m: int) -> None:
    run = _run("1f1b", k, m, _equal(k, 1.0, 2.0, activation_bytes=10.0))
    assert run.step == pytest.approx((m + k - 1) * 3.0, rel=1e-12)
    assert run.in_flight == [min(m, k - r) for r in range(k)]
    assert run.activation_peak == [10.0 * min(m, k - r) for r in range(k)]


def test_interleaved_1f1b_divides_the_bubble_by_the_stages_per_worker() -> None:
    pp, v, m = 4, 2, 8
    run = _run("interleaved-1f1b", pp, m, _equal(pp * v, 0.5, 1.0), per_worker=v)
    # Narayanan et al. (SC'21): bubble time (p-1)/v x (forward + backward of one device's share)
    assert run.step == pytest.approx(m * 3.0 + (pp - 1) / v * 3.0, rel=1e-12)


def test_zero_bubble_schedules_nearly_remove_the_bubble() -> None:
    pp, m = 4, 8
    one_f1b = _run("1f1b", pp, m, _equal(pp, 1.0, 2.0))
    zbv = _run("zero-bubble", pp, m, _equal(2 * pp, 0.5, 1.0, weight_share=0.5), per_worker=2)
    assert zbv.step < one_f1b.step
    assert zbv.bubble < 0.1 < one_f1b.bubble


def test_each_stage_runs_every_micro_batch_once_in_order() -> None:
    """torch's informational 1F1B order labels the last rank's forwards 1..M; the planner renumbers them."""
    for schedule, per_worker in [("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2), ("zero-bubble", 2),
                                 ("zero-bubble", 3)]:
        pp, m = 3, 6
        order = S.pipeline_order(schedule, pp, per_worker, m)
        for stage in range(pp * per_worker):
            for kind in {k for acts in order.values() for _, k, _ in acts}:
                seen = [mb for acts in order.values() for s, k, mb in acts if s == stage and k == kind]
                assert seen == list(range(m)), (schedule, stage, kind, seen)


def test_sends_between_ranks_lie_on_the_critical_path() -> None:
    costs = [S.StageCost(forward=1.0, backward=2.0, send=0.25), S.StageCost(forward=3.0, backward=4.0, send=0.0)]
    run = _run("gpipe", 2, 1, costs)
    assert run.step == pytest.approx(1.0 + 0.25 + 3.0 + 4.0 + 0.25 + 2.0)
    assert run.comm_wait == pytest.approx(0.25)  # the busiest rank (1) waits for its input's send
    # Two micro-batches: rank 1 runs F0 F1 B0 B1 back to back from 1.25 s; B1's gradient reaches rank 0 at 15.5 s.
    assert _run("gpipe", 2, 2, costs).step == pytest.approx(15.5 + 2.0)
    # A CPU worker (overlap 0) spends its sends itself: rank 1 sends B0's gradient before it can start B1.
    assert _run("gpipe", 2, 2, costs, overlap=0.0).step == pytest.approx(15.75 + 2.0)


@pytest.mark.parametrize("schedule,per_worker", [("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2),
                                                  ("zero-bubble", 2)])
def test_long_schedules_extrapolate_exactly_from_their_steady_state(schedule: str, per_worker: int) -> None:
    pp, m = 4, 128
    costs = [S.StageCost(forward=0.1 * (1 + s % 3), backward=0.25 * (1 + s % 2), activation_bytes=1.0, send=0.01)
             for s in range(pp * per_worker)]
    exact = _run(schedule, pp, m, costs, per_worker=per_worker)
    line = S.run_schedule(schedule, pp, per_worker, m, costs)
    assert m > S.EXACT_UP_TO
    assert line.step == pytest.approx(exact.step, rel=1e-9)
    assert line.busy == pytest.approx(exact.busy, rel=1e-9)
    assert line.in_flight == exact.in_flight


def test_a_schedule_torch_refuses_is_refused_with_the_fix() -> None:
    with pytest.raises(ParatrainError, match="unknown schedule 'zigzag'"):
        S.pipeline_order("zigzag", 2, 1, 4)
    with pytest.raises(ParatrainError, match="micro-batches"):
        S.pipeline_order("1f1b", 4, 1, 2)


def test_ddp_hides_all_but_the_last_buckets_all_reduce() -> None:
    # 4 layers, 1 s of backward each, 2 MiB of gradients each; first bucket 1 MiB, then 4 MiB buckets.
    mib = 1024**2
    out = overlap.ddp_backward([1.0] * 4, [2 * mib] * 4, all_reduce=lambda n: n / mib * 0.1, bucket=4 * mib, first=mib)
    # buckets: [layer 3] ready at 1 s, [layers 2, 1] ready at 3 s, [layer 0] ready at 4 s; 0.2-0.4 s each
    assert out.compute == pytest.approx(4.0)
    assert out.comm == pytest.approx(0.2 + 0.4 + 0.2)
    assert out.end == pytest.approx(4.2)
    assert out.exposed == pytest.approx(0.2)
    serial = overlap.ddp_backward([1.0] * 4, [2 * mib] * 4, all_reduce=lambda n: n / mib * 0.1, overlap=0.0,
                            bucket=4 * mib, first=mib)
    assert serial.end == pytest.approx(4.0 + 0.8)  # nothing hides on a CPU worker


def test_fsdp_prefetch_hides_gathers_behind_the_previous_unit() -> None:
    forward, backward, units = [1.0, 1.0, 1.0], [2.0, 2.0, 2.0], [1.0, 1.0, 1.0]
    out = overlap.fsdp_step(forward, backward, units, all_gather=lambda n: 0.5, reduce_scatter=lambda n: 0.5)
    # Only the first gather waits; the last unit's reduce-scatter runs after the compute has ended.
    assert out.compute == pytest.approx(9.0)
    assert out.comm == pytest.approx(6 * 0.5 + 3 * 0.5)
    assert out.end == pytest.approx(0.5 + 9.0 + 0.5)
    serial = overlap.fsdp_step(forward, backward, units, lambda n: 0.5, lambda n: 0.5, overlap=0.0)
    assert serial.end == pytest.approx(9.0 + 4.5)
    quiet = overlap.fsdp_step(forward, backward, units, lambda n: 0.5, lambda n: 0.5, overlap=0.0, sync=False)
    assert quiet.comm == pytest.approx(6 * 0.5)  # no reduce-scatter inside an accumulation window
