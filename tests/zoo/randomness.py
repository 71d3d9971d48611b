"""Which kinds of randomness a model draws in a training forward, found by running one.

A reference can restate paratrain's mask rule only for the kinds the rule covers (`dropout_rule.COVERS`); a
model that also draws another kind (dropout called as a function, stochastic depth's `bernoulli_`, a router's
noise) cannot be compared with the plain loop until the rule and its restatement cover that kind too. Libraries
call dropout every way there is, so the kinds are read off a forward rather than guessed from the modules:

    DROPOUT_MODULE   an nn.Dropout (Dropout1d/2d/3d) module with p > 0
    FUNCTIONAL       F.dropout and friends, or scaled_dot_product_attention's dropout_p > 0, outside such a module
    BERNOULLI        Tensor.bernoulli_ / torch.bernoulli outside dropout (torchvision's stochastic depth)
    NOISE            rand, randn (and _like), Tensor.uniform_, Tensor.normal_ (a router's jitter)
    OTHER            any other draw (randint, randperm, multinomial, torch.normal, exponential_, ...)
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode

DROPOUT_MODULE = "nn.Dropout"
FUNCTIONAL = "F.dropout"
BERNOULLI = "bernoulli_"
NOISE = "rand/randn"
OTHER = "random op"

_MODULES = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d)
_DROPOUTS = {F.dropout, F.dropout1d, F.dropout2d, F.dropout3d, F.alpha_dropout, F.feature_alpha_dropout,
             torch.dropout, torch.feature_dropout, torch.alpha_dropout, torch.feature_alpha_dropout}
_BERNOULLI = {"bernoulli", "bernoulli_"}
_NOISE = {"rand", "rand_like", "randn", "randn_like", "uniform_", "normal_"}
_DRAWS = {"randint", "randint_like", "randperm", "normal", "multinomial", "exponential_", "geometric_", "cauchy_",
          "log_normal_", "poisson", "random_"}


def _argument(args: tuple[Any, ...], kwargs: dict[str, Any], index: int, name: str, default: Any) -> Any:
    return kwargs[name] if name in kwargs else args[index] if len(args) > index else default


class _Watch(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.kinds: set[str] = set()
        self.inside = 0
        """Depth of nn.Dropout modules being run (their F.dropout is the module's own)."""

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if func in _DROPOUTS:
            p = _argument(args, kwargs, 1, "p", 0.5)
            training = _argument(args, kwargs, 2, "training", _argument(args, kwargs, 2, "train", True))
            if training and p > 0:
                self.kinds.add(DROPOUT_MODULE if self.inside else FUNCTIONAL)
        elif func is F.scaled_dot_product_attention:
            if _argument(args, kwargs, 4, "dropout_p", 0.0) > 0:
                self.kinds.add(FUNCTIONAL)
        elif name in _BERNOULLI:
            self.kinds.add(BERNOULLI)
        elif name in _NOISE:
            self.kinds.add(NOISE)
        elif name in _DRAWS:
            self.kinds.add(OTHER)
        return func(*args, **kwargs)


def kinds(model: nn.Module, inputs: Any) -> frozenset[str]:
    """The kinds of randomness one training-mode forward of `model` on `inputs` draws (RNG state untouched)."""
    watch = _Watch()

    def enter(module: nn.Module, args: Any) -> None:
        watch.inside += 1

    def leave(module: nn.Module, args: Any, output: Any) -> None:
        watch.inside -= 1

    handles = [h for m in model.modules() if type(m) in _MODULES
               for h in (m.register_forward_pre_hook(enter), m.register_forward_hook(leave))]
    was_training = model.training
    try:
        model.train()
        with torch.random.fork_rng(devices=[]), torch.no_grad(), watch:
            model(inputs)
    finally:
        model.train(was_training)
        for handle in handles:
            handle.remove()
    return frozenset(watch.kinds)
