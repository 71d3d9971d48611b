#!/usr/bin/env bash
# How close each strategy gets to what this machine allows (docs/benchmarks.md, section H): about 15 minutes
# on 2 cores. Usage: bash benchmarks/bench_limits.sh OUTDIR
#   ddp/      mlp-wide (gradients dominate): ddp with torch's settings, comm_hook=auto, and the lossy bf16 / fp16
#   sched/    mlp: pp with 1f1b, zero-bubble, interleaved-1f1b and schedule=auto over M in 2,4,8,16
#   overhead/ mlp: ddp and pp against hand-written torch, 8 alternated blocks
#   four/     mlp: pp on 4 workers beside ddp and the no-communication ceiling on 4 workers
#   microbatch_cost.json: one worker, the batch cut into M pieces, no pipeline (the CPU GEMM effect)
#   schedule_search.json: schedule="auto" against a full sweep of (schedule, micro-batch count)
#   watch_cost.json: the heartbeat thread's share of a core
#   allreduce_cost.json: a 34 MB gloo all-reduce on its own (the floor of DDP's exchange on mlp-wide)
set -u  # a step whose configurations fail says so in its table; the next step still runs
out=${1:-results/limits}
mkdir -p "$out"
bench=(bash benchmarks/bench_cpu.sh)
export OMP_NUM_THREADS=1
"${bench[@]}" "$out/ddp" --workload mlp-wide --strategies ddp --comm-hook none,auto,bf16,fp16 --repeat 6
"${bench[@]}" "$out/sched" --workload mlp --strategies pp --schedule 1f1b,zero-bubble,interleaved-1f1b,auto \
  --microbatches 2,4,8,16 --repeat 5
"${bench[@]}" "$out/overhead" --workload mlp --strategies ddp,pp --microbatches 2,4,8 --repeat 8
"${bench[@]}" "$out/four" --workload mlp --strategies ddp,pp --workers 4 --microbatches 4,8 --repeat 3
PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} ${PYTHON:-.venv/bin/python} benchmarks/microbatch_cost.py \
  "$out/microbatch_cost.json"
PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} ${PYTHON:-.venv/bin/python} benchmarks/schedule_search.py "$out/schedule_search.json"
PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} ${PYTHON:-.venv/bin/python} benchmarks/watch_cost.py "$out/watch_cost.json"
PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} ${PYTHON:-.venv/bin/python} benchmarks/allreduce_cost.py "$out/allreduce_cost.json"
