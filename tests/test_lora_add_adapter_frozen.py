"""What trains after ``add_adapter`` / ``set_adapter`` / ``load_peft_adapter``: the first
adapter added to a module freezes its base (as ``apply_lora`` does), a later one keeps every
flag as it is.

Oracles: PEFT in torch (``get_peft_model`` / ``PeftModel.add_adapter`` / ``set_adapter``, its
``requires_grad`` flags and one torch Adam step) on the same MLP that torch's exporter writes
and ``import_onnx`` reads here (PEFT names mapped: ``base_model.model.`` and ``.base_layer``
dropped, ``lora_A.<name>.weight`` -> ``weight.lora.a``); without torch, the documented rule
(gradients for the LoRA factors only, base values unchanged by an optimizer step).
"""

from __future__ import annotations

import copy

import numpy as np
import pytest

from onnxparam import LoraAdapter, Module, Param, ParamGroup, ParamId, Tensor, nn
from onnxparam.autodiff import grad, mse
from onnxparam.optim import Adam


def _loss(model, x, t):
    return mse(model(x), t)


def _values(module) -> dict:
    return {path: p.base().to_numpy().copy() for path, p in module.named_params()}  # stored, no delta


def _trained(module, x, t) -> tuple:
    """(grad paths, paths whose value one Adam step changed)."""
    before = _values(module)
    _, grads = grad(_loss, module, x, t)
    after = _values(Adam(lr=1e-2).step(module, grads))
    changed = {path for path in before if not np.array_equal(before[path], after[path])}
    return set(grads.by_path()), changed


class Net(Module):
    def __init__(self):
        self.fc1 = nn.Linear(6, 8)
        self.fc2 = nn.Linear(8, 3)

    def forward(self, x):
        return self.fc2(self.fc1(x).relu())


def _adapter(rng, d_in, d_out, rank=2) -> LoraAdapter:
    a = Param.initialized(ParamId(), rng.normal(size=(d_in, rank)).astype(np.float32))
    b = Param.initialized(ParamId(), rng.normal(size=(rank, d_out)).astype(np.float32))
    return LoraAdapter(a, b, 0.5)


def test_first_named_adapter_trains_its_factors_only_and_a_later_add_keeps_an_unfrozen_base():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(4, 6)).astype(np.float32)
    t = rng.normal(size=(4, 3)).astype(np.float32)
    base = Net()
    model = base.add_adapter("sql", {"fc1.weight": _adapter(rng, 6, 8)}).set_adapter("sql")
    grads, changed = _trained(model, x, t)
    assert grads == changed == {"fc1.weight.lora.a", "fc1.weight.lora.b"}
    assert all(p.require_grad for _, p in base.named_params())  # the receiver is unchanged
    # full fine-tuning: unfrozen after adding, kept by a later add_adapter and set_adapter
    full = model.unfreeze_group(ParamGroup.all()).add_adapter("chat", {"fc2.weight": _adapter(rng, 8, 3)})
    grads, changed = _trained(full.set_adapter("chat"), x, t)
    every_base = {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"}
    assert grads == changed == every_base | {"fc2.weight.lora.a", "fc2.weight.lora.b"}
    # a frozen base stays frozen when another adapter is added
    grads, _ = _trained(model.add_adapter("chat", {"fc2.weight": _adapter(rng, 8, 3)}).set_adapter("chat"), x, t)
    assert grads == {"fc2.weight.lora.a", "fc2.weight.lora.b"}


# -- PEFT as the oracle -----------------------------------------------------------------------


def _peft_setup(tmp_path):
    torch = pytest.importorskip("torch")
    peft = pytest.importorskip("peft")
    from torch_peft import export, peft_lora, quiet, randomize

    from onnxparam import import_onnx

    class MLP(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1 = torch.nn.Linear(6, 8)
            self.norm = torch.nn.LayerNorm(8)
            self.fc2 = torch.nn.Linear(8, 3)

        def forward(self, x):
            return self.fc2(self.norm(self.fc1(x)).relu())

    base = randomize(MLP().eval(), seed=0)
    path = export(base, (torch.zeros(2, 6),), tmp_path / "mlp.onnx", "torchscript", input_names=["x"],
                  output_names=["y"])
    peft_lora(base, ["fc1"], 2, 4, seed=1, folder=tmp_path / "sql")
    peft_lora(base, ["fc2"], 3, 6, seed=2, folder=tmp_path / "chat")
    return torch, peft, quiet, base, import_onnx(path)


def _mapped(names) -> set:
    """PEFT's param names in this library's paths."""
    out = set()
    for name in names:
        name = name.removeprefix("base_model.model.").replace(".base_layer", "")
        for which in "AB":
            if f".lora_{which}." in name:
                name = name.split(f".lora_{which}.")[0] + f".weight.lora.{which.lower()}"
        out.add(name)
    return out


def _peft_trainable(model) -> set:
    return _mapped(n for n, p in model.named_parameters() if p.requires_grad)


def _peft_step_changed(torch, model, x, t) -> set:
    """The (mapped) names one torch Adam step on PEFT's model changes."""
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    optim = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    loss = torch.mean((model(torch.from_numpy(x)) - torch.from_numpy(t)) ** 2)
    loss.backward()
    optim.step()
    return _mapped(n for n, p in model.named_parameters() if not torch.equal(before[n], p.detach()))


def test_trainable_params_after_add_adapter_equal_peft_on_the_same_model(tmp_path):
    torch, peft, quiet, base, imported = _peft_setup(tmp_path)
    from onnxparam import load_peft_adapter

    rng = np.random.default_rng(3)
    x = rng.normal(size=(2, 6)).astype(np.float32)
    t = rng.normal(size=(2, 3)).astype(np.float32)
    # PEFT: the first adapter (inject_adapter's first injection freezes the base), active
    with quiet():
        reference = peft.PeftModel.from_pretrained(copy.deepcopy(base), str(tmp_path / "sql"), adapter_name="sql",
                                                   is_trainable=True)
    ours = imported.add_adapter("sql", load_peft_adapter(imported, tmp_path / "sql")).set_adapter("sql")
    expected = _peft_trainable(reference)
    assert expected == {"fc1.weight.lora.a", "fc1.weight.lora.b"}
    grads, changed = _trained(ours, x, t)
    assert grads == changed == expected == _peft_step_changed(torch, copy.deepcopy(reference).train(), x, t)
    assert {p for p, q in ours.named_params() if q.require_grad} == expected
    # load_peft_adapter alone freezes the same (PEFT's from_pretrained with is_trainable=True)
    assert _trained(load_peft_adapter(imported, tmp_path / "sql"), x, t) == (expected, expected)

    # PEFT's add_adapter on a model whose base the caller unfroze keeps it trainable; set_adapter
    # trains the new adapter's factors (the old one's are inactive)
    for name, p in reference.named_parameters():
        if "lora_" not in name:
            p.requires_grad = True
    with quiet():
        reference.load_adapter(str(tmp_path / "chat"), adapter_name="chat", is_trainable=True)
    reference.set_adapter("chat")
    ours = ours.unfreeze_group(ParamGroup.all())
    ours = ours.add_adapter("chat", load_peft_adapter(imported, tmp_path / "chat")).set_adapter("chat")
    expected = _peft_trainable(reference)
    assert expected == {"fc1.weight", "fc1.bias", "norm.weight", "norm.bias", "fc2.weight", "fc2.bias",
                        "fc2.weight.lora.a", "fc2.weight.lora.b"}
    grads, changed = _trained(ours, x, t)
    assert grads == changed == expected == _peft_step_changed(torch, copy.deepcopy(reference).train(), x, t)
