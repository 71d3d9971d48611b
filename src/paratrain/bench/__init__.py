"""`paratrain bench`: workloads, the measuring runner, hand-written references, report and plots."""
