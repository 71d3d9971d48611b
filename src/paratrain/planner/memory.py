"""Memory of the busiest worker of a layout, by what holds it.

paratrain keeps parameters in float32 whatever the precision (autocast casts inside the forward), so
gradients are float32 too and an optimizer state tensor is 4 bytes per parameter. What each strategy
adds:

    ddp      a second copy of the gradients in DDP's all-reduce buckets
    fsdp     parameters, gradients and optimizer state divided by the replicas, plus the unit being
             computed and the one prefetched whole; inside an accumulation window gradients stay whole
    pp       its stages' parameters; activations of as many micro-batches as the schedule keeps in
             flight (read off the simulated action order); every rank holds the replica's batch
    ddp+pp   the same, plus the flat copy the gradient all-reduce after the schedule makes
    fsdp+pp  a pipeline rank's state divided by the replicas that shard its stages, plus the stages gathered
             whole and their whole gradients, from the first forward to the reduce-scatter after the schedule

Activations are the bytes autograd saves for backward (measured, or counted for an analytic model),
plus the gradients in flight during backward (twice the largest layer output). `process` is what a
worker holds before the model, as the cluster spec says the measurement counts it. On CPU workers a
pipeline rank also keeps the high-water mark of its build (`retained`): before keeping its stages it
runs every layer of the whole model on one micro-batch to balance them, with trial gradients for all
parameters, and a process's resident set does not shrink after freeing.

On a GPU the caching allocator hands freed memory back to the next phase of the step: gradients, freed by
`zero_grad()` before the forward, and the optimizer's temporary exist when the activations are gone, so the peak
of a step without accumulation is the larger phase (`phased`), not their sum. On an H200 the sum (with GPT's tied
weight then counted twice) overstated GPT-2 small's and ResNet-50's measured peaks by 15-19%; the larger phase
is within 1-4% of them (docs/plan.md).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from .costs import OPTIMIZER_STATES

FLOAT32 = 4


@dataclass
class Memory:
    params: float = 0.0
    grads: float = 0.0
    optimizer: float = 0.0
    activations: float = 0.0
    buffers: float = 0.0
    """Communication buffers and transient copies (DDP buckets, FSDP gathered units, flat gradients)."""
    data: float = 0.0
    """The batch this worker holds (inputs and targets)."""
    process: float = 0.0
    retained: float = 0.0
    """What a CPU worker keeps from an earlier, larger peak: its resident set does not shrink when memory
    is freed, and a pipeline rank first measures every layer of the whole model on one micro-batch."""
    in_flight: int = 1
    """Micro-batches whose activations are held at once (pipelines)."""

    build: float = 0.0
    """The peak before the first step, while the model is built, split and its weights loaded (`building`)."""
    temporary: float = 0.0
    """What the optimizer step allocates and frees (Adam: the square root of its second moment)."""
    phased: bool = False
    """Activations and (gradients + the optimizer's temporary) are never held at once (see the module docstring)."""

    @property
    def state(self) -> float:
        """Parameters, gradients and optimizer state, the step's temporary included: what no batch size shrinks."""
        return self.params + self.grads + self.optimizer + self.temporary

    @property
    def total(self) -> float:
        """The worker's peak: its step's, or its build's where that is higher."""
        held = self.params + self.optimizer + self.buffers + self.data + self.process + self.retained
        if self.phased:
            step = held + max(self.activations, self.grads + self.temporary)
        else:
            step = held + self.activations + self.grads + self.temporary
        return max(step, self.process + self.build)

    def add(self, other: Memory) -> None:
        """Another set of parameters' state held beside these (experts outside FSDP's shards)."""
        self.params += other.params
        self.grads += other.grads
        self.optimizer += other.optimizer
        self.temporary += other.temporary

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "total": self.total}


def model_state(param_bytes: float, params: float, optimizer: str, shard: int = 1) -> Memory:
    """Parameters, gradients and optimizer state of `params` parameters, divided over `shard` workers; Adam's
    step also makes one parameter-sized temporary (the square root of its second moment)."""
    states = OPTIMIZER_STATES[optimizer] * FLOAT32 * params
    temporary = FLOAT32 * params if optimizer == "adam" else 0.0
    return Memory(params=param_bytes / shard, grads=param_bytes / shard, optimizer=states / shard,
                  temporary=temporary / shard)


def activations(per_sample: float, largest_output_per_sample: float, batch: float) -> float:
    """Saved activations of one micro-batch through the layers, plus the gradients in flight in backward."""
    return (per_sample + 2 * largest_output_per_sample) * batch


def building(whole: float, share: float, largest_layer: float, meta: bool, device_is_host: bool) -> float:
    """Bytes a worker holds while its model is built and split, before the first step. Built whole, every rank
    holds the whole model and, while the layout copies its share out, the share too (measured on CPU workers:
    fsdp 2 peaked at 1.7x a 3.2 GB model; docs/benchmarks.md); that is host memory, which a GPU's does not count.
    Built on the meta device, a rank holds its share and one layer's tensors made whole (an initialiser's, a
    file's read, a pipeline's trace)."""
    if meta:
        return share + largest_layer
    if not device_is_host:
        return 0.0
    return whole if share >= whole else whole + share
