"""Verification on exported PyTorch models: the same architecture with other weights must be refused, the
correct build passes at build time and at `parastream verify` with other seeds (the verification targets, in small)."""

from __future__ import annotations

import json
import warnings

import pytest

from parastream.pipeline.cli import main

torch = pytest.importorskip("torch")


class _Inception(torch.nn.Module):
    """Stem, two Inception-style blocks (parallel 1x1 / 3x3 / 5x5 / pool branches joined by Concat), classifier."""

    def __init__(self):
        super().__init__()
        nn = torch.nn
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU())
        self.blocks = nn.ModuleList()
        c = 16
        for _ in range(2):
            self.blocks.append(nn.ModuleList([
                nn.Sequential(nn.Conv2d(c, 8, 1), nn.ReLU()),
                nn.Sequential(nn.Conv2d(c, 8, 1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1), nn.ReLU()),
                nn.Sequential(nn.Conv2d(c, 4, 1), nn.ReLU(), nn.Conv2d(4, 4, 5, padding=2), nn.ReLU()),
                nn.Sequential(nn.MaxPool2d(3, 1, 1), nn.Conv2d(c, 4, 1), nn.ReLU())]))
            c = 24
        self.head = nn.Linear(c, 10)

    def forward(self, x):
        x = self.stem(x)
        for block in self.blocks:
            x = torch.cat([b(x) for b in block], 1)
        return self.head(x.mean((2, 3)))


class _TinyEncoder(torch.nn.Module):
    """Token embedding over a 1000-word vocabulary, one transformer encoder layer, mean-pooled classifier."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(1000, 32)
        self.layer = torch.nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
        self.head = torch.nn.Linear(32, 4)

    def forward(self, ids):
        return self.head(self.layer(self.embed(ids)).mean(1))


def _export(module_cls, seed, path, example, input_name):
    torch.manual_seed(seed)
    m = module_cls().eval()
    if hasattr(m, "stem"):  # non-trivial BatchNorm statistics, as a trained net has
        for mod in m.modules():
            if isinstance(mod, torch.nn.BatchNorm2d):
                mod.running_mean.uniform_(-0.5, 0.5)
                mod.running_var.uniform_(0.5, 2.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(m, (example,), str(path), dynamo=False, input_names=[input_name], output_names=["logits"])
    return path


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("exported")
    x, ids = torch.rand(1, 3, 16, 16), torch.randint(0, 1000, (1, 16))
    return {
        "inception": [_export(_Inception, s, d / f"inception_{s}.onnx", x, "input") for s in (0, 1)],
        "encoder": [_export(_TinyEncoder, s, d / f"encoder_{s}.onnx", ids, "input_ids") for s in (0, 1)],
    }


@pytest.mark.parametrize("name", ["inception", "encoder"])
def test_correct_build_passes_and_other_weights_are_refused(models, name, tmp_path, capsys):
    right, other = models[name]
    out = tmp_path / "bundle"
    assert main(["build", str(right), "-o", str(out), "--backend", "onnxruntime", "--no-search", "--quiet"]) == 0
    built = json.loads((out / "report.json").read_text())["verification"]
    assert built["status"] == "passed" and built["criterion"] == "scaled"
    if name == "encoder":
        assert built["input_ranges"]["input_ids"] == [0, 999]  # token ids over the vocabulary
    capsys.readouterr()
    for seed in (5, 6):  # other inputs than the build's: still passes
        assert main(["verify", str(out), "--seed", str(seed), "--json"]) == 0
        ver = json.loads(capsys.readouterr().out)
        assert ver["status"] == "passed" and ver["outputs"]["logits"]["max_scaled"] < 1e-5
    assert main(["verify", str(out), "--model", str(other), "--json"]) == 1
    ver = json.loads(capsys.readouterr().out)
    assert ver["status"] == "failed" and ver["outputs"]["logits"]["max_scaled"] > 0.1
