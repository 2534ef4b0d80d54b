"""Small torch models for the whole-model gradient tests (tests/test_grad_torch_models_more.py).

``resnet18`` and ``mobilenet_v3_small`` are torchvision's architectures written out here (same
module tree and param names as ``torchvision.models``, so a torchvision state dict loads into
them): torchvision's wheels on the package index are CUDA builds that do not import against the
CPU build of torch this project's machines carry (``operator torchvision::nms does not exist``).
The taggers are an embedding, one bidirectional LSTM / GRU layer and a linear head.
"""

from __future__ import annotations

import torch
from torch import nn


class BasicBlock(nn.Module):
    """torchvision.models.resnet.BasicBlock."""

    def __init__(self, inplanes, planes, stride=1, downsample=None):
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = downsample

    def forward(self, x):
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += x if self.downsample is None else self.downsample(x)
        return self.relu(out)


class ResNet18(nn.Module):
    """torchvision.models.resnet18(num_classes=...)."""

    def __init__(self, num_classes=1000):
        super().__init__()
        self.inplanes = 64
        self.conv1 = nn.Conv2d(3, 64, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        self.layer1 = self._make_layer(64, 1)
        self.layer2 = self._make_layer(128, 2)
        self.layer3 = self._make_layer(256, 2)
        self.layer4 = self._make_layer(512, 2)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(512, num_classes)

    def _make_layer(self, planes, stride):
        downsample = None
        if stride != 1 or self.inplanes != planes:
            downsample = nn.Sequential(nn.Conv2d(self.inplanes, planes, 1, stride, bias=False), nn.BatchNorm2d(planes))
        layers = [BasicBlock(self.inplanes, planes, stride, downsample), BasicBlock(planes, planes)]
        self.inplanes = planes
        return nn.Sequential(*layers)

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def _make_divisible(v, divisor=8):
    new_v = max(divisor, int(v + divisor / 2) // divisor * divisor)
    return new_v + divisor if new_v < 0.9 * v else new_v


class ConvNormActivation(nn.Sequential):
    """torchvision.ops.Conv2dNormActivation (BatchNorm eps 1e-3, as MobileNetV3 builds it)."""

    def __init__(self, cin, cout, kernel_size=3, stride=1, groups=1, activation=nn.ReLU):
        layers = [nn.Conv2d(cin, cout, kernel_size, stride, (kernel_size - 1) // 2, groups=groups, bias=False),
                  nn.BatchNorm2d(cout, eps=0.001, momentum=0.01)]
        if activation is not None:
            layers.append(activation(inplace=True))
        super().__init__(*layers)


class SqueezeExcitation(nn.Module):
    """torchvision.ops.SqueezeExcitation with a Hardsigmoid scale."""

    def __init__(self, channels, squeeze):
        super().__init__()
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc1 = nn.Conv2d(channels, squeeze, 1)
        self.fc2 = nn.Conv2d(squeeze, channels, 1)
        self.activation = nn.ReLU()
        self.scale_activation = nn.Hardsigmoid()

    def forward(self, x):
        scale = self.scale_activation(self.fc2(self.activation(self.fc1(self.avgpool(x)))))
        return scale * x


class InvertedResidual(nn.Module):
    """torchvision.models.mobilenetv3.InvertedResidual."""

    def __init__(self, cin, kernel, expanded, cout, use_se, hardswish, stride):
        super().__init__()
        self.use_res_connect = stride == 1 and cin == cout
        act = nn.Hardswish if hardswish else nn.ReLU
        layers = []
        if expanded != cin:
            layers.append(ConvNormActivation(cin, expanded, 1, activation=act))
        layers.append(ConvNormActivation(expanded, expanded, kernel, stride, groups=expanded, activation=act))
        if use_se:
            layers.append(SqueezeExcitation(expanded, _make_divisible(expanded // 4)))
        layers.append(ConvNormActivation(expanded, cout, 1, activation=None))
        self.block = nn.Sequential(*layers)

    def forward(self, x):
        result = self.block(x)
        if self.use_res_connect:
            result += x
        return result


# torchvision's mobilenet_v3_small table: input, kernel, expanded, output, SE, hardswish, stride
SMALL = [(16, 3, 16, 16, True, False, 2), (16, 3, 72, 24, False, False, 2), (24, 3, 88, 24, False, False, 1),
         (24, 5, 96, 40, True, True, 2), (40, 5, 240, 40, True, True, 1), (40, 5, 240, 40, True, True, 1),
         (40, 5, 120, 48, True, True, 1), (48, 5, 144, 48, True, True, 1), (48, 5, 288, 96, True, True, 2),
         (96, 5, 576, 96, True, True, 1), (96, 5, 576, 96, True, True, 1)]


class MobileNetV3Small(nn.Module):
    """torchvision.models.mobilenet_v3_small(num_classes=...)."""

    def __init__(self, num_classes=1000):
        super().__init__()
        layers = [ConvNormActivation(3, 16, 3, 2, activation=nn.Hardswish)]
        layers += [InvertedResidual(*cfg) for cfg in SMALL]
        layers.append(ConvNormActivation(96, 576, 1, activation=nn.Hardswish))
        self.features = nn.Sequential(*layers)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Sequential(nn.Linear(576, 1024), nn.Hardswish(inplace=True), nn.Dropout(0.2, inplace=True),
                                        nn.Linear(1024, num_classes))

    def forward(self, x):
        return self.classifier(torch.flatten(self.avgpool(self.features(x)), 1))


class Tagger(nn.Module):
    """Token ids ``[batch, seq]`` -> tag scores ``[batch, seq, tags]``: embedding, bidirectional
    ``LSTM`` or ``GRU`` (batch first), linear."""

    def __init__(self, kind, vocab=30, embed=6, hidden=5, tags=4):
        super().__init__()
        self.emb = nn.Embedding(vocab, embed)
        self.rnn = getattr(nn, kind)(embed, hidden, batch_first=True, bidirectional=True)
        self.out = nn.Linear(2 * hidden, tags)

    def forward(self, x):
        return self.out(self.rnn(self.emb(x))[0])
