"""Turning the user's `state` dict into checkpoint payloads and back, in place.

Objects with `state_dict`/`load_state_dict` (models, optimizers, schedulers, scalers, the sharded
loader) are stored by their state dicts; models are unwrapped first so a checkpoint taken under one
strategy loads under another. Everything else is a plain value put back into the dict on load.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any

from torch import nn

Unwrap = Callable[[nn.Module], nn.Module]


def _stateful(value: Any) -> bool:
    return hasattr(value, "state_dict") and hasattr(value, "load_state_dict")


def collect(state: dict[str, Any], unwrap: Unwrap, skip: Collection[str] = ()) -> dict[str, Any]:
    """Every entry of `state` except `skip` (entries another writer stores, e.g. DCP for sharded models)."""
    out: dict[str, Any] = {}
    for key, value in state.items():
        if key in skip:
            continue
        if isinstance(value, nn.Module):
            out[key] = {"kind": "module", "value": unwrap(value).state_dict()}
        elif _stateful(value):
            out[key] = {"kind": "stateful", "value": value.state_dict()}
        else:
            out[key] = {"kind": "plain", "value": value}
    return out


def apply(state: dict[str, Any], saved: dict[str, Any], unwrap: Unwrap, skip: Collection[str] = ()) -> list[str]:
    """Restore `saved` into `state`; returns keys of `state` the checkpoint did not have."""
    missing = []
    for key, value in list(state.items()):
        if key in skip:
            continue
        if key not in saved:
            missing.append(key)
            continue
        entry = saved[key]
        if isinstance(value, nn.Module):
            unwrap(value).load_state_dict(entry["value"])
        elif _stateful(value) and entry["kind"] != "plain":
            value.load_state_dict(entry["value"])
        else:
            state[key] = entry["value"]
    for key in saved.keys() - state.keys():
        if saved[key]["kind"] == "plain":
            state[key] = saved[key]["value"]
    return missing
