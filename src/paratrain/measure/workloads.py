"""What the benchmark trains: built-in models on synthetic data, or the user's own via `module:factory`.

Every built-in model but `gpt` is an `nn.Sequential`, so the pipelined strategies and the hand-written
references can cut it into stages by its children. `gpt` is a decoder as users write one (a module with
a list of blocks and a tied output projection): paratrain traces it, and the hand-written references cut
the chain its `layers()` names. Data is generated in process from a fixed seed (no downloads), once per
worker, and reused every step: the benchmark times the training step, not data loading.
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from torch import nn

from ..errors import ParatrainError, unknown_name
from . import gpt as gpt_model

Batch = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True, kw_only=True)
class Workload:
    name: str
    description: str
    model: Callable[[], nn.Module]
    """Builds the model; deterministic under `torch.manual_seed`, so every rank builds the same weights."""
    data: Callable[[int], Batch]
    """One global batch (inputs, targets) of the given size, from a fixed seed."""
    loss: Callable[[], nn.Module] = nn.MSELoss
    lr: float = 1e-3
    batch: int
    """Default global batch."""
    steps: int = 5
    """Default timed steps per repeat."""
    repeat: int = 3
    warmup: int = 2
    split: int | None = None
    """Index in the layer chain where the hand-written 2-stage references cut the model (None: half way)."""
    layers: Callable[[nn.Module], list[nn.Module]] | None = None
    """The model as the chain of layers the hand-written pipeline references cut between (None: the
    children of the nn.Sequential)."""
    tokens: int | None = None
    """Tokens per sample, for workloads that train on token sequences (tokens/s is reported for them)."""
    tp_plan: dict[str, str] | None = None
    """The Linear layers tensor-parallel layouts shard ("colwise"/"rowwise"), the same for paratrain and the
    hand-written reference; None: tensor-parallel layouts do not apply to this workload."""


def _generator(seed: int = 1) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _regression(batch: int, inputs: tuple[int, ...], outputs: int) -> Batch:
    g = _generator()
    return torch.randn(batch, *inputs, generator=g), torch.randn(batch, outputs, generator=g)


def _one_hot(batch: int, image: int, classes: int) -> Batch:
    """The tutorials' data: random images and one-hot labels (trained with MSE)."""
    g = _generator()
    inputs = torch.randn(batch, 3, image, image, generator=g)
    labels = torch.randint(0, classes, (batch, 1), generator=g)
    return inputs, torch.zeros(batch, classes).scatter_(1, labels, 1.0)


def toy() -> Workload:
    """The tutorials' ToyModel: Linear(10, 10), ReLU, Linear(10, 5); communication and overhead only."""
    return Workload(
        name="toy", description="the tutorials' ToyModel (10-10-5 MLP), MSE; overhead-bound",
        model=lambda: nn.Sequential(nn.Linear(10, 10), nn.ReLU(), nn.Linear(10, 5)),
        data=lambda b: _regression(b, (10,), 5), batch=20, steps=5, repeat=3, warmup=1, split=2,
    )


