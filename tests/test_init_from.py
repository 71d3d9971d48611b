"""Bad input to a meta-device build, refused by name before training (docs/usage.md, "Models bigger than one
process"), and the one-process paths: init_from into a model built whole, export of it."""

from __future__ import annotations

import shutil
from pathlib import Path

import meta_cases as cases
import pytest
import torch

import paratrain
from paratrain import ParatrainError


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("pretrained")
    cases.write_checkpoints(str(root))
    return root


def _prepare(name: str, **options: object) -> torch.nn.Module:
    run = paratrain.setup(strategy="single")
    try:
        with torch.device("meta"):
            model = cases.build(name)
        return run.prepare(model, **options)  # type: ignore[no-any-return]
    finally:
        run.close()


def test_a_buffer_nothing_computes_is_refused_by_name() -> None:
    with pytest.raises(ParatrainError, match=r"blocks\.0\.attn\.causal \(CausalSelfAttention\) was built on the meta "
                                             r"device and nothing computes its values.*paratrain\.empty_init\(\)"):
        _prepare("gpt")


def test_a_checkpoint_of_another_architecture_is_refused_listing_its_keys(checkpoints: Path) -> None:
    with pytest.raises(ParatrainError, match=r"does not fit LlamaForCausalLM: its tensors are \d+ missing "
                                             r"\(model\.embed_tokens\.weight.*unexpected \(transformer\."):
        _prepare("llama", init_from=checkpoints / "gpt2")


def test_a_shape_that_differs_is_refused_with_both_shapes(checkpoints: Path, tmp_path: Path) -> None:
    import transformers as tf

    wider = tf.LlamaForCausalLM(cases.llama_config().__class__(**{**cases.llama_config().to_dict(),
                                                                  "vocab_size": cases.VOCAB * 2}))
    wider.save_pretrained(tmp_path / "wider")
    with pytest.raises(ParatrainError, match=r"of another shape \(model\.embed_tokens\.weight \[128, 32\] \(the "
                                             r"model's \[64, 32\]\)"):
        _prepare("llama", init_from=tmp_path / "wider")


def test_a_truncated_shard_is_refused_naming_the_file(checkpoints: Path, tmp_path: Path) -> None:
    copy = tmp_path / "llama"
    shutil.copytree(checkpoints / "llama", copy)
    shard = sorted(copy.glob("model-*.safetensors"))[-1]
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(ParatrainError, match=rf"{shard.name}'?: is truncated: its header describes \d+ bytes but "
                                             r"it has \d+; copy or write it again"):
        _prepare("llama", init_from=copy)


def test_a_missing_checkpoint_is_refused_naming_the_path(tmp_path: Path) -> None:
    with pytest.raises(ParatrainError, match=r"no-such-dir'?: no such file or directory"):
        _prepare("llama", init_from=tmp_path / "no-such-dir")


def test_init_from_loads_a_model_built_whole_and_export_writes_it_back(checkpoints: Path, tmp_path: Path) -> None:
    run = paratrain.setup(strategy="single")
    try:
        model = run.prepare(cases.build("gpt2"), init_from=checkpoints / "gpt2" / "model.safetensors")
        run.export(model, tmp_path / "out")
    finally:
        run.close()
    want = cases.load("gpt2", str(checkpoints)).state_dict()
    got = cases.read_export(str(tmp_path / "out"))
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
    assert (tmp_path / "out" / "config.json").exists()


def test_the_safetensors_reader_and_writer_agree_with_safetensors(tmp_path: Path) -> None:
    """init_from reads rows with plain file reads, export writes a tensor at a time: both as safetensors does."""
    from safetensors.torch import load_file, save_file

    from paratrain.weights import safetensors_format as fmt

    tensors = {"w": torch.randn(7, 5), "h": torch.randn(3).to(torch.bfloat16), "s": torch.tensor(3.0),
               "i": torch.arange(12).reshape(3, 4), "b": torch.ones(4, dtype=torch.bool)}
    save_file(tensors, str(tmp_path / "a.safetensors"))
    entries, _, end = fmt.read_header(tmp_path / "a.safetensors")
    assert end == (tmp_path / "a.safetensors").stat().st_size
    for name, value in tensors.items():
        assert torch.equal(fmt.read(tmp_path / "a.safetensors", entries[name]), value), name
    for index in ([slice(2, 5), slice(1, 3)], [slice(0, 7, 2), slice(0, 5)], [slice(7, 7), slice(0, 5)]):
        assert torch.equal(fmt.read(tmp_path / "a.safetensors", entries["w"], index), tensors["w"][tuple(index)])
    fmt.write(tmp_path / "b.safetensors", [(k, v.shape, v.dtype) for k, v in tensors.items()], tensors.__getitem__)
    back = load_file(str(tmp_path / "b.safetensors"))
    assert set(back) == set(tensors) and all(torch.equal(back[k], v) for k, v in tensors.items())
