"""Degrees as data (parallel/dims.py) and tensor-parallel plans (parallel/tensor/plan.py): pure logic, one
process. The N-D layouts train in the correctness matrix (tp, fsdp+tp, ddp+tp columns)."""

from __future__ import annotations

import pytest
import torch
import zoo
from torch import nn
from zoo import archs

from paratrain import ParatrainError, strategies
from paratrain.config import Config, validate
from paratrain.parallel.dims import ParallelDims, canonical, dims_for
from paratrain.parallel.tensor.plan import check_plan, describe, find_plan


@pytest.mark.parametrize(("name", "world", "sizes", "want"), [
    ("fsdp+tp", 4, {}, ParallelDims(dp_shard=2, tp=2)),
    ("tp+fsdp", 8, {"tp_size": 4}, ParallelDims(dp_shard=2, tp=4)),
    ("ddp+tp", 4, {}, ParallelDims(dp_replicate=2, tp=2)),
    ("tp", 4, {}, ParallelDims(tp=4)),
    ("ddp+fsdp", 8, {}, ParallelDims(dp_replicate=2, dp_shard=4)),
    ("ddp+fsdp", 8, {"dp_replicate": 4}, ParallelDims(dp_replicate=4, dp_shard=2)),
    ("fsdp+tp+pp", 8, {}, ParallelDims(dp_shard=2, tp=2, pp=2)),
    ("tp+pp", 4, {}, ParallelDims(tp=2, pp=2)),
    ("ddp+pp", 4, {}, ParallelDims(dp_replicate=2, pp=2)),
])
def test_degrees_follow_the_grammar_and_fill_the_world(name: str, world: int, sizes: dict, want: ParallelDims) -> None:
    dims = dims_for(name, world, **sizes)
    assert dims == want and dims.world == world


@pytest.mark.parametrize(("name", "world", "sizes", "said"), [
    ("fsdp+tp", 6, {"tp_size": 4}, "world 6 is not a multiple of tp 4 x pp 1 = 4"),
    ("fsdp+tp", 2, {"tp_size": 2}, "fsdp 1 leaves that axis idle"),
    ("tp", 4, {"tp_size": 2}, "tp 2 x pp 1 = 2 covers only part of world 4"),
    ("fsdp", 4, {"tp_size": 2}, "use strategy 'fsdp+tp'"),
    ("fsdp+tp", 4, {"dp_replicate": 2}, "use strategy 'ddp+fsdp+tp'"),
    ("ddp+fsdp", 6, {"dp_replicate": 4}, "use a dp_replicate that divides 6"),
    ("fsdp+zp", 4, {}, "unknown: zp"),
    ("tp+tp", 4, {}, "each word once"),
])
def test_impossible_degrees_are_refused_with_the_arithmetic(name: str, world: int, sizes: dict, said: str) -> None:
    with pytest.raises(ParatrainError, match=None) as err:
        dims_for(name, world, **sizes)
    assert said in str(err.value)


def test_pipelines_of_tensor_parallel_and_sharded_stages_are_checked() -> None:
    from helpers import check_job

    check_job("tp+pp", 4, tp_size=2, microbatches=4)  # accepted: pipelines of tensor-parallel stages
    check_job("ddp+tp+pp", 8, tp_size=2, pp_size=2, microbatches=4)
    check_job("fsdp+pp", 4, microbatches=4)  # and of FSDP-sharded ones (matrix columns fsdp+pp, fsdp+tp+pp)
    check_job("fsdp+tp+pp", 8, tp_size=2, microbatches=4)
    check_job("ddp+fsdp+pp", 8, dp_replicate=2, microbatches=4)
    with pytest.raises(ParatrainError, match="precision='16'"):  # what every pipeline checks
        check_job("tp+pp", 4, tp_size=2, microbatches=4, precision="16")
    assert strategies.get("tp+pp").microbatched and not strategies.get("fsdp+tp").microbatched


def test_a_tie_between_two_stages_of_one_rank_is_refused_under_fsdp() -> None:
    """A V schedule puts the first and the last stage on one rank: an embedding tied to the head would be one
    Parameter in two FSDP units, which torch cannot shard; refused with the fix before anything is sharded."""
    from paratrain.parallel.pipeline.partition import Stage
    from paratrain.parallel.pipeline.sharded import _check_ties

    emb, head = nn.Embedding(8, 4), nn.Linear(4, 8, bias=False)
    head.weight = emb.weight
    first, last = Stage([("emb", emb)], index=0), Stage([("head", head)], index=3)
    _check_ties([first, Stage([("mid", nn.Linear(4, 4))], index=1)])  # one stage each: nothing to refuse
    with pytest.raises(ParatrainError, match="tied between stages 0 and 3") as err:
        _check_ties([first, last])
    assert "stages_per_worker=1" in str(err.value)