def mlp(width: int = 512, depth: int = 8, batch: int = 2048, name: str = "mlp") -> Workload:
    """Square layers and a large batch: a step is almost all matrix products, so it is compute-bound on CPU
    workers. Compute grows with batch x parameters and DDP's gradient exchange with parameters alone,
    so a modest width and a large batch keep communication small (8 MB of gradients per step here)."""
    def model() -> nn.Module:
        layers: list[nn.Module] = []
        for _ in range(depth):
            layers += [nn.Linear(width, width), nn.ReLU()]
        return nn.Sequential(*layers)

    bound = "compute-bound" if name == "mlp" else "gradient exchange dominates"
    # Megatron's pairs: Linear 2i colwise, Linear 2i+1 rowwise (children 4i and 4i+2; ReLU acts per feature)
    pairs = {str(4 * i + 2 * j): ("colwise", "rowwise")[j] for i in range(depth // 2) for j in (0, 1)}
    return Workload(
        name=name, description=f"{depth} x Linear({width}, {width}) + ReLU, MSE on random targets; {bound}",
        model=model, data=lambda b: _regression(b, (width,), width), batch=batch, steps=5, repeat=3, warmup=2,
        tp_plan=pairs,
    )


def mlp_wide() -> Workload:
    """Many parameters for the compute: 8 x Linear(1024, 1024) at batch 512 (8.4 M parameters, 34 MB of
    float32 gradients a step for the same matrix-product work as `mlp`), where DDP's gradient exchange,
    not the compute, decides how well data parallelism scales."""
    return mlp(width=1024, depth=8, batch=512, name="mlp-wide")


def convnet(image: int = 32, classes: int = 10) -> Workload:
    """Six 3x3 convolutions (64-128-256 channels): compute-bound on CPU, no BatchNorm."""
    def block(cin: int, cout: int) -> list[nn.Module]:
        return [nn.Conv2d(cin, cout, 3, padding=1), nn.ReLU()]

    def model() -> nn.Module:
        return nn.Sequential(
            *block(3, 64), *block(64, 64), nn.MaxPool2d(2), *block(64, 128), *block(128, 128), nn.MaxPool2d(2),
            *block(128, 256), *block(256, 256), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(256, classes),
        )

    return Workload(
        name="convnet", description=f"6 conv3x3 layers (64-128-256 ch) on {image}x{image} images, MSE on one-hot",
        model=model, data=lambda b: _one_hot(b, image, classes), batch=32, steps=4, repeat=3, warmup=1, split=7,
    )


def resnet50(image: int | None = None, gpu: bool = False) -> Workload:
    """torchvision's ResNet-50 as the tutorials time it: on GPU their exact setting (3 batches of 120 images
    of 128x128, 1000 classes, MSE on one-hot labels, SGD lr 1e-3); on CPU 16 images of 64x64 by default,
    because one tutorial batch takes several seconds per core. The references cut it where the tutorials
    do: conv1..layer2 | layer3..fc."""
    try:
        from torchvision.models import resnet50 as _resnet50
    except ImportError as exc:
        raise ParatrainError("workload 'resnet50' needs torchvision: pip install 'paratrain[vision]'") from exc
    size = image or (128 if gpu else 64)

    def model() -> nn.Module:
        net = _resnet50(num_classes=1000)
        return nn.Sequential(net.conv1, net.bn1, net.relu, net.maxpool, net.layer1, net.layer2,
                             net.layer3, net.layer4, net.avgpool, nn.Flatten(1), net.fc)

    return Workload(
        name="resnet50", description=f"torchvision ResNet-50 on {size}x{size} images, 1000 classes, MSE on one-hot",
        model=model, data=lambda b: _one_hot(b, size, 1000), batch=120 if gpu else 16,
        steps=3, repeat=10 if gpu else 3, warmup=1, split=6,
    )


def gpt(size: str | None = None, gpu: bool = False) -> Workload:
    """A GPT decoder language model (`measure/gpt.py`) on synthetic token batches, next-token cross-entropy.
    `mini` on CPU workers by default (8 sequences of 128 tokens, about 0.1-0.3 s per step on one core),
    GPT-2 small (`gpt2`, 8 sequences of 1024 tokens) on GPUs; `tiny` for tests. The references cut it
    between blocks: embedding and the first half of the blocks | the other half and the tied head."""
    name = size or ("gpt2" if gpu else "mini")
    if name not in gpt_model.SIZES:
        raise unknown_name("GPT size (--gpt-size)", name, gpt_model.SIZES)
    cfg = gpt_model.SIZES[name]

    def layers(model: nn.Module) -> list[nn.Module]:
        assert isinstance(model, gpt_model.GPT)
        return model.layers()

    return Workload(
        name="gpt", description=f"GPT decoder '{name}' (d_model {cfg.d_model}, {cfg.layers} layers, {cfg.heads} heads, "
                                f"seq {cfg.seq}, vocab {cfg.vocab}, tied head), next-token cross-entropy",
        model=lambda: gpt_model.GPT(cfg), data=lambda b: gpt_model.tokens(b, cfg), loss=gpt_model.NextTokenLoss,
        batch=8, steps=5, repeat=5 if gpu else 3, warmup=2,
        split=1 + cfg.layers // 2, layers=layers, tokens=cfg.seq,
        # the MLPs; attention's fused qkv (nanoGPT's layout) is refused by tensor parallelism, so it stays whole
        tp_plan=None if cfg.experts else {"blocks.*.mlp.fc": "colwise", "blocks.*.mlp.proj": "rowwise"},
    )


def gpt_moe(size: str | None = None, gpu: bool = False) -> Workload:
    """The GPT decoder with a mixture of 8 experts, top-2, in every block (`moe`; `tiny-moe` for tests): the
    workload of expert parallelism (`ep`), whose experts it splits over ranks."""
    return replace(gpt(size or "moe", gpu), name="gpt-moe")


def gpt_long(size: str | None = None, gpu: bool = False) -> Workload:
    """The GPT decoder at 1,024 tokens per sequence (`long`; `tiny-long` for tests): the workload of context
    parallelism (`cp`), which gives each rank a share of every sequence."""
    return replace(gpt(size or "long", gpu), name="gpt-long")


BUILTIN: dict[str, Callable[..., Workload]] = {"toy": toy, "mlp": mlp, "mlp-wide": mlp_wide, "convnet": convnet,
                                               "resnet50": resnet50, "gpt": gpt, "gpt-moe": gpt_moe,
                                               "gpt-long": gpt_long}
GPT_LIKE = ("gpt", "gpt-moe", "gpt-long")
"""Workloads that take a GPT size (`--gpt-size`)."""


def get(name: str, *, image: int | None = None, gpu: bool = False, gpt_size: str | None = None) -> Workload:
    """A built-in workload by name, or a user's `module:factory` (see `from_factory`)."""
    if ":" in name:
        return from_factory(name)
    if name not in BUILTIN:
        raise unknown_name("workload", name, BUILTIN)
    if gpt_size is not None and name not in GPT_LIKE:
        raise ParatrainError(f"--gpt-size {gpt_size} applies to --workload {', '.join(GPT_LIKE)}, not {name!r}")
    if name in GPT_LIKE:
        return BUILTIN[name](gpt_size, gpu)
    if name == "resnet50":
        return resnet50(image, gpu)
    if name == "convnet" and image is not None:
        return convnet(image)
    return BUILTIN[name]()


def from_factory(spec: str) -> Workload:
    """`module:factory` where `factory(batch_size)` returns `(model, inputs, targets)` or
    `(model, inputs, targets, loss_fn)` for one global batch; it is called under a fixed seed in
    every worker, so it must build the same weights each time (the default init does)."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ParatrainError(f"--model {spec!r}: expected module:factory, e.g. mymodels:build")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # as `python -m` does; the launcher passes sys.path to workers
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ParatrainError(f"--model {spec!r}: cannot load {attr!r} from module {module_name!r} ({exc})") from exc
    if not callable(factory) or len(inspect.signature(factory).parameters) < 1:
        raise ParatrainError(f"--model {spec!r}: {attr} must be a function factory(batch_size) -> "
                             "(model, inputs, targets[, loss_fn])")

    def call(batch: int) -> tuple[nn.Module, torch.Tensor, torch.Tensor, nn.Module]:
        torch.manual_seed(0)
        made = factory(batch)
        if not isinstance(made, tuple) or len(made) not in (3, 4) or not isinstance(made[0], nn.Module):
            raise ParatrainError(f"--model {spec!r}: factory(batch_size) must return (model, inputs, targets) "
                                 f"or (model, inputs, targets, loss_fn), got {type(made).__name__}")
        loss = made[3] if len(made) == 4 else nn.MSELoss()
        if int(made[1].shape[0]) != batch:
            raise ParatrainError(f"--model {spec!r}: factory({batch}) returned inputs of batch "
                                 f"{made[1].shape[0]}; they must hold exactly {batch} samples")
        return made[0], made[1], made[2], loss

    probe = call(2)
    return Workload(
        name=spec, description=f"user model {spec} ({type(probe[0]).__name__})",
        model=lambda: call(2)[0], data=lambda b: call(b)[1:3], loss=lambda: probe[3],
        batch=32, steps=5, repeat=3, warmup=2,
    )


def parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
