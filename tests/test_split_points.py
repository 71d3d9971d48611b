"""Pipeline cuts by name (`split_points`), the tutorials' ResNet split: `seq1` = conv1..layer2 and `seq2` =
layer3..fc, written as split_points=["layer3"] instead of a layer count the tracer decides."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import paratrain
from paratrain import ParatrainError
from paratrain.config import Config, validate
from paratrain.parallel.pipeline.balance import cut_by_name


def _resnet() -> nn.Module:
    from torchvision.models import resnet18

    torch.manual_seed(0)
    return resnet18(num_classes=4)


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(4, 3, 32, 32, generator=g), torch.randint(0, 4, (4,), generator=g)


def test_the_tutorials_resnet_split_by_name_trains_like_the_whole_model() -> None:
    pytest.importorskip("torchvision")
    x, y = _batch()
    plain = _resnet()
    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.1)
    nn.functional.cross_entropy(plain(x), y).backward()
    plain_opt.step()

    run = paratrain.setup(strategy="mp", devices=["cpu", "cpu"], split_points=["layer3"], accelerator="cpu")
    model = _resnet()
    model, opt = run.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), example=x)
    names = [[name for name, _ in stage.named_children()] for stage in model.stages]
    assert names[0][0] == "conv1" and names[1][0] == "layer3", names  # seq1 = conv1..layer2, seq2 = layer3..fc
    assert "layer2" in names[0] and "fc" in names[1] and "layer3" not in names[0]
    run.forward_backward(model, x, y, nn.functional.cross_entropy)
    opt.step()
    got = run.unwrap(model).state_dict()
    worst = max((got[k].float() - v.float()).abs().max().item() for k, v in plain.state_dict().items())
    assert worst < 1e-5
    run.close()


def test_cuts_by_name_resolve_against_the_layers_and_refuse_with_their_names() -> None:
    layers = [(n, nn.Identity()) for n in ("conv1", "bn1", "layer1.0", "layer1.1", "layer2.0", "fc")]
    assert cut_by_name(["layer2"], layers, 2) == [4, 2]
    assert cut_by_name(["layer1", "fc"], layers, 3) == [2, 3, 1]
    assert cut_by_name(["layer1.1"], layers, 2) == [3, 3]
    with pytest.raises(ParatrainError, match="no layer is named 'layer9'.*conv1, bn1, layer1.0"):
        cut_by_name(["layer9"], layers, 2)
    with pytest.raises(ParatrainError, match="does not come after the previous cut"):
        cut_by_name(["layer2", "layer1"], layers, 3)
    with pytest.raises(ParatrainError, match="make 2 stages, but there are 3"):
        cut_by_name(["layer2"], layers, 3)
    with pytest.raises(ParatrainError, match="either split_points"):
        validate(Config(split_points=["layer3"], balance=[6, 4]))
    with pytest.raises(ParatrainError, match="split_points must list module names"):
        validate(Config(split_points=[3]))  # type: ignore[list-item]


def test_a_layer_count_that_does_not_fit_lists_the_layers_and_the_named_form() -> None:
    pytest.importorskip("torchvision")
    run = paratrain.setup(strategy="mp", devices=["cpu", "cpu"], balance=[6, 4], accelerator="cpu")
    model = _resnet()
    with pytest.raises(ParatrainError, match=r"in its own names: conv1, bn1, .*layer3\.0.*split_points=\['NAME'\]"):
        run.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), example=_batch()[0])
    run.close()