def test_ranks_lie_tensor_innermost_and_replicas_load_their_own_rows() -> None:
    dims = ParallelDims(dp_replicate=2, dp_shard=2, tp=2)
    assert [dims.coordinates(r)["tp"] for r in range(8)] == [0, 1] * 4
    assert [dims.data_shard(r) for r in range(8)] == [(0, 4), (0, 4), (1, 4), (1, 4), (2, 4), (2, 4), (3, 4), (3, 4)]


def test_strategy_names_are_presets_or_n_d() -> None:
    assert strategies.get("pp+ddp").name == "ddp+pp"  # a preset's words in another order are the preset
    assert strategies.get("tp+fsdp").name == "fsdp+tp" == canonical("tp+fsdp")
    assert validate(Config(strategy="fsdp+tp", tp_size=2)).tp_size == 2
    with pytest.raises(ParatrainError, match="unknown strategy|not one of|did you mean"):
        validate(Config(strategy="fdsp"))


def test_plans_come_from_the_config_the_structure_or_the_user() -> None:
    llama = zoo.MODELS["hf_llama"].build(0)
    plan, source = find_plan(llama, None)
    assert "base_model_tp_plan" in source
    assert plan["model.layers.1.self_attn.q_proj"] == "colwise" and plan["model.layers.0.mlp.down_proj"] == "rowwise"
    mine = zoo.MODELS["llama"].build(0)
    plan, source = find_plan(mine, None)
    assert source == "the model's structure"
    assert {plan[f"blocks.0.attn.{n}"] for n in ("wq", "wk", "wv")} == {"colwise"}
    assert plan["blocks.0.attn.wo"] == "rowwise" and plan["blocks.1.mlp.down"] == "rowwise"
    assert "blocks.*.attn.wq colwise" in describe(plan, source, 2)
    plan, source = find_plan(mine, {"blocks.*.mlp.up": "colwise", "blocks.*.mlp.down": "rowwise"})
    assert source == "tp_plan" and sorted(plan) == ["blocks.0.mlp.down", "blocks.0.mlp.up", "blocks.1.mlp.down",
                                                    "blocks.1.mlp.up"]


def test_fused_projections_and_hugging_face_styles_are_planned() -> None:
    plan, _ = find_plan(zoo.MODELS["gpt"].build(0), None)  # packed or interleaved: the check on the example settles
    assert plan["blocks.0.attn.qkv"] == "fused" and plan["blocks.0.attn.proj"] == "rowwise"
    plan, _ = find_plan(zoo.MODELS["hf_gpt2"].build(0), None)  # Conv1D layers, the fused c_attn among them
    assert plan["transformer.h.1.attn.c_attn"] == "fused" and plan["transformer.h.1.mlp.c_proj"] == "rowwise"
    phi3 = archs.build_phi3(0)
    plan, source = find_plan(phi3, None)  # the config's own styles, mapped
    assert "Phi3Config" in source or "Phi3ForCausalLM" in source
    assert plan["model.layers.0.self_attn.qkv_proj"] == "colwise_gather_output"
    assert plan["model.layers.0.mlp.down_proj"] == "rowwise_split_input"
    mixtral = archs.build_mixtral(0)
    plan, _ = find_plan(mixtral, None)  # experts: the module, and its weights' styles (tests/test_transformers_release)
    assert plan["model.layers.0.mlp.experts"] == "experts"
    assert plan["model.layers.0.mlp.experts.gate_up_proj"] == "packed_colwise"
    config = mixtral.config  # transformers 5.24 named the experts in the tensor plan, with no expert plan
    config.base_model_tp_plan = {"layers.*.self_attn.q_proj": "colwise", "layers.*.self_attn.o_proj": "rowwise",
                                 "layers.*.mlp.experts.gate_up_proj": "packed_colwise",
                                 "layers.*.mlp.experts.down_proj": "rowwise", "layers.*.mlp.experts": "moe_tp_experts"}
    config.base_model_ep_plan = None
    plan, source = find_plan(mixtral, None)
    assert plan["model.layers.1.mlp.experts"] == "experts" and "base_model_ep_plan" not in source
    assert plan["model.layers.1.mlp.experts.down_proj"] == "rowwise" and "model.layers.0.self_attn.k_proj" not in plan
    config.base_model_tp_plan = {"layers.*.self_attn.q_proj": "colwise", "layers.*.self_attn.o_proj": "rowwise"}
    config.base_model_ep_plan = {"layers.*.mlp.experts": "ep_dispatch_experts"}
    mixtral.model.layers[0].mlp.experts.is_transposed = True  # stored (experts, in, out): left whole, not guessed
    plan, _ = find_plan(mixtral, None)
    assert "model.layers.0.mlp.experts" not in plan and plan["model.layers.1.mlp.experts"] == "experts"
    wrapped = nn.ModuleDict({"lm": phi3})  # a Hugging Face model inside the user's module: its plan, prefixed
    plan, _ = find_plan(wrapped, None)
    assert plan["lm.model.layers.1.self_attn.o_proj"] == "rowwise_split_input"
    t5 = archs.build_t5(0)  # no declared plan: found by structure, T5's head-indexed position bias split with the heads
    plan, _ = find_plan(t5, None)
    attention = "model.encoder.block.0.layer.0.SelfAttention"
    assert plan[f"{attention}.relative_attention_bias"] == "colwise" and plan[f"{attention}.o"] == "rowwise"
    assert plan["model.decoder.block.1.layer.2.DenseReluDense.wo"] == "rowwise"


