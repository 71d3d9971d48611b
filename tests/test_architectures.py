"""Architectures as their libraries build them (zoo.ARCHS, zoo/causal_lms.py) against the plain loop: CI runs a
handful of cells, one per mechanism, and the sweep's own machinery (verdicts, time limits, the table); the
whole sweep (every named architecture x layout, every causal LM of transformers) is `make test-archs`.

CI_CELLS: a grouped-query decoder under tp (Qwen2: separate q/k/v, 2 key/value heads over 2 ranks), a model
whose projections are fused under tp (Phi-3: qkv_proj and gate_up_proj), OPT under tp (dropout called as a
function, its attention's head count an attribute set to the rank's share), a mixture of experts under pp
(Mixtral), a vision transformer under pp (ViT), and ConvNeXt with stochastic depth (`bernoulli_`) under tp and
under pp. Each must match the plain loop (randomness drawn by the documented rule, restated in
zoo.dropout_rule), or be refused as archs_refused.txt says.
"""

from __future__ import annotations

import importlib.util
import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import zoo
from archs_cells import ArchCell
from archs_verdicts import DIFFERS, FAIL, MATCH, REFUSED, drawn, judge, reference, short_reason, sweep_cells
from helpers import refused_list
from torch import nn
from torch.nn import functional as F
from zoo import causal_lms, randomness
from zoo.case import ZooCase
from zoo.data import mse, regression_batch
from zoo.dropout_rule import covers

ROOT = Path(__file__).resolve().parents[1]
REFUSED_FILE = Path(__file__).with_name("archs_refused.txt")
CI_CELLS = (("qwen2", "tp"), ("phi3", "tp"), ("opt", "tp"), ("mixtral", "pp"), ("vit", "pp"), ("convnext_sd", "tp"),
            ("convnext_sd", "pp"))


def refused_cells() -> tuple[dict[str, str], int]:
    """The refused cells (label -> text the refusal must contain) and the count recorded in the file."""
    return refused_list(REFUSED_FILE)


LISTED, RECORDED = refused_cells()


def test_refused_list_only_shrinks() -> None:
    every = {ArchCell(arch, layout).label for arch, layout in CI_CELLS}
    assert not set(LISTED) - every, f"refused cells CI does not run: {sorted(set(LISTED) - every)}"
    assert len(LISTED) <= RECORDED, (f"{len(LISTED)} refused cells, but {REFUSED_FILE.name} records {RECORDED}: "
                                      "a cell that trained is refused now; fix it rather than list it")
    assert len(LISTED) == RECORDED, f"the refused set shrank to {len(LISTED)}: lower the recorded count to match"


def expectation_problems(verdict: Any, case: ZooCase) -> list[str]:
    """What is wrong with a CI cell's verdict, against archs_refused.txt and the randomness rule."""
    expected = LISTED.get(verdict.label)
    if verdict.status == FAIL:
        return [f"{verdict.label}: {verdict.short}\n{verdict.detail[:1500]}"]
    if verdict.status == REFUSED:
        if expected is None:
            return [f"{verdict.label}: refused, but expected to train: {verdict.detail[:400]}"]
        if expected not in verdict.detail:
            return [f"{verdict.label}: refused with {verdict.detail[:300]!r}; the expected reason says {expected!r}"]
        return []
    if expected is not None:
        return [f"{verdict.label}: trains now ({verdict.short}); remove it from {REFUSED_FILE.name}"]
    if verdict.status == DIFFERS and covers(drawn(case)):
        return [f"{verdict.label}: differs, though the rule covers its randomness: {verdict.detail[:400]}"]
    return []


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_ci_cells_match_or_are_refused_by_name() -> None:
    cells = [(ArchCell(arch, layout), zoo.ARCHS[arch]) for arch, layout in CI_CELLS]
    verdicts = sweep_cells(cells, limit_s=180)
    problems = [p for verdict, (_, case) in zip(verdicts, cells) for p in expectation_problems(verdict, case)]
    assert not problems, "\n".join(problems)
    assert any(v.status == MATCH for v in verdicts)


class Hangs(nn.Module):
    """A forward that never returns (a deadlock, an endless loop)."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(3600)
        return self.layer(x)


class FailsOnRankOne(nn.Module):
    """A raw error on one rank only: the other goes on into the gradients' all-reduce and waits there."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if os.environ.get("RANK") == "1":
            raise RuntimeError("a raw error inside the model")
        return self.layer(x)


def _case(name: str, build: Any) -> ZooCase:
    return ZooCase(name=name, about=name, build=lambda seed: build(), batch=regression_batch, loss_fn=mse,
                   tolerances=zoo.MODELS["mlp"].tolerances, lr=0.1)


