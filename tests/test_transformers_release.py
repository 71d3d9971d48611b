"""What paratrain relies on in transformers, each checked so that a release that moves it fails with the release
named: where a mixture-of-experts config declares its experts (tensor parallelism's plan reads it; expert
parallelism must find the same modules by their form), and how a Llama given a context-parallel rank's positions
and a mask of ones calls SDPA (context parallelism takes it as causal attention over the whole sequence).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.nn import functional as F
from zoo import archs

from paratrain.parallel.context import means_causal, shares
from paratrain.parallel.expert.find import find
from paratrain.parallel.tensor.plan import find_plan
from paratrain.parallel.tensor.styles import HF_EP_EXPERTS, HF_STYLES

tf = pytest.importorskip("transformers")
RELEASE = f"transformers {tf.__version__}"


def _tiny(config_class: Any, **sizes: Any) -> Any:
    return config_class(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, num_experts_per_tok=2, **sizes)


MOE = {
    "Mixtral": lambda: archs.build_mixtral(0),
    "Qwen2-MoE": lambda: tf.Qwen2MoeForCausalLM(_tiny(tf.Qwen2MoeConfig, num_experts=4, moe_intermediate_size=24,
                                                      shared_expert_intermediate_size=40)),
    "Qwen3-MoE": lambda: tf.Qwen3MoeForCausalLM(_tiny(tf.Qwen3MoeConfig, num_experts=4, moe_intermediate_size=24)),
}


@pytest.mark.parametrize("name", list(MOE))
def test_a_moe_config_declares_its_experts_where_the_plan_reads_them(name: str) -> None:
    model = MOE[name]()
    config = type(model.config)
    tp = {k: v for k, v in (config.base_model_tp_plan or {}).items() if k.endswith("mlp.experts")}
    ep = {k: v for k, v in (getattr(config, "base_model_ep_plan", None) or {}).items() if k.endswith("mlp.experts")}
    declared = [HF_STYLES.get(v) == "experts" for v in tp.values()] + [v == HF_EP_EXPERTS for v in ep.values()]
    assert any(declared), (
        f"{RELEASE}: {config.__name__} declares its experts neither in base_model_tp_plan ({tp or 'absent'}; 5.24: "
        f"'moe_tp_experts') nor in base_model_ep_plan ({ep or 'absent'}; 5.25: {HF_EP_EXPERTS!r}): find where this "
        "release declares them and read it in parallel/tensor/plan.py (_hf_plan)")
    plan, source = find_plan(model, None)
    experts = "model.layers.0.mlp.experts"
    assert plan.get(experts) == "experts" and plan.get(f"{experts}.gate_up_proj") == "packed_colwise", (
        f"{RELEASE}: the tensor plan of {name} ({source}) leaves its experts out: "
        f"{ {k: v for k, v in plan.items() if 'layers.0.mlp' in k} }")
    assert plan.get(f"{experts}.down_proj") == "rowwise"
    grouped = {e.path for e in find(model) if e.kind == "grouped"}
    named = {n for n, s in plan.items() if s == "experts"}
    assert grouped == named, (
        f"{RELEASE}: expert parallelism recognises {sorted(grouped - named) or 'no more'} beyond the experts "
        f"{name}'s config declares and misses {sorted(named - grouped) or 'none'} (parallel/expert/find.py: 3-D "
        "weights on a first dimension of num_experts, called as experts(hidden_states, top_k_index, top_k_weights))")


def test_a_llama_without_its_cache_attends_causally_over_a_ranks_positions_given_a_mask_of_ones() -> None:
    """Rank 0 of two holds positions 0 1 6 7. Given no attention_mask and no cache, transformers 5.25 reads the
    jump as a second packed document (masking_utils.find_packed_sequence_indices) and masks across it, on that rank
    only; given a mask of ones, as context parallelism passes it, Llama calls SDPA with `is_causal` and no mask on
    every rank (or, where it builds one, the causal mask of the positions, which context parallelism takes)."""
    tf.logging.set_verbosity_error()
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(tf.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                               max_position_embeddings=16, use_cache=False))
    original, seen = F.scaled_dot_product_attention, []

    def spy(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: Any = None,
            is_causal: bool = False, **kwargs: Any) -> torch.Tensor:
        seen.append((attn_mask, is_causal))
        return original(query, key, value, attn_mask=attn_mask, is_causal=is_causal, **kwargs)

    ids = torch.zeros(2, 8, dtype=torch.long)
    F.scaled_dot_product_attention = spy  # type: ignore[assignment]
    try:
        for rank in range(2):
            positions = shares(16, 2, rank)
            seen.clear()
            model(ids, attention_mask=torch.ones_like(ids), position_ids=positions[None].expand(2, -1))
            assert seen, f"{RELEASE}: LlamaForCausalLM (SDPA) no longer calls F.scaled_dot_product_attention"
            for mask, causal in seen:
                assert (mask is None and causal) or (mask is not None and means_causal(mask, positions)), (
                    f"{RELEASE}: Llama without its cache, given an attention_mask of ones and positions "
                    f"{positions.tolist()}, calls SDPA with is_causal={causal} and a mask "
                    f"{None if mask is None else mask[0, 0].int().tolist()}, which context parallelism does not "
                    "take as causal attention (parallel/context.py: the mask of ones it passes, means_causal)")
    finally:
        F.scaled_dot_product_attention = original  # type: ignore[assignment]
