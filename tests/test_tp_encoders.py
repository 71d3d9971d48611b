"""Encoders under tensor parallelism: BERT's layout keeps each half of a colwise/rowwise pair in its own module
(`attention.self.query/key/value` feeding `attention.output.dense`, `intermediate.dense` feeding `output.dense`), so
the structural plan pairs sibling modules. RoBERTa and DeBERTa-v2 (its `query_proj/key_proj/value_proj`), built
from tiny configs with every other setting at the library's default (dropout included, drawn by the documented
rule), train under tp 2 like the plain loop; a model whose blocks no rule recognises is refused with a plan
written in its own module paths."""

from __future__ import annotations

import re

import pytest
import zoo
from archs_cells import ArchCell
from archs_verdicts import MATCH, sweep_cells
from torch import nn
from zoo.archs import TINY_LM
from zoo.case import ZooCase, seeded
from zoo.data import hf_class_loss
from zoo.hf import _transformers, bert_ids_batch

from paratrain.errors import ParatrainError
from paratrain.parallel.tensor.plan import find_plan

ENCODER = {k: v for k, v in TINY_LM.items() if k not in ("bos_token_id", "eos_token_id", "pad_token_id")}


def build_roberta(seed: int) -> nn.Module:
    tf = _transformers()
    with seeded(seed):
        return tf.RobertaForSequenceClassification(tf.RobertaConfig(**ENCODER, num_labels=3))  # type: ignore[no-any-return]


def build_deberta_v2(seed: int) -> nn.Module:
    tf = _transformers()
    with seeded(seed):
        return tf.DebertaV2ForSequenceClassification(  # type: ignore[no-any-return]
            tf.DebertaV2Config(**ENCODER, num_labels=3))


def _case(name: str, build: object) -> ZooCase:
    return ZooCase(name=name, about=f"transformers {name} for sequence classification, library defaults",
                   build=build, batch=bert_ids_batch, loss_fn=hf_class_loss,  # type: ignore[arg-type]
                   tolerances=zoo.MODELS["hf_bert"].tolerances, lr=0.2)


def test_bert_style_blocks_are_paired_across_their_modules() -> None:
    plan, source = find_plan(build_deberta_v2(0), None)
    assert source == "the model's structure"
    layer = "deberta.encoder.layer.1"
    assert {plan[f"{layer}.attention.self.{n}_proj"] for n in ("query", "key", "value")} == {"colwise"}
    assert plan[f"{layer}.attention.output.dense"] == "rowwise"
    assert plan[f"{layer}.intermediate.dense"] == "colwise" and plan[f"{layer}.output.dense"] == "rowwise"
    assert "pooler.dense" not in plan and "classifier" not in plan  # no pair: left whole
    plan, _ = find_plan(build_roberta(0), None)
    assert plan["roberta.encoder.layer.0.attention.self.query"] == "colwise"
    assert not any(name.startswith("classifier.") for name in plan)  # dense + out_proj: a head, not a block


class _Odd(nn.Module):
    """Blocks under names no rule knows."""

    def __init__(self) -> None:
        super().__init__()
        self.cells = nn.ModuleList(nn.ModuleDict({"mix_a": nn.Linear(8, 16), "mix_b": nn.Linear(16, 8)})
                                   for _ in range(2))
        self.head = nn.Linear(8, 2)


def test_the_refusal_suggests_a_plan_in_the_models_own_paths() -> None:
    with pytest.raises(ParatrainError, match="found no attention or MLP blocks") as info:
        find_plan(_Odd(), None)
    said = str(info.value)
    assert "cells.*.mix_a, cells.*.mix_b, head" in said, said
    assert re.search(r"tp_plan=\{'cells\.\*\.mix_a': 'colwise', 'cells\.\*\.mix_b': 'rowwise'\}", said), said
    assert "blocks.*.attn" not in said  # no placeholder paths


@pytest.mark.procs
@pytest.mark.timeout(400)
def test_roberta_and_deberta_v2_train_under_tp_like_the_plain_loop() -> None:
    cells = [(ArchCell("roberta", "tp"), _case("roberta", build_roberta)),
             (ArchCell("deberta_v2", "tp"), _case("deberta_v2", build_deberta_v2))]
    verdicts = sweep_cells(cells, limit_s=180)
    assert all(v.status == MATCH for v in verdicts), [(v.label, v.short, v.detail[:600]) for v in verdicts]