@pytest.mark.procs
@pytest.mark.timeout(180)
def test_a_hang_or_a_raw_error_fails_its_cell_and_the_next_cells_still_run() -> None:
    cells = [(ArchCell("hangs", "ddp"), _case("hangs", Hangs)),
             (ArchCell("fails", "ddp"), _case("fails", FailsOnRankOne)),
             (ArchCell("mlp", "ddp"), zoo.MODELS["mlp"])]
    hang, error, fine = sweep_cells(cells, limit_s=8)
    assert (hang.status, error.status, fine.status) == (FAIL, FAIL, MATCH), (hang, error, fine)
    assert hang.short == "FAIL: timed out after 8 s", hang
    assert "a raw error inside the model" in error.short, error


# -- the verdicts, on records written by hand -------------------------------------------------------------------


def _records(case: ZooCase, layout: str, nudge: float = 0.0) -> list[dict[str, Any]]:
    """Two ranks' records of a cell that trained exactly like the reference (losses moved by `nudge`)."""
    from archs_cells import BY_NAME

    want = reference(case, BY_NAME[layout])
    names = sorted(want.weights[-1])
    whole = sum(t.numel() for k, t in want.initial.items() if k in names)
    where = {"names": names, "local": whole, "whole": whole, "tp_local": 0, "tp_whole": 0}
    result = {"losses": [x + nudge for x in want.losses], "weights": want.weights, "where": where,
              "strategy": layout}
    return [{"kind": "ok", "seconds": 1.0, "result": result}] * 2


def test_a_run_like_the_plain_loop_matches_and_one_off_by_a_loss_step_fails() -> None:
    mlp = zoo.MODELS["mlp"]
    assert judge(ArchCell("mlp", "ddp"), mlp, _records(mlp, "ddp")).status == MATCH
    off = judge(ArchCell("mlp", "ddp"), mlp, _records(mlp, "ddp", nudge=1e-3))
    assert off.status == FAIL and "loss" in off.short, off


def test_a_layout_that_did_not_divide_the_work_fails_though_its_numbers_match() -> None:
    mlp = zoo.MODELS["mlp"]
    verdict = judge(ArchCell("mlp", "fsdp"), mlp, _records(mlp, "fsdp"))
    assert verdict.status == FAIL and "not sharded" in verdict.short, verdict


def test_refusals_timeouts_and_disagreeing_ranks() -> None:
    mlp, cell = zoo.MODELS["mlp"], ArchCell("mlp", "pp")
    refusal = {"kind": "refused", "seconds": 0.1, "message": "strategy 'pp': BatchNorm layers of M would normalise"}
    assert judge(cell, mlp, [refusal, refusal]).short == "refused: BatchNorm over a split batch"
    hang = {"kind": "timeout", "seconds": 240.0, "message": "still running after 240 s"}
    assert judge(cell, mlp, [refusal, hang]).short == "FAIL: timed out after 240 s"
    mixed = judge(cell, mlp, [refusal, _records(mlp, "pp")[0]])
    assert mixed.status == FAIL and "ranks disagree" in mixed.short, mixed


