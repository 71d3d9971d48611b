"""Activation checkpointing (`setup(activation_checkpointing=...)`): keep less for the backward, recompute it.

"full" keeps only each unit's input and recomputes the unit in the backward; "selective" keeps the outputs
of matrix multiplications (the costly part to recompute) and recomputes the rest (norms, activations,
softmax), torch's selective checkpoint. Units are the blocks FSDP shards (a ModuleList's items, else the
top-level children with parameters), wrapped after tensor, context and expert parallelism and before the
data-parallel wrapper shards or replicates them, as torchtitan orders it (`parallel.parallelize`); under layouts
that cut the model into pipeline stages, each layer of a stage is the unit (the blocks themselves are traced
into the stages' graphs, cut before each layer).

Both run torch.utils.checkpoint (non-reentrant). The recomputation draws the same dropout masks as the
forward did (paratrain's masks are a function of the layer, micro-step and row: the position of the forward
is replayed), and calls the attention function the forward called (context parallelism swaps in its own for
the length of the model's forward, and a recomputation runs later, in the backward), so results equal a run
without checkpointing. BatchNorm is refused: a recomputed forward would update its running statistics a second
time.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from typing import Any, Literal

import torch
from torch import nn
from torch.nn import functional as F

from .. import _forwards
from ..errors import ParatrainError
from . import random_calls, randomness, step_state

Mode = Literal["none", "selective", "full"]
REASON = "activation checkpointing"

_SAVED_OPS = (
    "mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
)
"""aten ops whose outputs selective checkpointing keeps."""


@functools.cache
def _policy() -> Any:
    """Built once: every checkpointed forward of every step asks for it."""
    from torch.utils.checkpoint import CheckpointPolicy

    saved = {getattr(torch.ops.aten, name).default for name in _SAVED_OPS if hasattr(torch.ops.aten, name)}

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
        return CheckpointPolicy.MUST_SAVE if op in saved else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


class _Recompute:
    """Around each recomputation (a zero-bubble schedule recomputes twice: for the input gradients, then
    for the weights'): the forward's position replayed, then torch's own recompute context."""

    def __init__(self, at: randomness.Position, inner: AbstractContextManager[Any], attention: Any) -> None:
        self.at, self.inner, self.attention, self.stack = at, inner, attention, ExitStack()

    def __enter__(self) -> None:
        self.stack.enter_context(randomness.replaying(self.at))
        self.stack.enter_context(random_calls.replaying(step_state.active().random_calls))
        self.stack.enter_context(_attention_as(self.attention))
        self.stack.enter_context(self.inner)

    def __exit__(self, *exc: object) -> None:
        self.stack.close()


def _contexts(mode: Mode) -> Callable[[], tuple[AbstractContextManager[Any], AbstractContextManager[Any]]]:
    """torch's context_fn: (around the forward, around the recomputation)."""

    def make() -> tuple[AbstractContextManager[Any], AbstractContextManager[Any]]:
        at = randomness.position()
        if mode == "selective":
            from torch.utils.checkpoint import create_selective_checkpoint_contexts

            forward, recompute = create_selective_checkpoint_contexts(_policy())
        else:
            forward, recompute = nullcontext(), nullcontext()
        return forward, _Recompute(at, recompute, F.scaled_dot_product_attention)

    return make


@contextmanager
def _attention_as(attention: Any) -> Iterator[None]:
    original = F.scaled_dot_product_attention
    F.scaled_dot_product_attention = attention
    try:
        yield
    finally:
        F.scaled_dot_product_attention = original


def _checkpointed(forward: Callable[..., Any], mode: Mode) -> Callable[..., Any]:
    import inspect

    from torch.utils.checkpoint import checkpoint

    options: dict[str, Any] = {"use_reentrant": False, "context_fn": _contexts(mode)}
    if "respect_saved_tensors_hooks" in inspect.signature(checkpoint).parameters:
        options["respect_saved_tensors_hooks"] = True  # what selective keeps is seen by memory meters too

    def run(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():  # evaluation: nothing is kept for a backward anyway
            return forward(*args, **kwargs)
        return checkpoint(forward, *args, **options, **kwargs)

    return run


def _check(module: nn.Module, where: str) -> None:
    for name, inner in module.named_modules():
        if isinstance(inner, nn.modules.batchnorm._BatchNorm):
            raise ParatrainError(
                f"activation_checkpointing: {where} holds BatchNorm {name or type(inner).__name__!r}, whose "
                "running statistics a recomputed forward would update twice; use activation_checkpointing="
                "'none' for this model"
            )


def apply(units: list[tuple[str, nn.Module]], mode: Mode) -> int:
    """Checkpoint each unit's forward; returns how many were wrapped."""
    if mode == "none":
        return 0
    for where, unit in units:
        _check(unit, where)
    for _, unit in units:
        _forwards.replace(unit, _checkpointed(unit.forward, mode), REASON)
    return len(units)


def without_cache(model: nn.Module, mode: Mode, shared_sequences: bool = False) -> bool:
    """Under selective checkpointing, the model's training forwards run without a key/value cache; returns whether
    it had one.

    Hugging Face models build a cache in every forward by default (`config.use_cache`) and each attention layer
    appends to it, so a recomputation in the backward meets a longer cache than its forward did: selective
    checkpointing, which replays the forward op by op, then fails inside torch ("full" recomputes whole blocks and
    is unaffected). Training reads no cache, so its forwards get `use_cache=False`, as transformers' own gradient
    checkpointing does; the config is left as it was and evaluation forwards keep their cache. Under context
    parallelism (`shared_sequences`) that cannot be done: without a cache, transformers reads the shares' global
    positions as packed sequences and builds a mask, which context parallelism refuses; that case is refused."""
    if mode != "selective" or not getattr(getattr(model, "config", None), "use_cache", False):
        return False
    import inspect

    try:
        accepts = "use_cache" in inspect.signature(type(model).forward).parameters  # the class's: another
        # feature may have replaced the instance's forward with one that passes every argument on
    except (TypeError, ValueError):
        return False
    if not accepts:
        return False
    if shared_sequences:
        raise ParatrainError(
            f"activation_checkpointing='selective' with context parallelism: {type(model).__name__} builds a "
            "key/value cache in every forward (config.use_cache), which a selective recomputation meets grown, and "
            "without it transformers masks the shares' positions as packed sequences; use "
            "activation_checkpointing='full' (exact with the cache), or drop 'cp'")
    inner = model.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        if model.training and torch.is_grad_enabled():
            kwargs.setdefault("use_cache", False)
        return inner(*args, **kwargs)

    _forwards.replace(model, forward, REASON)
    return True


def blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The units of a model that runs whole in each process: the blocks FSDP would shard."""
    from .data_parallel.fsdp import find_units

    names = dict(model.named_modules())
    found = [(f"block {path!r}", names[path]) for path in find_units(model)]
    return found or [("the model", model)]


def stages(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The layers of the pipeline stages this process holds: each a unit (the stage's own forward moves
    its row cursor and receives activations, which a recomputation must not do again)."""
    from .pipeline.partition import Stage

    return [(f"layer {name!r} of pipeline stage {stage.index}", layer)
            for stage in model.modules() if isinstance(stage, Stage)
            for name, layer in zip(stage.layer_names, stage._chain)]


__all__ = ["REASON", "Mode", "apply", "blocks", "stages"]
