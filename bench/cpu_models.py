"""Small public-architecture stand-ins for the CPU measurements, for a machine without torchvision
and transformers: PyTorch modules with the block structure of GoogLeNet, DenseNet, ResNet and a BERT-style encoder,
random weights, exported with torch.onnx (TorchScript exporter).

    python bench/cpu_models.py OUT_DIR        # writes googlenet_like.onnx, densenet_like.onnx, ...
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import torch
from torch import nn


def _cbr(cin, cout, k, s=1):
    return nn.Sequential(nn.Conv2d(cin, cout, k, s, k // 2, bias=False), nn.BatchNorm2d(cout), nn.ReLU())


class Inception(nn.Module):
    def __init__(self, cin, c1, c3r, c3, c5r, c5, cp):
        super().__init__()
        self.b1 = _cbr(cin, c1, 1)
        self.b2 = nn.Sequential(_cbr(cin, c3r, 1), _cbr(c3r, c3, 3))
        self.b3 = nn.Sequential(_cbr(cin, c5r, 1), _cbr(c5r, c5, 3), _cbr(c5, c5, 3))
        self.b4 = nn.Sequential(nn.MaxPool2d(3, 1, 1), _cbr(cin, cp, 1))

    def forward(self, x):
        return torch.cat([self.b1(x), self.b2(x), self.b3(x), self.b4(x)], 1)


class GoogLeNetLike(nn.Module):
    """GoogLeNet's stem and its nine Inception blocks (channel counts of the paper), 224x224 input."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(_cbr(3, 64, 7, 2), nn.MaxPool2d(3, 2, 1), _cbr(64, 64, 1), _cbr(64, 192, 3), nn.MaxPool2d(3, 2, 1))
        cfg = [(192, 64, 96, 128, 16, 32, 32), (256, 128, 128, 192, 32, 96, 64), "pool",
               (480, 192, 96, 208, 16, 48, 64), (512, 160, 112, 224, 24, 64, 64), (512, 128, 128, 256, 24, 64, 64),
               (512, 112, 144, 288, 32, 64, 64), (528, 256, 160, 320, 32, 128, 128), "pool",
               (832, 256, 160, 320, 32, 128, 128), (832, 384, 192, 384, 48, 128, 128)]
        self.blocks = nn.Sequential(*[nn.MaxPool2d(3, 2, 1) if c == "pool" else Inception(*c) for c in cfg])
        self.fc = nn.Linear(1024, 1000)

    def forward(self, x):
        return self.fc(self.blocks(self.stem(x)).mean((2, 3)))


class DenseLayer(nn.Module):
    def __init__(self, cin, growth):
        super().__init__()
        self.f = nn.Sequential(nn.BatchNorm2d(cin), nn.ReLU(), nn.Conv2d(cin, 4 * growth, 1, bias=False),
                               nn.BatchNorm2d(4 * growth), nn.ReLU(), nn.Conv2d(4 * growth, growth, 3, 1, 1, bias=False))

    def forward(self, x):
        return torch.cat([x, self.f(x)], 1)


class DenseNetLike(nn.Module):
    """DenseNet-121's layout (6-12-24-16 dense layers, growth 32), 224x224 input."""

    def __init__(self):
        super().__init__()
        layers, c = [_cbr(3, 64, 7, 2), nn.MaxPool2d(3, 2, 1)], 64
        for i, n in enumerate((6, 12, 24, 16)):
            for _ in range(n):
                layers.append(DenseLayer(c, 32))
                c += 32
            if i < 3:
                layers += [nn.BatchNorm2d(c), nn.ReLU(), nn.Conv2d(c, c // 2, 1, bias=False), nn.AvgPool2d(2)]
                c //= 2
        self.features = nn.Sequential(*layers, nn.BatchNorm2d(c), nn.ReLU())
        self.fc = nn.Linear(c, 1000)

    def forward(self, x):
        return self.fc(self.features(x).mean((2, 3)))


class Bottleneck(nn.Module):
    def __init__(self, cin, mid, stride):
        super().__init__()
        self.f = nn.Sequential(_cbr(cin, mid, 1), _cbr(mid, mid, 3, stride), nn.Conv2d(mid, 4 * mid, 1, bias=False),
                               nn.BatchNorm2d(4 * mid))
        self.skip = (nn.Sequential(nn.Conv2d(cin, 4 * mid, 1, stride, bias=False), nn.BatchNorm2d(4 * mid))
                     if stride != 1 or cin != 4 * mid else nn.Identity())

    def forward(self, x):
        return torch.relu(self.f(x) + self.skip(x))


class ResNet50Like(nn.Module):
    def __init__(self):
        super().__init__()
        layers, c = [_cbr(3, 64, 7, 2), nn.MaxPool2d(3, 2, 1)], 64
        for i, (n, mid) in enumerate(((3, 64), (4, 128), (6, 256), (3, 512))):
            for j in range(n):
                layers.append(Bottleneck(c, mid, 2 if j == 0 and i > 0 else 1))
                c = 4 * mid
        self.features = nn.Sequential(*layers)
        self.fc = nn.Linear(c, 1000)

    def forward(self, x):
        return self.fc(self.features(x).mean((2, 3)))


class BertLike(nn.Module):
    """BERT-mini-sized encoder: 30522-token vocabulary, 4 layers, hidden 256, 4 heads; seq 128."""

    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(30522, 256)
        self.pos = nn.Parameter(torch.randn(1, 128, 256) * 0.02)
        self.enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(256, 4, 1024, dropout=0.0, batch_first=True,
                                                                    activation="gelu"), 4, enable_nested_tensor=False)
        self.head = nn.Linear(256, 2)

    def forward(self, input_ids):
        return self.head(self.enc(self.tok(input_ids) + self.pos)[:, 0])


MODELS = {
    "googlenet_like": (GoogLeNetLike, lambda: torch.rand(1, 3, 224, 224), "input"),
    "densenet_like": (DenseNetLike, lambda: torch.rand(1, 3, 224, 224), "input"),
    "resnet50_like": (ResNet50Like, lambda: torch.rand(1, 3, 224, 224), "input"),
    "bert_like": (BertLike, lambda: torch.randint(0, 30522, (1, 128)), "input_ids"),
}


def export(name: str, path: Path, seed: int = 0) -> Path:
    cls, example, input_name = MODELS[name]
    torch.manual_seed(seed)
    m = cls().eval()
    for mod in m.modules():  # trained-looking BatchNorm statistics
        if isinstance(mod, nn.BatchNorm2d):
            mod.running_mean.uniform_(-0.2, 0.2)
            mod.running_var.uniform_(0.5, 1.5)
    torch.backends.mha.set_fastpath_enabled(False)  # the fused encoder kernel has no ONNX export
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        torch.onnx.export(m, (example(),), str(path), dynamo=False, input_names=[input_name], output_names=["output"],
                          opset_version=17)
    return path


if __name__ == "__main__":
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "models")
    out.mkdir(parents=True, exist_ok=True)
    for name in (sys.argv[2:] or MODELS):
        print(export(name, out / f"{name}.onnx"))
