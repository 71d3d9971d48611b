"""LoRA models (peft) built on the meta device (docs/usage.md, "Models bigger than one process"): their adapters' own
initialisation, a base model's checkpoint as init_from, and run.export in peft's own files.

Each layout's run (tests/lora_worker.py) builds Hugging Face Llama wrapped by `peft.get_peft_model` on the meta device
and
  - prepares it without init_from and exports: the adapters are peft's rule (B zeros, A Kaiming-uniform) drawn from
    the generator keyed by each module's name, bit for bit what one process computes by hand, under every layout;
  - prepares it with init_from a plain `save_pretrained` of the base (which holds no adapters: they get their own
    initialisation), exports at once, trains three SGD steps and exports again. `PeftModel.from_pretrained(base,
    export)` loads both; the plain loop starts from the first export's adapters (checked equal to the hand-computed
    ones) and must reach the second's (1e-5).
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import lora_worker
import meta_cases as cases
import pytest
import torch
from helpers import paratrain as paratrain_cli

import paratrain
from paratrain import ParatrainError, weights

LAYOUTS = (("single", 1), ("fsdp", 2), ("pp", 2))
PREFIX = "base_model.model."


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The pretrained base model, as plain save_pretrained writes it (no adapters), sharded with an index."""
    path = tmp_path_factory.mktemp("lora") / "base"
    torch.manual_seed(1)
    cases.build("llama").save_pretrained(path, max_shard_size="40KB")
    return path


