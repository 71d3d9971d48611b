"""Weights that no rank holds whole: models built on the meta device, their initial values, and export.

A model built under `with torch.device("meta"):` (or `paratrain.empty_init()`, which keeps buffers real) has
shapes and no data. `run.prepare` splits it as it would a real model (FSDP shards, tensor-parallel pieces,
pipeline stages: all work on meta tensors), and only then gives each rank real storage for what it holds,
filled from a source:

    init_from=PATH        a checkpoint's slices, read lazily (safetensors) or memory-mapped (torch.save)
    (nothing)             the modules' own initialisation, one module at a time from a generator keyed by the
                          module's name, so every layout gets the same values for the same seed

No rank ever holds more than its share plus one module's tensors. `run.export` writes the trained weights back
a parameter at a time, as Hugging Face shards them.
"""

from __future__ import annotations

from .build import empty_init, has_meta, place
from .export import export
from .fill import materialize, settle
from .sources import source_for
from .streamed import real_copy, real_layer, sourced, streamed

__all__ = ["empty_init", "export", "has_meta", "materialize", "place", "real_copy", "real_layer", "settle",
           "source_for", "sourced", "streamed"]
