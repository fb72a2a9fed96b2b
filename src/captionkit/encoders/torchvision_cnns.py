"""The reference documents' ImageNet CNNs from torchvision, cut at their last convolutional
grid: AlexNet (conv5, 13x13x256), GoogLeNet (inception 5b, 7x7x1024), VGG-19 (conv5_4 before
the last pooling, 14x14x512: the paper's encoder), ResNet-152 (7x7x2048), DenseNet-201
(7x7x1920); all at 224 px with ImageNet normalisation.

Pretrained weights are torchvision's: taken from the torch hub cache when present, else
downloaded by torch.hub; where neither works (no network) the error says which file to put
where. ``weights="random"`` builds the architecture untrained (tests), a path loads that file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch
from torch import nn

from ..core.errors import UserError
from .base import IMAGENET, Encoder, Preprocess, WeightsUnavailable, load_state_file, register_encoder


class TorchvisionGrid(Encoder):
    def __init__(self, trunk: nn.Module, dim: int):
        super().__init__()
        self.trunk = trunk
        self.dim = dim
        self.preprocess = Preprocess(size=224, **IMAGENET)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        return self.trunk(x)  # (B, D, H, W)


def _resolve_weights(weights_enum, name: str) -> dict[str, torch.Tensor]:
    url = weights_enum.url
    cached = Path(torch.hub.get_dir()) / "checkpoints" / url.rsplit("/", 1)[-1]
    if cached.is_file():
        return load_state_file(str(cached))
    try:
        return torch.hub.load_state_dict_from_url(url, map_location="cpu", weights_only=True, progress=False)
    except Exception as e:  # no network, proxy, disk...
        raise WeightsUnavailable(
            f"{name}: torchvision's ImageNet weights are not in the torch hub cache ({cached}) and "
            f"could not be downloaded ({type(e).__name__}). Put the file there, or pass a weights file; "
            f"weights='random' only for tests.") from None


def _build(name: str, make: Callable[[], nn.Module], weights_enum, cut: Callable[[nn.Module], nn.Module],
           dim: int, weights: str | None) -> Encoder:
    net = make()
    if weights == "random":
        weights_id = "random"
    else:
        sd = load_state_file(weights) if weights else _resolve_weights(weights_enum, name)
        try:
            net.load_state_dict(sd)
        except RuntimeError as e:
            raise UserError(f"{weights or name}: not {name} weights ({str(e).splitlines()[0]})") from None
        weights_id = Path(weights).name if weights else weights_enum.url.rsplit("/", 1)[-1]
    enc = TorchvisionGrid(cut(net), dim)
    enc.weights_id = weights_id
    return enc


def _googlenet_trunk(net: nn.Module) -> nn.Module:
    keep = ["conv1", "maxpool1", "conv2", "conv3", "maxpool2", "inception3a", "inception3b", "maxpool3",
            "inception4a", "inception4b", "inception4c", "inception4d", "inception4e", "maxpool4",
            "inception5a", "inception5b"]
    # torchvision's pretrained GoogLeNet expects its own input transform (transform_input)
    layers = [getattr(net, k) for k in keep]
    if getattr(net, "transform_input", False):
        layers.insert(0, _GoogLeNetInput())
    return nn.Sequential(*layers)


class _GoogLeNetInput(nn.Module):
    """torchvision GoogLeNet's transform_input: ImageNet-normalised -> (x - 0.5) / 0.5."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mean = torch.tensor(IMAGENET["mean"], dtype=x.dtype, device=x.device).view(1, 3, 1, 1)
        std = torch.tensor(IMAGENET["std"], dtype=x.dtype, device=x.device).view(1, 3, 1, 1)
        return (x * std + mean - 0.5) / 0.5


@register_encoder("alexnet")
def alexnet(weights: str | None = None) -> Encoder:
    from torchvision import models as tvm
    return _build("alexnet", tvm.alexnet, tvm.AlexNet_Weights.IMAGENET1K_V1,
                  lambda n: n.features[:-1], 256, weights)


@register_encoder("googlenet")
def googlenet(weights: str | None = None) -> Encoder:
    from torchvision import models as tvm
    # aux heads exist so the pretrained state dict loads; the trunk leaves them out
    make = lambda: tvm.googlenet(weights=None, aux_logits=True, init_weights=weights == "random",  # noqa: E731
                                 transform_input=weights != "random")
    return _build("googlenet", make, tvm.GoogLeNet_Weights.IMAGENET1K_V1, _googlenet_trunk, 1024, weights)


@register_encoder("vgg19")
def vgg19(weights: str | None = None) -> Encoder:
    from torchvision import models as tvm
    return _build("vgg19", tvm.vgg19, tvm.VGG19_Weights.IMAGENET1K_V1, lambda n: n.features[:-1], 512, weights)


@register_encoder("resnet152")
def resnet152(weights: str | None = None) -> Encoder:
    from torchvision import models as tvm
    return _build("resnet152", tvm.resnet152, tvm.ResNet152_Weights.IMAGENET1K_V1,
                  lambda n: nn.Sequential(*list(n.children())[:-2]), 2048, weights)


@register_encoder("densenet201")
def densenet201(weights: str | None = None) -> Encoder:
    from torchvision import models as tvm
    return _build("densenet201", tvm.densenet201, tvm.DenseNet201_Weights.IMAGENET1K_V1,
                  lambda n: nn.Sequential(n.features, nn.ReLU()), 1920, weights)