def test_plans_that_cannot_be_right_are_refused_by_name() -> None:
    qwen2 = archs.build_qwen2(0)  # grouped-query attention: 4 query heads, 2 key/value heads
    kv = r"2 key/value heads \(Qwen2Config.num_key_value_heads\).*tp_size in \[1, 2\]"
    with pytest.raises(ParatrainError, match=kv):
        check_plan(qwen2, find_plan(qwen2, None)[0], 4)
    with pytest.raises(ParatrainError, match="matches no module.*its Linear layers: 0, 2"):
        find_plan(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4)), {"blocks.*.q": "colwise"})
    with pytest.raises(ParatrainError, match="style 'sequence'"):
        find_plan(nn.Sequential(nn.Linear(4, 8)), {"0": "sequence"})
    mine = zoo.MODELS["llama"].build(0)
    plan, _ = find_plan(mine, None)
    with pytest.raises(ParatrainError, match=r"blocks\.0\.attn\.wq \(colwise\) has 32 output features, which 3"):
        check_plan(mine, plan, 3)
    cnn = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 4))
    with pytest.raises(ParatrainError, match=r"BatchNorm \(1\)"):
        check_plan(cnn, {"0": "colwise"}, 2)
    with pytest.raises(ParatrainError, match="found no attention or MLP blocks"):
        find_plan(nn.Sequential(nn.Conv2d(3, 4, 3)), None)
    assert torch.is_tensor(mine.blocks[0].attn.wq.weight)


def test_every_strategy_has_its_degrees_built_once_per_context() -> None:
    import torch

    from paratrain.config import make_config
    from paratrain.runtime import Placement
    from paratrain.strategies import Context

    def ctx(strategy: str, world: int, **options: object) -> Context:
        return Context(config=make_config({"strategy": strategy, **options}),
                       placement=Placement(world_size=world, local_world_size=world), device=torch.device("cpu"))

    four = ctx("fsdp+ep", 4, ep_size=2)
    assert four.dims is four.dims and (four.dims.dp_shard, four.dims.ep) == (4, 2)  # one object, not re-parsed
    assert [ctx(name, 4).dims.sizes() for name in ("ddp", "fsdp", "pp")] == [
        {"pp": 1, "dp_replicate": 4, "dp_shard": 1, "cp": 1, "tp": 1},
        {"pp": 1, "dp_replicate": 1, "dp_shard": 4, "cp": 1, "tp": 1},
        {"pp": 4, "dp_replicate": 1, "dp_shard": 1, "cp": 1, "tp": 1}]
    assert ctx("single", 1).dims.world == 1 and ctx("tp+cp", 4).dims.describe() == "cp 2 x tp 2"
    with pytest.raises(ParatrainError, match="world 6 is not a multiple"):
        _ = ctx("fsdp+tp", 6, tp_size=4).dims


def test_ranks_loading_different_rows_are_grouped_by_arithmetic() -> None:
    """The router statistics' data-parallel groups come from the degrees alone (no collective to find them)."""
    assert dims_for("ddp", 4).replica_groups() == ((0, 1, 2, 3),)
    assert dims_for("fsdp+tp", 4).replica_groups() == ((0, 2), (1, 3))
    assert dims_for("ddp+tp+pp", 8, pp_size=2).replica_groups() == ((0, 2), (1, 3), (4, 6), (5, 7))
    assert dims_for("fsdp+cp", 4).replica_groups() == ((0, 2), (1, 3))