def _key(seed: int, name: str) -> int:
    """The generator's seed for one module (weights/own_init.py), written out again here."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little") & (2**63 - 1)


def by_hand(seed: int = 0) -> dict[str, torch.Tensor]:
    """The adapters' initial values in peft's saved names, computed without paratrain: for each adapter module, from
    torch's generator seeded with its name, peft's default rule (A as nn.Linear's Kaiming-uniform, B zeros)."""
    import peft

    with torch.device("meta"):
        model = lora_worker.build()
    out: dict[str, torch.Tensor] = {}
    for name, module in model.named_modules():
        if not isinstance(module, peft.tuners.lora.LoraLayer):
            continue
        for adapter, linear in module.lora_A.items():
            torch.manual_seed(_key(seed, f"{name}.lora_A.{adapter}"))
            a = torch.empty(linear.weight.shape)
            torch.nn.init.kaiming_uniform_(a, a=math.sqrt(5))
            out[f"{name}.lora_A.weight"] = a
            out[f"{name}.lora_B.weight"] = torch.zeros(module.lora_B[adapter].weight.shape)
    return out


def read_adapters(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(folder / "adapter_model.safetensors"))


def loaded(base: Path, folder: Path, trainable: bool = False) -> torch.nn.Module:
    """What a user does with the export: the base from its checkpoint, the adapters from the export."""
    import peft
    import transformers as tf

    cases.transformers_logging()
    model = tf.AutoModelForCausalLM.from_pretrained(base)
    return peft.PeftModel.from_pretrained(model, folder, is_trainable=trainable)  # type: ignore[no-any-return]


def adapters_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    import peft

    return {k: v.detach().clone() for k, v in peft.get_peft_model_state_dict(model).items()}


def plain_loop(base: Path, start: Path) -> tuple[dict[str, torch.Tensor], list[float]]:
    """The same three SGD steps with no paratrain, from the base checkpoint and the adapters of `start`."""
    model = loaded(base, start, trainable=True).train()
    opt = lora_worker.optimizer(model)
    x, y = cases.data()
    losses = []
    for step in range(cases.ROWS // cases.GLOBAL_BATCH):
        rows = slice(step * cases.GLOBAL_BATCH, (step + 1) * cases.GLOBAL_BATCH)
        loss = cases.loss_fn(model(x[rows]), y[rows])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return adapters_of(model), losses


@pytest.mark.procs
@pytest.mark.timeout(200)
@pytest.mark.parametrize(("layout", "world"), LAYOUTS, ids=[layout for layout, _ in LAYOUTS])
def test_lora_export_loads_in_peft_and_matches_plain_pytorch(layout: str, world: int, base: Path,
                                                             tmp_path: Path) -> None:
    res = paratrain_cli("run", "--nproc", str(world), "tests/lora_worker.py", layout, str(base), str(tmp_path),
                        timeout=180)
    assert res.returncode == 0, res.stdout[-4000:]
    want = by_hand()
    assert want and all(k.startswith(PREFIX) for k in want)
    for start in ("own", "init"):  # without init_from; init_from a base checkpoint, which has no adapters
        got = read_adapters(tmp_path / start)
        assert set(got) == set(want), f"{layout}: {sorted(set(got) ^ set(want))[:4]} differ from peft's names"
        unequal = [k for k in want if not torch.equal(got[k], want[k])]
        assert not unequal, f"{layout}, {start}: adapters differ from peft's rule with the keyed generator: {unequal}"
        config = json.loads((tmp_path / start / "adapter_config.json").read_text())
        assert config["peft_type"] == "LORA" and config["r"] == 4 and config["inference_mode"] is True

    start_model = loaded(base, tmp_path / "init")
    assert max(float(v.abs().max()) for k, v in adapters_of(start_model).items() if ".lora_B." in k) == 0.0
    ref, ref_losses = plain_loop(base, tmp_path / "init")
    trained = loaded(base, tmp_path / "trained")
    got = adapters_of(trained)
    assert set(got) == set(ref)
    worst = max((float((got[k] - ref[k]).abs().max()), k) for k in ref)
    assert worst[0] < 1e-5, f"{layout}: exported adapters differ from the plain loop's: {worst}"
    assert max(float(got[k].abs().max()) for k in got if ".lora_B." in k) > 1e-3, "the adapters did not train"
    assert json.loads((tmp_path / "losses.json").read_text()) == pytest.approx(ref_losses, abs=1e-5)
    plain_base = loaded(base, tmp_path / "init").get_base_model().state_dict()
    frozen = {k: v for k, v in trained.get_base_model().state_dict().items() if ".lora_" not in k}
    assert all(torch.equal(v, plain_base[k]) for k, v in frozen.items())


def _meta_lora(**options: object) -> torch.nn.Module:
    import peft

    with torch.device("meta"):
        return peft.get_peft_model(cases.build("llama"), peft.LoraConfig(**{  # type: ignore[no-any-return]
            "r": 4, "lora_alpha": 8, "target_modules": lora_worker.TARGETS, **options}))


def _own_init(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    weights.materialize(model, weights.source_for(model, 0, None), torch.device("cpu"))
    return {k: v for k, v in model.state_dict().items() if ".lora_" in k}


def test_own_init_gives_lora_b_zeros_and_peft_rule_for_a() -> None:
    values = _own_init(_meta_lora())
    want = by_hand()
    assert len(values) == len(want) == 12
    for name, value in values.items():
        assert torch.equal(value, want[name.replace(".default.", ".")]), name


def test_own_init_follows_gaussian_init_and_refuses_a_rule_that_needs_the_base() -> None:
    values = _own_init(_meta_lora(init_lora_weights="gaussian"))
    a = "base_model.model.model.layers.1.mlp.down_proj.lora_A.default"
    torch.manual_seed(_key(0, a))
    assert torch.equal(values[f"{a}.weight"], torch.nn.init.normal_(torch.empty(4, 64), std=1 / 4))
    assert all(not v.any() for k, v in values.items() if ".lora_B." in k)
    with pytest.raises(ParatrainError, match=r"lora_A\.default: LoraConfig\(init_lora_weights='olora'\) computes "
                                             r"adapter 'default' from the base layer's weights"):
        _own_init(_meta_lora(init_lora_weights="olora"))


def test_a_base_checkpoint_missing_a_base_tensor_is_still_refused(base: Path, tmp_path: Path) -> None:
    from safetensors.torch import save_file

    state = dict(loaded_base(base).state_dict())
    del state["model.norm.weight"]
    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp_path / "partial.safetensors"))
    run = paratrain.setup(strategy="single")
    try:
        with pytest.raises(ParatrainError, match=r"1 missing \(base_model\.model\.model\.norm\.weight\)"):
            run.prepare(_meta_lora(), init_from=tmp_path / "partial.safetensors")
    finally:
        run.close()


def loaded_base(base: Path) -> torch.nn.Module:
    import transformers as tf

    return tf.AutoModelForCausalLM.from_pretrained(base)  # type: ignore[no-any-return]


def test_adapters_only_needs_adapters_and_false_writes_the_whole_model(base: Path, tmp_path: Path) -> None:
    """adapters_only=False: the whole model in its own names, which init_from reads back; a second adapter goes to
    its own folder, as save_pretrained puts it."""
    import peft

    run = paratrain.setup(strategy="single")
    try:
        plain = run.prepare(cases.build("llama"))
        with pytest.raises(ParatrainError, match=r"adapters_only=True\): LlamaForCausalLM has no peft adapters"):
            run.export(plain, tmp_path / "none", adapters_only=True)
        def two_adapters() -> torch.nn.Module:
            model = _meta_lora()
            with torch.device("meta"):
                model.add_adapter("second", peft.LoraConfig(r=2, target_modules=["o_proj"]))
            return model

        model = run.prepare(two_adapters(), init_from=base)
        with torch.no_grad():  # adapters unlike their own initialisation: read back from the file or not at all
            for name, param in model.named_parameters():
                if ".lora_B." in name:
                    param.fill_(0.25)
        run.export(model, tmp_path / "whole", adapters_only=False)
        run.export(model, tmp_path / "adapters")
        again = run.prepare(two_adapters(), init_from=tmp_path / "whole")
    finally:
        run.close()
    state = run.unwrap(model).state_dict()
    whole = cases.read_export(str(tmp_path / "whole"))
    assert set(whole) == set(state) and not (tmp_path / "whole" / "adapter_model.safetensors").exists()
    back = run.unwrap(again).state_dict()
    assert all(torch.equal(back[k], state[k]) for k in back)  # the adapters too
    second = read_adapters(tmp_path / "adapters" / "second")
    assert len(second) == 4 and all(".o_proj.lora_" in k for k in second)
    assert set(read_adapters(tmp_path / "adapters")) == set(by_hand())
    loaded_model = loaded(base, tmp_path / "adapters")
    loaded_model.load_adapter(str(tmp_path / "adapters" / "second"), adapter_name="second")
    assert all(torch.equal(v, state[k]) for k, v in loaded_model.state_dict().items())