class FunctionalDropout(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(F.dropout(x, 0.1, self.training))


class Shuffles(nn.Module):
    """A draw the rule leaves to torch's generator (a permutation)."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x[:, torch.randperm(x.shape[1])] if self.training else x)


def test_randomness_outside_the_rule_differs_rather_than_fails() -> None:
    case = _case("shuffles", Shuffles)
    assert drawn(case) == {randomness.OTHER}
    verdict = judge(ArchCell(case.name, "ddp"), case, _records(case, "ddp", nudge=1e-2))
    assert verdict.status == DIFFERS and verdict.short == "differs: random op outside the rule", verdict
    dropout = _case("functional_dropout", FunctionalDropout)  # drawn by the rule: a run off the reference fails
    assert drawn(dropout) == {randomness.FUNCTIONAL} and covers(drawn(dropout))
    assert judge(ArchCell(dropout.name, "ddp"), dropout, _records(dropout, "ddp", nudge=1e-2)).status == FAIL


def test_short_reasons() -> None:
    assert short_reason("Qwen2ForCausalLM cannot be traced to be split into pipeline stages (torch.export: "
                        "RuntimeError: Found <class 'transformers.cache_utils.DynamicCache'> in output, ...") == (
        "a cache object in the output (use_cache)")
    assert short_reason("tensor parallelism found no attention or MLP blocks in M to shard") == (
        "no tensor-parallel plan")
    assert short_reason("something new went wrong: here is why") == "something new went wrong"


# -- randomness, tiny configs ------------------------------------------------------------------------------------


class Draws(nn.Module):
    def __init__(self, how: str) -> None:
        super().__init__()
        self.how, self.drop = how, nn.Dropout(0.1 if how == "module" else 0.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.how == "sdpa":
            q = x.view(x.shape[0], 1, 4, 4)
            return F.scaled_dot_product_attention(q, q, q, dropout_p=0.1).flatten(1)
        if self.how == "stochastic depth":
            from torchvision.ops import stochastic_depth

            return stochastic_depth(x, 0.2, "row", self.training)
        if self.how == "noise":
            return x + torch.randn_like(x)
        if self.how == "draw":
            return x[:, torch.randperm(x.shape[1])]
        return self.drop(x)


@pytest.mark.parametrize("how, kinds", [("module", {randomness.DROPOUT_MODULE}), ("none", set()),
                                        ("sdpa", {randomness.FUNCTIONAL}),
                                        ("stochastic depth", {randomness.BERNOULLI}), ("noise", {randomness.NOISE}),
                                        ("draw", {randomness.OTHER})])
def test_randomness_kinds_are_read_off_a_forward(how: str, kinds: set[str]) -> None:
    model, inputs = Draws(how).eval(), torch.randn(3, 16)
    state = torch.random.get_rng_state()
    assert randomness.kinds(model, inputs) == kinds
    assert torch.equal(torch.random.get_rng_state(), state) and not model.training
    assert covers(frozenset(kinds)) == (randomness.OTHER not in kinds)


def test_tiny_configs_set_the_sizes_under_each_configs_own_names() -> None:
    gpt2 = causal_lms.tiny_config("gpt2")
    assert (gpt2.n_embd, gpt2.n_layer, gpt2.n_head, gpt2.vocab_size) == (64, 2, 4, 64)
    llama = causal_lms.tiny_config("llama")
    assert (llama.hidden_size, llama.num_key_value_heads, llama.intermediate_size) == (64, 2, 128)
    mbart = causal_lms.tiny_config("mbart")
    assert (mbart.encoder_layers, mbart.decoder_layers, mbart.decoder_attention_heads) == (2, 2, 4)
    moe = causal_lms.tiny_config("qwen3_moe")
    assert (moe.num_experts, moe.num_experts_per_tok, moe.moe_intermediate_size) == (4, 2, 32)
    assert causal_lms.tiny_config("gpt2").attn_pdrop == 0.1  # every other setting at the library's default


def test_the_probe_records_why_a_model_is_not_trained() -> None:
    assert causal_lms.probe("qwen2").case is not None
    multimodal = causal_lms.probe("gemma3")
    assert multimodal.case is None and "composite config" in multimodal.reason, multimodal


# -- the table ---------------------------------------------------------------------------------------------------


def _report() -> Any:
    spec = importlib.util.spec_from_file_location("archs_report", ROOT / "benchmarks" / "archs_report.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_table_and_its_section_in_the_docs(tmp_path: Path) -> None:
    report = _report()
    verdicts = [{"arch": a, "layout": lay, "status": s, "short": t, "strategy": st}
                for a, lay, s, t, st in [("qwen2", "tp", MATCH, "match", "tp"),
                                         ("qwen2", "auto", MATCH, "match", "ddp"),
                                         ("vit", "tp", REFUSED, "refused: a | b", ""),
                                         ("vit", "auto", FAIL, "FAIL: timed out after 240 s", "")]]
    results = {"created": "2026-11-29T00:00:00+00:00", "machine": "m", "torch": "t", "transformers": "x",
               "torchvision": "v", "commit": "c", "seconds": {"named": 1, "probe": 0, "lms": 0, "total": 1},
               "named": verdicts, "lms": [], "probed": {}}
    text = report.markdown(results)
    assert "| qwen2 | match | match (ddp) |" in text and "| vit | refused: a \\| b | FAIL: timed out" in text
    assert "| trains like the plain loop | **1/2** (50%) | **1/2** (50%) |" in text
    doc = tmp_path / "doc.md"
    doc.write_text(f"before\n{report.BEGIN}\nold\n{report.END}\nafter\n")
    report.write_docs(text, doc)
    assert doc.read_text() == f"before\n{report.BEGIN}\n{text.rstrip()}\n{report.END}\nafter\n"
    (tmp_path / "unmarked.md").write_text("no markers\n")
    with pytest.raises(SystemExit, match="markers are missing"):
        report.write_docs(text, tmp_path / "unmarked.md")


def test_the_docs_quote_the_recorded_sweep() -> None:
    """docs/parallelism.md's table is what archs_report.py makes of the newest recorded sweep."""
    import json

    report = _report()
    runs = sorted((ROOT / "benchmarks" / "results").glob("archs-*.json"))
    assert runs, "no recorded sweep in benchmarks/results (make test-archs)"
    section = report.markdown(json.loads(runs[-1].read_text()), full=False)
    text = report.DOC.read_text()
    assert f"{report.BEGIN}\n{section.rstrip()}\n{report.END}" in text, (
        f"docs/parallelism.md does not quote {runs[-1].name}: python benchmarks/archs_report.py {runs[-1]} --docs")
