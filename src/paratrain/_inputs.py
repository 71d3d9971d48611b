"""How a batch reaches the model: whole, or a dict's fields by name.

Models that take a dict of tensors come in two kinds. One takes the dict itself (`forward(self, inputs)`,
reading `inputs["input_ids"]`); the other takes the dict's fields as keyword arguments, as every Hugging Face
model does (`forward(self, input_ids=None, attention_mask=None, position_ids=None, ...)`), and fails inside
its embedding when handed the whole dict. The rule that tells them apart, with no guessing: a mapping is
passed by name (`model(**inputs)`) when the model's forward names its first parameter after one of the
mapping's keys; otherwise it is passed whole (`model(inputs)`), as before.

Passed by name, only the keys the forward names as parameters go in. The others (`document_ids` of a packed
batch, fields kept for the loss) are left out, said once per model class and set of keys: refusing them
would make every loop that trains on `data.pack`'s rows filter its batch, and handing them to a forward's
`**kwargs` would be no better, since Hugging Face forwards ignore names they do not know.

One case is refused instead, because its result would be silently wrong: a packed batch (`document_ids`
beside `position_ids`, as `data.pack` makes it) for a Hugging Face model whose `config.use_cache` is on and
no `attention_mask`. transformers then builds a cache in the training forward and, with a cache, does not
read packed sequences from `position_ids`, so attention would cross documents.
"""

from __future__ import annotations

import functools
import inspect
import warnings
from collections.abc import Mapping
from typing import Any

from torch import nn

from .errors import ParatrainError


def call(model: nn.Module, inputs: Any) -> Any:
    """`model(**inputs)` for a mapping whose keys the forward takes by name (see the module docstring), else
    `model(inputs)`."""
    if not isinstance(inputs, Mapping):
        return model(inputs)
    inner = user_module(model)
    names = parameter_names(inner)
    if not names or names[0] not in inputs:
        return model(inputs)
    _check_packed(inner, inputs)
    taken = {k: v for k, v in inputs.items() if k in names}
    left = [k for k in inputs if k not in names]
    if left:
        warnings.warn(f"paratrain: the batch's {', '.join(map(repr, left))} are not parameters of "
                      f"{type(inner).__name__}.forward and are not passed to it (the other fields are passed by "
                      "name)", stacklevel=2)
    return model(**taken)


def user_module(model: nn.Module) -> nn.Module:
    """The module whose forward runs inside the wrappers that pass arguments on unchanged."""
    from torch.nn.parallel import DataParallel, DistributedDataParallel

    from .parallel.data_parallel.replicas import Replicas

    while isinstance(model, (DataParallel, DistributedDataParallel, Replicas)):
        model = model.module
    return model


def parameter_names(module: nn.Module) -> tuple[str, ...]:
    """The names the class's forward takes by keyword, in order (a replaced instance forward is paratrain's
    wrapper with `*args, **kwargs`, so the class's is the user's)."""
    cls: Any = type(module)
    return _names(cls)


@functools.cache
def _names(cls: Any) -> tuple[str, ...]:
    """Read once per class: a signature costs more than a small model's forward."""
    try:
        signature = inspect.signature(cls.forward)
    except (TypeError, ValueError):
        return ()
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return tuple(p.name for p in list(signature.parameters.values())[1:] if p.kind in kinds)


def _check_packed(module: nn.Module, inputs: Mapping[str, Any]) -> None:
    config = getattr(module, "config", None)
    if ("document_ids" in inputs and "position_ids" in inputs and inputs.get("attention_mask") is None
            and inputs.get("use_cache", getattr(config, "use_cache", False)) is True):
        raise ParatrainError(
            f"a packed batch (document_ids, position_ids) for {type(module).__name__}, whose config.use_cache is "
            "True: transformers then builds a key/value cache in the training forward and, with a cache, ignores "
            "where position_ids restart, so attention would cross documents; set model.config.use_cache = False "
            "before training (transformers then masks each document from position_ids), or pass an attention_mask "
            "in the batch"
        )
