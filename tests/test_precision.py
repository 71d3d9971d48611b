"""Mixed precision: the model computes under autocast and hands float32 back; fp16 gets a GradScaler."""

from __future__ import annotations

import torch
from torch import nn

from paratrain.precision import apply_autocast, make_scaler


def test_bf16_autocast_computes_in_bf16_and_returns_float32() -> None:
    torch.manual_seed(0)
    model = nn.Linear(16, 8)
    x = torch.randn(4, 16)
    full = model(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = model(x).float()
    out = apply_autocast(model, "bf16", "cpu")(x)
    assert out.dtype == torch.float32
    assert torch.equal(out, expected)  # exactly what plain torch.autocast gives
    assert (out - full).abs().max() > 1e-4  # and not the float32 result: autocast really ran


def test_32_is_untouched_and_only_16_scales() -> None:
    model = nn.Linear(2, 2)
    assert apply_autocast(model, "32", "cpu").forward == model.forward
    assert make_scaler("bf16", "cpu") is None and make_scaler("32", "cpu") is None
    assert isinstance(make_scaler("16", "cpu"), torch.amp.GradScaler)


def test_bf16_keeps_a_hugging_face_model_output() -> None:
    """A loss that reads `output.logits` works under bf16: the float32 cast keeps the ModelOutput's type
    (it once came back as a plain dict), with the values plain torch.autocast gives."""
    import zoo

    case = zoo.MODELS["hf_gpt2"]
    model = case.build(0)
    inputs, _ = case.batch(1, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = model(inputs).logits.float()
    out = apply_autocast(model, "bf16", "cpu")(inputs)
    assert type(out).__name__ == "CausalLMOutputWithCrossAttentions"
    assert out.logits.dtype == torch.float32 and torch.equal(out.logits, expected)
