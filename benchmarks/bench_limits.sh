#!/usr/bin/env bash
# How close each strategy gets to what this machine allows (docs/benchmarks.md, section H), ending with
# DIR/summary.md: each goal met or not, and the measured reason when not (benchmarks/limits_report.py).
# Usage: bash benchmarks/bench_limits.sh [--quick] OUTDIR
#   --quick (make limits): about 4 minutes on 2 cores, fewer repeats and configurations
#   full: about 15 minutes, the runs section H quotes
#   ddp/      mlp-wide (gradients dominate): ddp with torch's settings, comm_hook=auto, and lossy bf16 (fp16)
#   sched/    mlp: pp with 1f1b, zero-bubble, (interleaved-1f1b,) schedule=auto over M; quick: with ddp, so
#             the same run gives the no-communication ceiling and both overhead ratios
#   overhead/ (full) mlp: ddp and pp against hand-written torch, 8 alternated blocks
#   four/     mlp: pp on 4 workers beside ddp and the no-communication ceiling on 4 workers
#   microbatch_cost.json: one worker, the batch cut into M pieces, no pipeline (the CPU GEMM effect)
#   schedule_search.json: schedule="auto" against a full sweep of (schedule, micro-batch count)
#   watch_cost.json: the heartbeat thread's share of a core
#   allreduce_cost.json: a 34 MB gloo all-reduce on its own (the floor of DDP's exchange on mlp-wide)
set -u  # a step whose configurations fail says so in its table; the next step still runs
quick=0
if [ "${1:-}" = "--quick" ]; then quick=1; shift; fi
out=${1:-results/limits}
mkdir -p "$out"
start=$(date +%s)
bench=(bash benchmarks/bench_cpu.sh)
py=${PYTHON:-.venv/bin/python}
export OMP_NUM_THREADS=1 PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}
if [ $quick = 1 ]; then
  "${bench[@]}" "$out/ddp" --workload mlp-wide --strategies ddp --comm-hook none,auto,bf16 --repeat 3
  "${bench[@]}" "$out/sched" --workload mlp --strategies ddp,pp --schedule 1f1b,zero-bubble,auto \
    --microbatches 4,8 --repeat 3
  "${bench[@]}" "$out/four" --workload mlp --strategies ddp,pp --workers 4 --microbatches 8 --repeat 2
  export SCHEDULE_SEARCH_ROUNDS=1 MICROBATCH_COST_REPEATS=4 MICROBATCH_COST_COUNTS=1,2,4,8
else
  "${bench[@]}" "$out/ddp" --workload mlp-wide --strategies ddp --comm-hook none,auto,bf16,fp16 --repeat 6
  "${bench[@]}" "$out/sched" --workload mlp --strategies pp --schedule 1f1b,zero-bubble,interleaved-1f1b,auto \
    --microbatches 2,4,8,16 --repeat 5
  "${bench[@]}" "$out/overhead" --workload mlp --strategies ddp,pp --microbatches 2,4,8 --repeat 8
  "${bench[@]}" "$out/four" --workload mlp --strategies ddp,pp --workers 4 --microbatches 4,8 --repeat 3
fi
for script in microbatch_cost watch_cost allreduce_cost schedule_search; do
  $py benchmarks/$script.py "$out/$script.json" >/dev/null
done
$py benchmarks/limits_report.py "$out"
echo "limits wall time: $(( $(date +%s) - start )) s"
