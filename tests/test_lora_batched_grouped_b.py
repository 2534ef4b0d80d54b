"""A grouped convolution's adapter ``b`` must be PEFT's grouped ``lora_B`` (block-diagonal: rows
``g * r / groups ...`` feed only group ``g``'s output channels) in a ``lora="batched"`` export,
in ``module(x, adapter_index=...)``, in ``check_batched_adapters`` / ``onnxparam lora check``,
in the PEFT writers and in the one-adapter branches (``"keep"`` masks ``b`` to its blocks,
``"inputs"`` does not: they would disagree; ``write_onnx_adapter``): one check
(``onnxparam.lora._conv_checks.grouped_b_problem``), one message naming the weight and the
adapter (or slot).

Oracle for the adapters that pass: torch's functional convolutions (``conv2d(x, W, groups=2) +
scale * conv1x1(conv2d(x, A), B)``, PEFT's grouped conv LoRA written out) on this library's own
``nn.Conv2d(groups=2)``; the refusals are checked by their messages.
"""

from __future__ import annotations

import numpy as np
import pytest
from cli_run import run_cli

from onnxparam import (
    BatchedLora,
    LoraAdapter,
    LoraError,
    Module,
    Param,
    RecordError,
    Tensor,
    check_batched_adapters,
    export_onnx,
    nn,
    write_batched_peft,
    write_onnx_adapter,
)
from onnxparam.lora._batched import batched_metadata
from onnxparam.lora._batched_run import batched_adapter_params

ort = pytest.importorskip("onnxruntime")

OFF_BLOCK = "b is not zero outside each group's 2 rows at rank 4 (a conv with groups=2): not PEFT's grouped-conv LoRA"


class Net(Module):
    def __init__(self):
        self.conv = nn.Conv2d((4, 6), (3, 3), padding=(1, 1), groups=2)

    def forward(self, x):
        return self.conv(x)


def _factor(v):
    return Param.from_tensor(Tensor.from_numpy(np.ascontiguousarray(v, dtype=np.float32)))


def _adapter(rng, rank=4, off_block=False):
    """A grouped adapter on ``conv.weight`` ``(6, 2, 3, 3)``: ``a`` over all 4 input channels,
    ``b`` block-diagonal (rows ``0 .. r/2`` -> channels 0-2, the rest -> 3-5), or with one entry
    off its blocks (row 0, column 5)."""
    a = rng.normal(size=(4 * 9, rank))
    b = np.zeros((rank, 6))
    half = rank // 2
    b[:half, :3], b[half:, 3:] = rng.normal(size=(half, 3)), rng.normal(size=(rank - half, 3))
    if off_block:
        b[0, 5] = 0.7
    return {"conv.weight": LoraAdapter(_factor(a), _factor(b), 0.5, transposed=True)}


X = np.random.default_rng(1).normal(size=(3, 4, 5, 5)).astype(np.float32)


def _module(**bad):
    rng = np.random.default_rng(0)
    module = Net().add_adapter("good", _adapter(rng))
    if bad:
        module = module.add_adapter("bad", _adapter(rng, **bad))
    return module


def test_an_off_block_b_is_refused_by_the_batched_export_and_the_module_call_naming_weight_and_adapter(tmp_path):
    module = _module(off_block=True)
    words = f"adapter 'bad' on 'conv.weight' [6, 2, 3, 3]: {OFF_BLOCK}"
    with pytest.raises(LoraError, match=r"lora='batched': grouped convolution adapters must be PEFT's layout") as e:
        export_onnx(module, tmp_path / "b.onnx", X, lora="batched")
    assert words in str(e.value)
    with pytest.raises(LoraError) as e:
        module(Tensor.from_numpy(X), adapter_index=["good", None, "bad"])
    assert words in str(e.value)
    with pytest.raises(LoraError, match="rank 3 is no multiple of the conv's groups=2") as e:
        export_onnx(_module(rank=3), tmp_path / "r.onnx", X, lora="batched")
    assert "adapter 'bad' on 'conv.weight'" in str(e.value)


