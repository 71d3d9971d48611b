"""`paratrain plan`: predict every layout's step time and memory before spending cluster hours.

    cluster.py     the hardware: presets, the spec file format
    calibrate.py   this machine measured into a spec (collective sweep, pipeline overhead, memory floor)
    comm.py        alpha-beta models of all-reduce, all-gather, reduce-scatter, all-to-all and point-to-point
    costs.py       per-layer time, FLOPs and memory; time on a given cluster
    profile.py     a real model measured layer by layer   |   transformer.py  a GPT from its shapes
    axis_profile.py  its experts and attention, seen in one forward (what the ep and cp terms read)
    axes.py        what each model axis (tp, cp, ep) adds to a rank's step: one entry per axis
    overlap.py     DDP buckets and FSDP prefetch beside compute (pipeline schedules: parallel/pipeline/simulate.py)
    memory.py      memory of the busiest worker, by what holds it
    layout.py      one layout: the runtime's degrees (ParallelDims), setup() arguments and a launch command
    predict.py     one layout's predicted step    |   search.py  which layouts to predict (pruned)
    report.py      table, plan.json, scaling plot |   validate.py  predicted vs measured here
    command.py     the steps `paratrain plan` runs
"""
