"""One layout's run of the LoRA cases (tests/test_lora_export.py): Hugging Face Llama wrapped by peft's LoRA, built on
the meta device.

    paratrain run --nproc N tests/lora_worker.py LAYOUT BASE_CHECKPOINT OUT

  OUT/own       prepared without init_from, exported at once (peft's adapter files)
  OUT/init      prepared with init_from=BASE_CHECKPOINT (a plain save_pretrained of the base: no adapters in it),
                exported at once
  OUT/trained   the same model after three SGD steps on the adapters, exported
  OUT/losses.json
"""

from __future__ import annotations

import os
import sys

import torch
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, os.path.dirname(__file__))
import meta_cases as cases  # noqa: E402

import paratrain  # noqa: E402

TARGETS = ["q_proj", "v_proj", "down_proj"]


def lora_config():  # type: ignore[no-untyped-def]
    import peft

    return peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=TARGETS)


def build() -> torch.nn.Module:
    """The LoRA model as a user builds it, on whatever device is current."""
    import peft

    return peft.get_peft_model(cases.build("llama"), lora_config())  # type: ignore[no-any-return]


def optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5, momentum=0.9)


def main() -> None:
    layout, base, out = sys.argv[1], sys.argv[2], sys.argv[3]
    run = paratrain.setup(strategy=layout, seed=0, timeout_s=120)
    x, y = cases.data()
    with torch.device("meta"):
        model = build()
    run.export(run.prepare(model, example=x[: cases.GLOBAL_BATCH]), os.path.join(out, "own"))

    with torch.device("meta"):
        model = build()
    prepared, opt = run.prepare(model, optimizer(model), example=x[: cases.GLOBAL_BATCH], init_from=base)
    run.export(prepared, os.path.join(out, "init"))
    loader = run.prepare_loader(DataLoader(TensorDataset(x, y), batch_size=run.per_worker_batch(cases.GLOBAL_BATCH)))
    losses = []
    for inputs, targets in loader:
        loss = run.forward_backward(prepared, inputs, targets, cases.loss_fn)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    run.export(prepared, os.path.join(out, "trained"))
    cases.record(run, out, losses)
    run.close()


if __name__ == "__main__":
    main()