def test_the_block_diagonal_adapter_alone_exports_and_equals_torchs_grouped_conv_lora(tmp_path):
    """The control: the same module without the off-block adapter exports; its rows equal
    torch's functional form of PEFT's grouped conv LoRA (base rows: the base conv)."""
    torch = pytest.importorskip("torch")
    import torch.nn.functional as F

    module = _module()
    ad = module.lora_adapters.adapters("good")["conv.weight"]
    a, b = (np.asarray(p.val().to_numpy()) for p in (ad.a, ad.b))
    weight, bias = (torch.from_numpy(np.array(p.val().to_numpy())) for p in (module.conv.weight, module.conv.bias))
    x = torch.from_numpy(X)
    base = F.conv2d(x, weight, bias, padding=1, groups=2)
    h = F.conv2d(x, torch.from_numpy(a.T.reshape(4, 4, 3, 3).copy()), padding=1)
    b_peft = np.concatenate([b[:2, :3].T, b[2:, 3:].T])[:, :, None, None]  # PEFT's lora_B (6, 2, 1, 1)
    expected = (base + 0.5 * F.conv2d(h, torch.from_numpy(b_peft), groups=2)).numpy()
    path = export_onnx(module, tmp_path / "ok.onnx", X, lora="batched")
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    got = sess.run(None, {sess.get_inputs()[0].name: X, "adapter_index": np.array([1, 0, 1])})[0]
    np.testing.assert_allclose(got[[0, 2]], expected[[0, 2]], atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(got[1], base.numpy()[1], atol=1e-5, rtol=1e-5)


def test_check_cli_check_and_the_peft_writer_report_an_off_block_slot_alike(tmp_path):
    """Stacks fed to a fitting export with slot 1's ``b`` off its blocks: ``check_batched_adapters``,
    ``onnxparam lora check`` and ``write_batched_peft`` name the slot, its adapter and the weight
    with the same words; a module holding such an adapter is refused by the check too."""
    module = _module()
    path = export_onnx(module, tmp_path / "batched.onnx", X, lora=BatchedLora(capacity=2))
    target = batched_metadata(path)["targets"][0]
    params = batched_adapter_params(module, model=path)
    assert check_batched_adapters(path, params)  # the module's own stacks fit
    params[target["b"]][1, 0, 5] = 0.7
    words = f"slot 1 ('good'): the stacks of 'conv.weight': {OFF_BLOCK}"
    with pytest.raises(RecordError) as e:
        check_batched_adapters(path, params)
    assert words in str(e.value)
    code, _, err = run_cli("lora", "check", path, write_onnx_adapter(params, tmp_path / "bad.onnx_adapter"))
    assert code == 1 and words in err, err
    with pytest.raises(RecordError) as e:
        write_batched_peft(params, tmp_path / "peft", model=path)
    assert words in str(e.value)
    with pytest.raises(RecordError) as e:
        check_batched_adapters(path, _module(off_block=True))
    assert f"adapter 'bad' on 'conv.weight' [6, 2, 3, 3]: {OFF_BLOCK}" in str(e.value)


def test_an_off_block_b_is_refused_by_the_one_adapter_modes_and_the_adapter_file_writer(tmp_path):
    """With the adapter active: ``"keep"`` / ``"inputs"`` exports, ``module(x)`` (``"merge"``
    runs a grouped adapter as ``"keep"``; ``lora_mode="inputs"``) and ``write_onnx_adapter``
    name the weight; the block-diagonal adapter passes them all (one ``module(x)`` checked)."""
    from onnxparam.runtime import SessionConfig, set_session_config

    bad = _module(off_block=True).set_adapter("bad")
    words = f"the adapter of 'conv.weight' [6, 2, 3, 3]: {OFF_BLOCK}"
    for mode in ("keep", "inputs"):
        with pytest.raises(LoraError, match=f"lora='{mode}': ") as e:
            export_onnx(bad, tmp_path / f"{mode}.onnx", X, lora=mode)
        assert words in str(e.value)
    with pytest.raises(LoraError) as e:
        bad(Tensor.from_numpy(X))
    assert words in str(e.value)
    set_session_config(bad, SessionConfig(lora_mode="inputs"))
    with pytest.raises(LoraError) as e:
        bad(Tensor.from_numpy(X))
    assert words in str(e.value)
    with pytest.raises(LoraError) as e:
        write_onnx_adapter(bad, tmp_path / "bad.onnx_adapter")
    assert words in str(e.value)
    good = _module().set_adapter("good")
    write_onnx_adapter(good, tmp_path / "good.onnx_adapter")
    assert good(Tensor.from_numpy(X)).to_numpy().shape == (3, 6, 5, 5)


def test_lora_check_of_an_inputs_export_names_an_off_block_b(tmp_path):
    """``onnxparam lora check`` on a ``lora="inputs"`` export of the grouped conv: the block-diagonal
    adapter's file fits; a file whose ``b`` has an entry off its blocks (written by hand, as
    another tool could) is named with the same words."""
    good = _module().set_adapter("good")
    model = export_onnx(good, tmp_path / "inputs.onnx", X, lora="inputs")
    file = write_onnx_adapter(good, tmp_path / "good.onnx_adapter")
    code, _, err = run_cli("lora", "check", model, file)
    assert code == 0, err
    fmt = ort.AdapterFormat.read_adapter(str(file))
    params = {k: v.numpy().copy() for k, v in fmt.get_parameters().items()}
    params["conv.weight.lora.b"][0, 5] = 0.7
    code, _, err = run_cli("lora", "check", model, write_onnx_adapter(params, tmp_path / "bad.onnx_adapter"))
    assert code == 1 and f"the adapter of 'conv.weight' [6, 2, 3, 3]: {OFF_BLOCK}" in err, err
