"""Architectures nobody on the project wrote, as their libraries build them: Hugging Face causal LMs, MoE and
encoder-decoder models and torchvision vision transformers and ConvNeXts, each from a tiny config (hidden 64, 2
layers, 4 heads, the zoo's vocabulary) with every other setting at the library's default (the key/value cache,
the attention implementation, dropout, tied embeddings).

Only sizes are set, and the few settings whose defaults cannot be made tiny (Gemma2's head_dim of 256, the MoE
configs' 60 experts). Where a library default adds randomness (OPT's and T5's dropout, stochastic depth), it is
kept: that is what users bring.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .case import seeded
from .data import CLASSES, SEQ, VOCAB
from .hf import _transformers

TINY_LM = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
           "num_attention_heads": 4, "max_position_embeddings": 2 * SEQ, "bos_token_id": 1, "eos_token_id": 2,
           "pad_token_id": 0}
"""What a tiny config sets; grouped-query models also get 2 key/value heads (fewer than the 4 query heads)."""


def _causal(config_name: str, model_name: str, **sizes: Any) -> Any:
    def build(seed: int) -> nn.Module:
        tf = _transformers()
        cfg = getattr(tf, config_name)(**{**TINY_LM, **sizes})
        with seeded(seed):
            return getattr(tf, model_name)(cfg)  # type: ignore[no-any-return]

    return build


build_qwen2 = _causal("Qwen2Config", "Qwen2ForCausalLM", num_key_value_heads=2)
build_mistral = _causal("MistralConfig", "MistralForCausalLM", num_key_value_heads=2)
build_gemma2 = _causal("Gemma2Config", "Gemma2ForCausalLM", num_key_value_heads=2, head_dim=16)
build_phi3 = _causal("Phi3Config", "Phi3ForCausalLM")
build_gpt_neox = _causal("GPTNeoXConfig", "GPTNeoXForCausalLM")
build_mixtral = _causal("MixtralConfig", "MixtralForCausalLM", num_key_value_heads=2, num_local_experts=4)
build_qwen2_moe = _causal("Qwen2MoeConfig", "Qwen2MoeForCausalLM", num_key_value_heads=2, num_experts=4,
                          moe_intermediate_size=32, shared_expert_intermediate_size=64)


def build_opt(seed: int) -> nn.Module:
    tf = _transformers()
    cfg = tf.OPTConfig(vocab_size=VOCAB, hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4,
                       word_embed_proj_dim=64, max_position_embeddings=2 * SEQ, pad_token_id=0, bos_token_id=1,
                       eos_token_id=2)
    with seeded(seed):
        return tf.OPTForCausalLM(cfg)  # type: ignore[no-any-return]


class Seq2Seq(nn.Module):
    """T5 as a user trains it: `model(input_ids, labels=...)` is the library's loss; here the decoder is fed the
    labels shifted right (what `labels=` does inside) and the loss is taken on the logits."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, inputs: dict[str, torch.Tensor]) -> Any:
        return self.model(input_ids=inputs["input_ids"], decoder_input_ids=inputs["decoder_input_ids"])


def build_t5(seed: int) -> nn.Module:
    tf = _transformers()
    cfg = tf.T5Config(vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4,
                      decoder_start_token_id=0, pad_token_id=0, eos_token_id=2)
    with seeded(seed):
        return Seq2Seq(tf.T5ForConditionalGeneration(cfg))


def t5_batch(seed: int, rows: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Copy-and-shift: the decoder learns the encoder's sequence one step ahead (decoder start token 0)."""
    g = torch.Generator().manual_seed(seed)
    source = torch.randint(3, VOCAB, (rows, SEQ), generator=g)
    target = (source + 1) % VOCAB
    decoder = torch.cat([torch.zeros(rows, 1, dtype=torch.long), target[:, :-1]], dim=1)
    return {"input_ids": source, "decoder_input_ids": decoder}, target


def build_vit(seed: int) -> nn.Module:
    from torchvision.models import VisionTransformer

    with seeded(seed):
        return VisionTransformer(image_size=16, patch_size=4, num_layers=2, num_heads=4, hidden_dim=64, mlp_dim=128,
                                 num_classes=CLASSES)


def build_convnext(seed: int, stochastic_depth: float = 0.0) -> nn.Module:
    """torchvision's ConvNeXt with two stages of one block (its LayerNorm2d, layer scale and `StochasticDepth`);
    with `stochastic_depth` the blocks drop whole samples' residual branches (torchvision's `bernoulli_`)."""
    from torchvision.models.convnext import CNBlockConfig, ConvNeXt

    settings = [CNBlockConfig(16, 32, 1), CNBlockConfig(32, None, 1)]
    with seeded(seed):
        return ConvNeXt(settings, stochastic_depth_prob=stochastic_depth, num_classes=CLASSES)


def build_swin(seed: int, stochastic_depth: float = 0.2) -> nn.Module:
    """torchvision's Swin Transformer as Swin-T builds it (shifted windows, patch merging, relative position bias,
    stochastic depth 0.2), at two stages of two blocks over 16x16 images in 4x4 windows."""
    from torchvision.models import SwinTransformer

    with seeded(seed):
        return SwinTransformer(patch_size=[2, 2], embed_dim=32, depths=[2, 2], num_heads=[2, 4], window_size=[4, 4],
                               stochastic_depth_prob=stochastic_depth, num_classes=CLASSES)


def build_efficientnet(seed: int) -> nn.Module:
    """torchvision's EfficientNet as EfficientNet-B0 builds it (MBConv with squeeze-excitation, BatchNorm,
    stochastic depth 0.2 rising with depth, classifier dropout 0.2), at two MBConv stages."""
    from torchvision.models.efficientnet import EfficientNet, MBConvConfig

    settings = [MBConvConfig(1, 3, 1, 16, 16, 1), MBConvConfig(4, 3, 2, 16, 24, 2)]
    with seeded(seed):
        return EfficientNet(settings, dropout=0.2, stochastic_depth_prob=0.2, num_classes=CLASSES)


class Holder(nn.Module):
    """A user's module around the library's model: `self.lm = model; forward(x): return self.lm(x)`, the form
    a training script takes when it adds something of its own; every name gains the `lm.` prefix."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.lm = model

    def forward(self, inputs: Any) -> Any:
        return self.lm(inputs)


def held(build: Any, seed: int) -> nn.Module:
    """build(seed) inside a Holder (use as partial(held, build))."""
    return Holder(build(seed))
