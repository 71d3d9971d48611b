"""A GPT described by its shapes, for models too large to build here (a few billion parameters).

Per transformer block of hidden size h, feed-forward size f, sequence s (per sample):

    parameters   4h^2 + 2hf + 9h + f                      (QKV, projection, two MLP matrices, biases, 2 LayerNorms)
    forward      2s(4h^2 + 2hf) + 4s^2 h   FLOPs          (matrix products; attention scores and values)
    backward     twice the forward; the weight-gradient half of the matrix products is what a zero-bubble
                 schedule defers, attention's backward is all input gradient
    saved        2sh float32 (both LayerNorm inputs: the residual stream stays float32 under autocast)
                 + s(7h + 2f) in the compute precision (QKV input, q/k/v, attention output, projection
                 input, MLP input, GELU input and output), with fused attention (no s x s matrix kept)

Tensor parallelism splits a block as Megatron does: every matrix product and the attention over the heads run
on a 1/tp share; the QKV, projection and two MLP weights (and the column-split biases) divide by tp; of the
saved activations, q/k/v, the attention output, the projection input and both GELU tensors, s(5h + 2f); two
all-reduces of the block's output forward (after the projection and the MLP) and two of its input gradient
backward (QKV, MLP input), each s*h in the compute precision.

The embedding (token and position tables) opens the chain and the head (final LayerNorm, the
vocabulary projection, cross-entropy, whose float32 log-probabilities are kept: 4sV bytes) closes it,
so a pipeline can split the model at block boundaries. These are the formulas of Narayanan et al.
(SC'21) and Korthikanti et al. (2022), adjusted to what eager PyTorch under autocast keeps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..errors import ParatrainError, unknown_name
from .costs import LayerCost, Profile

_COMPUTE_BYTES = {"32": 4, "bf16": 2, "16": 2}


@dataclass(frozen=True, kw_only=True)
class GPT:
    name: str
    layers: int
    hidden: int
    heads: int
    seq: int = 2048
    vocab: int = 51200
    ffn: int = 0
    """Feed-forward width (0: 4 x hidden)."""

    @property
    def f(self) -> int:
        return self.ffn or 4 * self.hidden

    def block_params(self) -> int:
        h, f = self.hidden, self.f
        return 4 * h * h + 2 * h * f + 9 * h + f

    def params(self) -> int:
        embedding, head = (self.vocab + self.seq) * self.hidden, self.vocab * self.hidden + 2 * self.hidden
        return self.layers * self.block_params() + embedding + head


# Shapes of published GPT configurations (sequence 2048, vocabulary 51,200): Megatron-LM's 1.7B, 3.6B
# and 7.5B rows of Narayanan et al., SC'21, Table 1; NeMo's GPT-3 5B (24 layers of 4096).
PRESETS = {
    "gpt-1.7b": GPT(name="gpt-1.7b", layers=24, hidden=2304, heads=24),
    "gpt-3.6b": GPT(name="gpt-3.6b", layers=30, hidden=3072, heads=32),
    "gpt-5b": GPT(name="gpt-5b", layers=24, hidden=4096, heads=32),
    "gpt-7.5b": GPT(name="gpt-7.5b", layers=36, hidden=4096, heads=32),
}


def get(name: str) -> GPT:
    if name not in PRESETS:
        raise unknown_name("analytic model", name, PRESETS)
    return PRESETS[name]


def profile(gpt: GPT, precision: str = "bf16", optimizer: str = "adam") -> Profile:
    """The planner's view of `gpt`: embedding, one layer per block, head (costs per sample)."""
    if precision not in _COMPUTE_BYTES:
        raise ParatrainError(f"precision {precision!r} is not one of {sorted(_COMPUTE_BYTES)}")
    c, s, h, f, v = _COMPUTE_BYTES[precision], gpt.seq, gpt.hidden, gpt.f, gpt.vocab
    matmul = 2 * s * (4 * h * h + 2 * h * f)
    attention = 4 * s * s * h
    residual = 4 * s * h  # float32 residual stream: what one block hands to the next
    block = LayerCost(
        name="block", params=gpt.block_params(), param_bytes=4 * gpt.block_params(),
        flops_fwd=matmul + attention, flops_bwd=2 * (matmul + attention),
        weight_share=matmul / (2 * matmul + 2 * attention),
        activation_bytes=4 * 2 * s * h + c * s * (7 * h + 2 * f) + 4 * s * gpt.heads, output_bytes=residual,
        tp_share=1.0, tp_activation_share=c * s * (5 * h + 2 * f) / (4 * 2 * s * h + c * s * (7 * h + 2 * f)),
        tp_params=4 * h * h + 2 * h * f + 3 * h + f, tp_forward_reduces=(c * s * h,) * 2,
        tp_backward_reduces=(c * s * h,) * 2)
    embed_params = (v + s) * h
    embed = LayerCost(name="embed", params=embed_params, param_bytes=4 * embed_params, flops_fwd=2 * s * h,
                      flops_bwd=2 * s * h, weight_share=1.0, activation_bytes=8 * s, output_bytes=residual)
    head_params = v * h + 2 * h
    head = LayerCost(name="head", params=head_params, param_bytes=4 * head_params, flops_fwd=2 * s * h * v,
                     flops_bwd=4 * s * h * v, weight_share=0.5,
                     activation_bytes=4 * s * h + c * s * h + 4 * s * v, output_bytes=4)
    blocks = [LayerCost(**{**block.__dict__, "name": f"block{i}"}) for i in range(gpt.layers)]
    return Profile(name=gpt.name, layers=[embed, *blocks, head], sample_bytes=16 * s, tokens_per_sample=s,
                   source="analytic", precision=precision, optimizer=optimizer, tp_width=math.gcd(gpt.heads, f),
                   tp_note="Megatron's split of each block (attention heads, MLP)")
