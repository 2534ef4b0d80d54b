"""Weight migration from PyTorch: a model trained in torch, saved with ``torch.save``, loaded into
the same architecture written with ``onnxparam.nn`` (without torch in the loading path), then on
to burnpack, ONNX and back to a PyTorch-layout safetensors file that torch loads strictly.

Oracle everywhere: torch's own module with the trained weights, and torch's strict
``load_state_dict`` of what we write back.
"""

import json
import subprocess

import numpy as np
import pytest

import onnxparam as op
from onnxparam import nn
from onnxparam.convert import (
    LoadReport,
    apply_record,
    convert,
    load_onnx,
    load_pytorch,
    load_safetensors,
    save_safetensors,
)

torch = pytest.importorskip("torch")


class TorchNet(torch.nn.Module):
    """Embedding (square: a transposed table would load silently wrong), Linear, LayerNorm."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(8, 8)
        self.fc1 = torch.nn.Linear(8, 16)
        self.norm = torch.nn.LayerNorm(16)
        self.fc2 = torch.nn.Linear(16, 4)

    def forward(self, idx):
        return self.fc2(torch.relu(self.norm(self.fc1(self.emb(idx)))))


class Net(op.Module):
    """The same architecture in onnxparam.nn (Burn's layouts: Linear (in, out), gamma/beta)."""

    def __init__(self):
        self.emb = nn.Embedding(8, 8)
        self.fc1 = nn.Linear(8, 16)
        self.norm = nn.LayerNorm(16)
        self.act = nn.Relu()
        self.fc2 = nn.Linear(16, 4)

    def forward(self, idx):
        return self.fc2(self.act(self.norm(self.fc1(self.emb(idx)))))


IDX = np.array([0, 3, 7, 5, 1, 2], dtype=np.int64)


def _trained_torch_net() -> TorchNet:
    torch.manual_seed(0)
    net = TorchNet()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    targets = torch.randint(0, 4, (len(IDX),))
    for _ in range(5):
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(net(torch.from_numpy(IDX)), targets)
        loss.backward()
        optimizer.step()
    return net.eval()


def _torch_out(net) -> np.ndarray:
    with torch.no_grad():
        return net(torch.from_numpy(IDX)).numpy()


def _our_out(module) -> np.ndarray:
    return module(op.Tensor.from_numpy(IDX)).to_numpy()


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    net = _trained_torch_net()
    path = tmp_path_factory.mktemp("pt") / "net.pt"
    torch.save(net.state_dict(), path)
    return net, path


def test_a_model_trained_in_torch_loads_from_its_pt_file_and_gives_torchs_outputs(trained):
    net, path = trained
    report = LoadReport()
    module = load_pytorch(Net(), path, report=report)
    np.testing.assert_allclose(_our_out(module), _torch_out(net), rtol=1e-5, atol=1e-6)
    assert report.ok
    assert [p for p, _, _ in report.transposed] == ["fc1.weight", "fc2.weight"]  # the Embedding is not
    assert ("norm.weight", "norm.gamma") in report.renamed and ("norm.bias", "norm.beta") in report.renamed


def test_it_goes_on_to_burnpack_onnx_and_back_to_a_safetensors_file_torch_loads_strictly(trained, tmp_path):
    safetensors_torch = pytest.importorskip("safetensors.torch")
    net, path = trained
    module = load_pytorch(Net(), path)
    bpk = module.save_file(tmp_path / "net.bpk")
    convert(bpk, tmp_path / "net.onnx")
    from_onnx = load_onnx(Net(), tmp_path / "net.onnx")
    np.testing.assert_allclose(_our_out(from_onnx), _torch_out(net), rtol=1e-5, atol=1e-6)

    # With the module: the adapter decides by layer type (Embedding not transposed).
    save_safetensors(from_onnx, tmp_path / "with_module.safetensors", adapter="pytorch", lossless=False)
    # Without a module: the converter transposes only Linear weights it recognizes by their bias.
    report = convert(tmp_path / "net.onnx", tmp_path / "no_module.safetensors", pytorch=True, lossless=False)
    assert [n for n, _ in report.untouched] == ["emb.weight"]
    for name in ("with_module.safetensors", "no_module.safetensors"):
        back = TorchNet()
        back.load_state_dict(safetensors_torch.load_file(str(tmp_path / name)), strict=True)
        np.testing.assert_allclose(_torch_out(back.eval()), _torch_out(net), rtol=1e-5, atol=1e-6)


def test_apply_record_takes_a_dict_of_arrays_or_torch_tensors_with_the_pytorch_adapter():
    rng = np.random.default_rng(0)
    weight, bias = rng.standard_normal((3, 4)).astype(np.float32), rng.standard_normal(3).astype(np.float32)
    x = rng.standard_normal((2, 4)).astype(np.float32)
    expected = x @ weight.T + bias  # torch.nn.Linear: y = x W^T + b
    for record in ({"weight": weight, "bias": bias},
                   {"weight": torch.from_numpy(weight), "bias": torch.nn.Parameter(torch.from_numpy(bias))}):
        layer = apply_record(nn.Linear(4, 3), record, adapter="pytorch")
        np.testing.assert_allclose(layer(op.Tensor.from_numpy(x)).to_numpy(), expected, rtol=1e-5, atol=1e-6)


def test_a_torch_state_dict_loads_through_load_record_in_burn_layout():
    torch.manual_seed(1)
    embedding = torch.nn.Embedding(5, 3)
    layer = nn.Embedding(5, 3).load_record(embedding.state_dict())
    idx = np.array([4, 0, 2])
    with torch.no_grad():
        expected = embedding(torch.from_numpy(idx)).numpy()
    np.testing.assert_array_equal(layer(op.Tensor.from_numpy(idx)).to_numpy(), expected)


def test_every_loader_returns_the_module_and_fills_the_report_the_same_way(trained, tmp_path):
    net, path = trained
    reference = load_pytorch(Net(), path)
    bpk = reference.save_file(tmp_path / "m.bpk")
    save_safetensors(reference, tmp_path / "m.safetensors")
    convert(bpk, tmp_path / "m.onnx")
    loaders = {
        "load_pytorch": lambda r: load_pytorch(Net(), path, report=r),
        "load_file": lambda r: Net().load_file(bpk, report=r),
        "load_record": lambda r: Net().load_record(reference.into_record(), report=r),
        "load_safetensors": lambda r: load_safetensors(Net(), tmp_path / "m.safetensors", report=r),
        "load_onnx": lambda r: load_onnx(Net(), tmp_path / "m.onnx", report=r),
    }
    for name, load in loaders.items():
        report = LoadReport()
        module = load(report)
        assert type(module) is Net, name
        assert report.ok and sorted(report.applied) == sorted(p for p, _ in Net().named_params()), name
        np.testing.assert_allclose(_our_out(module), _torch_out(net), rtol=1e-5, atol=1e-6, err_msg=name)


class TorchBn(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(3, 4)
        self.bn = torch.nn.BatchNorm1d(4)

    def forward(self, x):
        return self.bn(self.fc(x))


class Bn(op.Module):
    def __init__(self):
        self.fc = nn.Linear(3, 4)
        self.bn = nn.BatchNorm(4)

    def forward(self, x):
        return self.bn(self.fc(x))


def _cli(*args, cwd):
    """``onnxparam <args>`` run in this process (the tree under test), in folder ``cwd``."""
    import contextlib
    import io

    from onnxparam.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.chdir(cwd), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([str(a) for a in args])
    return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())


def test_num_batches_tracked_is_ignored_the_same_way_by_the_cli_and_the_api(tmp_path):
    torch.manual_seed(2)
    net = TorchBn()
    net.train()
    for _ in range(3):
        net(torch.randn(8, 3))  # running statistics and num_batches_tracked move
    net.eval()
    torch.save(net.state_dict(), tmp_path / "bn.pt")
    x = np.random.default_rng(3).standard_normal((5, 3)).astype(np.float32)
    with torch.no_grad():
        expected = net(torch.from_numpy(x)).numpy()

    report = LoadReport()
    api = load_pytorch(Bn(), tmp_path / "bn.pt", report=report)
    assert report.ignored == ["bn.num_batches_tracked"] and report.ok

    result = _cli("convert", "bn.pt", "bn.bpk", "--pytorch", "-q", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "ignored (1):" in result.stdout and "bn.num_batches_tracked" in result.stdout
    cli = Bn().load_file(tmp_path / "bn.bpk")  # no "unexpected tensor": the CLI left it out too
    for module in (api, cli):
        np.testing.assert_allclose(module(op.Tensor.from_numpy(x)).to_numpy(), expected, rtol=1e-5, atol=1e-5)


def test_the_cli_lists_what_it_did_not_transpose_and_takes_transpose_and_no_transpose(trained, tmp_path):
    net, path = trained
    result = _cli("convert", path, "plain.bpk", "--pytorch", "-q", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "1 untouched" in result.stdout and "emb.weight: rank-2 weight [8, 8] without a bias" in result.stdout
    Net().load_file(tmp_path / "plain.bpk")  # the Embedding kept its layout, so it loads

    result = _cli("convert", path, "decided.bpk", "--pytorch", "--no-transpose", r"^emb\.", "--no-transpose",
                  r"^fc2\.", "-q", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "0 untouched" in result.stdout
    with pytest.raises(op.RecordError, match=r"shape mismatch for 'fc2.weight': the module expects \[16, 4\]"):
        Net().load_file(tmp_path / "decided.bpk")

    result = _cli("convert", path, "forced.bpk", "--pytorch", "--transpose", r"^emb\.weight$", "-q", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    forced = Net().load_file(tmp_path / "forced.bpk")  # square table: loads, but transposed
    table = forced.emb.weight.val().to_numpy()
    np.testing.assert_array_equal(table, net.emb.weight.detach().numpy().T)


def test_inspect_lists_a_pt_files_tensors_as_torch_has_them(trained, tmp_path):
    net, path = trained
    result = _cli("inspect", path, "--json", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["format"] == "pytorch"
    assert [(t["name"], t["shape"]) for t in doc["tensors"]] == [
        (k, list(v.shape)) for k, v in net.state_dict().items()]
    assert doc["totals"]["nan"] == 0


class TorchTagger(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embedding = torch.nn.Embedding(12, 8)
        self.lstm = torch.nn.LSTM(8, 6, batch_first=True)
        self.head = torch.nn.Linear(6, 3)

    def forward(self, tokens):
        return self.head(self.lstm(self.embedding(tokens))[0])


class Tagger(op.Module):
    def __init__(self):
        self.embedding = nn.Embedding(12, 8)
        self.lstm = nn.Lstm(8, 6)
        self.head = nn.Linear(6, 3)

    def forward(self, tokens):
        out, _, _ = self.lstm(self.embedding(tokens))
        return self.head(out)


def test_a_torch_lstm_checkpoint_loads_through_the_adapter_by_layer_type(tmp_path):
    torch.manual_seed(6)
    reference = TorchTagger().eval()
    torch.save({"epoch": 3, "model": reference.state_dict()}, tmp_path / "tagger.pt")
    report = LoadReport()
    model = load_pytorch(Tagger(), tmp_path / "tagger.pt", top_level_key="model", report=report)
    tokens = np.random.default_rng(6).integers(0, 12, size=(3, 7)).astype(np.int64)
    with torch.no_grad():
        want = reference(torch.from_numpy(tokens)).numpy()
    np.testing.assert_allclose(model(op.Tensor.from_numpy(tokens)).to_numpy(), want, rtol=1e-5, atol=1e-6)
    assert report.ok
    assert ("lstm.weight_ih_l0", "lstm (Lstm)") in report.renamed  # packed gates, split by torch_layers
    assert [p for p, _, _ in report.transposed] == ["head.weight"]


class Mlp(op.Module):
    def __init__(self):
        self.layers = [nn.Linear(4, 5), nn.Linear(5, 2)]

    def forward(self, x):
        return self.layers[1](self.layers[0](x))


def test_a_sequential_with_gaps_converts_with_contiguous_indices_and_loads(tmp_path):
    torch.manual_seed(4)
    seq = torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.Identity(), torch.nn.Linear(5, 2)).eval()
    torch.save({"state_dict": {f"layers.{k}": v for k, v in seq.state_dict().items()}}, tmp_path / "seq.pt")
    result = _cli("convert", "seq.pt", "seq.bpk", "--pytorch", "--top-level-key", "state_dict",
                  "--contiguous-indices", "-q", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "layers.2.weight -> layers.1.weight" in result.stdout
    x = np.random.default_rng(5).standard_normal((3, 4)).astype(np.float32)
    with torch.no_grad():
        expected = seq(torch.from_numpy(x)).numpy()
    loaded = Mlp().load_file(tmp_path / "seq.bpk")
    np.testing.assert_allclose(loaded(op.Tensor.from_numpy(x)).to_numpy(), expected, rtol=1e-5, atol=1e-6)


def test_load_file_on_a_pt_file_names_load_pytorch(trained):
    _, path = trained
    with pytest.raises(op.RecordError, match=r"use onnxparam.convert.load_pytorch\(module, '.*net.pt'\)"):
        Net().load_file(path)
