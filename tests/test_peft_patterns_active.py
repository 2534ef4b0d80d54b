"""PEFT folders whose ``alpha_pattern`` / ``rank_pattern`` keys are anchored with ``^`` (fresh8
F6), and ``load_peft_adapter`` onto a module that already carries adapters (fresh8 F10).

Oracle: ``peft`` in torch on the same weights: ``PeftModel`` forward (PEFT's own scales and
ranks, from its ``get_pattern_key`` on the wrapped model's module names), and PEFT's mixed
batch ``model(x, adapter_names=rows)`` for adapters loaded with ``load_adapter``.
"""

from __future__ import annotations

import copy
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")

from torch_peft import peft_lora, peft_rows, peft_with_adapters, quiet, randomize, with_torch_weights  # noqa: E402

from onnxparam import LoraConfig, LoraWarning, Module, Tensor, load_peft_adapter  # noqa: E402
from onnxparam.nn import Linear  # noqa: E402

ATOL = 1e-5


class TorchBlock(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.myfc1 = torch.nn.Linear(6, 6), torch.nn.Linear(6, 6)

    def forward(self, x):
        return self.myfc1(torch.tanh(self.fc1(x)))


class TorchNet(torch.nn.Module):
    """Look-alike names: ``fc1``, ``fc10``, ``block.fc1``, ``block.myfc1``, ``out``."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc10, self.block, self.out = (torch.nn.Linear(6, 6), torch.nn.Linear(6, 6), TorchBlock(),
                                                     torch.nn.Linear(6, 3))

    def forward(self, x):
        return self.out(self.block(torch.tanh(self.fc10(torch.tanh(self.fc1(x))))))


class Block(Module):
    def __init__(self):
        self.fc1, self.myfc1 = Linear(6, 6), Linear(6, 6)

    def forward(self, x):
        return self.myfc1(self.fc1(x).tanh())


class Net(Module):
    def __init__(self):
        self.fc1, self.fc10, self.block, self.out = Linear(6, 6), Linear(6, 6), Block(), Linear(6, 3)

    def forward(self, x):
        return self.out(self.block(self.fc10(self.fc1(x).tanh()).tanh()))


def param(module, path: str):
    return dict(module.named_params())[path]


def pattern_folder(tmp_path, alpha_pattern: dict, rank_pattern: dict):
    torch.manual_seed(0)
    base = randomize(TorchNet().eval(), seed=1)
    config = peft.LoraConfig(r=2, lora_alpha=2, target_modules=["fc1", "fc10", "myfc1", "out"],
                             alpha_pattern=alpha_pattern, rank_pattern=rank_pattern, init_lora_weights=False)
    with quiet():
        model = peft.get_peft_model(copy.deepcopy(base), config).eval()
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
        model.save_pretrained(str(tmp_path / "peft"))
    scales = {name: mod.scaling["default"] for name, mod in model.base_model.model.named_modules()
              if isinstance(getattr(mod, "scaling", None), dict)}
    return base, model, scales


def test_anchored_alpha_and_rank_pattern_keys_give_peft_scales_and_ranks(tmp_path):
    base, model, scales = pattern_folder(tmp_path, {"fc1": 16, "block.myfc1": 8, "^out": 6}, {"^fc10": 3})
    # PEFT's own reading: "^out" applies to out (6 / 2), "^fc10" makes fc10 rank 3 (alpha 2 / 3)
    assert scales == pytest.approx({"fc1": 8.0, "fc10": 2 / 3, "block.fc1": 8.0, "block.myfc1": 4.0, "out": 3.0})
    ours = load_peft_adapter(with_torch_weights(Net(), base), tmp_path / "peft")
    assert ours.fc10.weight.adapter().rank == 3
    assert {p: param(ours, p).adapter().scale for p in ("fc1.weight", "fc10.weight", "block.fc1.weight",
                                                     "block.myfc1.weight", "out.weight")} == pytest.approx(
        {f"{name}.weight": scale for name, scale in scales.items()})
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected, plain = model(x).numpy(), base(x).numpy()
    got = ours(Tensor.from_numpy(x.numpy())).to_numpy()
    np.testing.assert_allclose(got, expected, atol=ATOL)
    assert np.abs(expected - plain).max() > 0.5  # the adapter matters


@pytest.mark.parametrize("key", ["^block.myfc1", r"^block\.myfc1$", "block.myfc1"])
def test_a_pattern_key_anchored_at_a_nested_module_path_applies_to_it_only(tmp_path, key):
    base, model, scales = pattern_folder(tmp_path, {key: 10}, {})
    assert scales["block.myfc1"] == 5.0 and scales["block.fc1"] == 1.0  # PEFT
    ours = load_peft_adapter(with_torch_weights(Net(), base), tmp_path / "peft")
    x = torch.randn(3, 6, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        expected = model(x).numpy()
    np.testing.assert_allclose(ours(Tensor.from_numpy(x.numpy())).to_numpy(), expected, atol=ATOL)


class TorchMlp(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.fc3 = torch.nn.Linear(5, 8), torch.nn.Linear(8, 8), torch.nn.Linear(8, 4)

    def forward(self, x):
        return self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


class Mlp(Module):
    def __init__(self):
        self.fc1, self.fc2, self.fc3 = Linear(5, 8), Linear(8, 8), Linear(8, 4)

    def forward(self, x):
        return self.fc3(self.fc2(self.fc1(x).relu()).relu())


# three adapters on different target sets: a3 shares fc2 with a1 and lacks a1's fc1
ADAPTERS = {"a1": (["fc1", "fc2"], 4, 8, False), "a2": (["fc3"], 2, 4, True), "a3": (["fc2", "fc3"], 8, 8, False)}


@pytest.fixture(scope="module")
def three(tmp_path_factory):
    folder = tmp_path_factory.mktemp("three")
    base = randomize(TorchMlp().eval(), seed=5)
    for i, (name, (targets, r, alpha, rslora)) in enumerate(ADAPTERS.items()):
        peft_lora(base, targets, r, alpha, rslora=rslora, seed=20 + i, folder=folder / name)
    return base, peft_with_adapters(base, {name: folder / name for name in ADAPTERS}), folder


@pytest.mark.parametrize("active", [None, "a1", "a2"])
def test_load_onto_a_module_with_an_active_named_adapter_gives_exactly_the_folders(three, active):
    base, model, folder = three
    ours = with_torch_weights(Mlp(), base)
    ours = ours.add_adapter("a1", load_peft_adapter(ours, folder / "a1")).add_adapter(
        "a2", load_peft_adapter(ours, folder / "a2"))
    if active is not None:
        ours = ours.set_adapter(active)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # named adapters are kept: nothing to warn about
        a3 = load_peft_adapter(ours, folder / "a3")
    x = torch.randn(6, 5, generator=torch.Generator().manual_seed(6))
    model.set_adapter("a3")
    with torch.no_grad():
        expected = model(x).numpy()
    np.testing.assert_allclose(a3(Tensor.from_numpy(x.numpy())).to_numpy(), expected, atol=ATOL)
    assert a3.fc1.weight.adapter() is None  # a1's fc1 factors are not a3's
    # the named adapters stay owned (none active), with ids of their own
    assert a3.lora_adapters.names == ["a1", "a2"] and a3.active_adapter is None
    named_ids = {f.id for n in ("a1", "a2") for ad in ours.lora_adapters.adapters(n).values() for f in (ad.a, ad.b)}
    assert not named_ids & {f.id for p in ("fc2.weight", "fc3.weight") for f in (param(a3, p).adapter().a,
                                                                                   param(a3, p).adapter().b)}
    served = ours.add_adapter("a3", a3)
    rows = ["a1", "a3", None, "a2", "a3", "a1"]
    expected_rows = peft_rows(model, x, ["__base__" if r is None else r for r in rows])
    np.testing.assert_allclose(served(Tensor.from_numpy(x.numpy()), adapter_index=rows).to_numpy(), expected_rows,
                               atol=ATOL)
    np.testing.assert_allclose(a3.set_adapter("a1")(Tensor.from_numpy(x.numpy())).to_numpy(),
                               served.set_adapter("a1")(Tensor.from_numpy(x.numpy())).to_numpy(), atol=0)


def test_load_onto_unnamed_adapters_refills_targets_and_warns_about_the_others(three):
    base, model, folder = three
    adapted = with_torch_weights(Mlp(), base).apply_lora(LoraConfig(rank=8, alpha=8.0, seed=0))
    # give the adapters non-zero b so that keeping fc1's would change the output
    adapted = adapted.map(lambda path, p: p.map(lambda t: Tensor.from_numpy(np.full(t.shape, 0.1, np.float32)))
                          if path.endswith(".lora.b") else p)
    ids = {p: (param(adapted, p).adapter().a.id, param(adapted, p).adapter().b.id) for p in ("fc2.weight", "fc3.weight")}
    with pytest.warns(LoraWarning, match=r"'fc1\.weight'"):
        a3 = load_peft_adapter(adapted, folder / "a3")
    assert a3.fc1.weight.adapter() is None and adapted.fc1.weight.adapter() is not None
    assert {p: (param(a3, p).adapter().a.id, param(a3, p).adapter().b.id) for p in ids} == ids  # a refill keeps ids
    x = torch.randn(4, 5, generator=torch.Generator().manual_seed(7))
    model.set_adapter("a3")
    with torch.no_grad():
        expected = model(x).numpy()
    np.testing.assert_allclose(a3(Tensor.from_numpy(x.numpy())).to_numpy(), expected, atol=ATOL)


def test_adding_a_refill_of_unnamed_adapters_keeps_both_with_ids_of_their_own(three):
    base, model, folder = three
    adapted = with_torch_weights(Mlp(), base).apply_lora(LoraConfig(rank=8, alpha=8.0, seed=0))
    with pytest.warns(LoraWarning, match=r"'fc1\.weight'"):
        served = adapted.add_adapter("a3", load_peft_adapter(adapted, folder / "a3"))
    assert served.lora_adapters.names == ["default", "a3"] and served.active_adapter == "default"
    ids = {n: {f.id for ad in served.lora_adapters.adapters(n).values() for f in (ad.a, ad.b)}
           for n in ("default", "a3")}
    assert len(ids["default"]) == 6 and len(ids["a3"]) == 4 and not ids["default"] & ids["a3"]
    x = torch.randn(4, 5, generator=torch.Generator().manual_seed(8))
    model.set_adapter("a3")
    with torch.no_grad():
        expected = model(x).numpy()
    np.testing.assert_allclose(served.set_adapter("a3")(Tensor.from_numpy(x.numpy())).to_numpy(), expected, atol=ATOL)
    rows = served(Tensor.from_numpy(x.numpy()), adapter_index=["a3", None, "a3", None]).to_numpy()
    np.testing.assert_allclose(rows[[0, 2]], expected[[0, 2]], atol=ATOL)
    np.testing.assert_allclose(rows[[1, 3]], peft_rows(model, x, ["__base__"] * 4)[[1, 3]], atol=ATOL)


def test_saved_pattern_keys_select_one_module_among_look_alike_paths(tmp_path):
    from onnxparam import ParamGroup, save_peft_adapter

    base = randomize(TorchNet().eval(), seed=1)
    ours = with_torch_weights(Net(), base)
    ours = ours.apply_lora(LoraConfig(rank=2, alpha=2.0, seed=0, param_group=ParamGroup.from_regex(
        r"^(block\.fc1|fc10|out)\.weight$")))
    ours = ours.apply_lora(LoraConfig(rank=4, alpha=12.0, seed=1, param_group=ParamGroup.from_regex(r"^fc1\.weight$")))
    gen = np.random.default_rng(9)
    ours = ours.map(lambda path, p: p.map(lambda t: Tensor.from_numpy(gen.normal(0, 0.3, t.shape).astype(np.float32)))
                    if path.endswith(".lora.b") else p)
    save_peft_adapter(ours, tmp_path / "saved")  # fc1: rank 4, alpha 12; block.fc1 keeps r=2, alpha 2
    with quiet():
        model = peft.PeftModel.from_pretrained(copy.deepcopy(base), str(tmp_path / "saved")).eval()
    x = torch.randn(3, 6, generator=torch.Generator().manual_seed(10))
    with torch.no_grad():
        expected = model(x).numpy()
    assert model.base_model.model.block.fc1.scaling["default"] == 1.0
    np.testing.assert_allclose(ours(Tensor.from_numpy(x.numpy())).to_numpy(), expected, atol=ATOL)
    back = load_peft_adapter(with_torch_weights(Net(), base), tmp_path / "saved")
    np.testing.assert_allclose(back(Tensor.from_numpy(x.numpy())).to_numpy(), expected, atol=ATOL)


def test_load_peft_adapters_onto_unnamed_adapters_keeps_them_and_loads_each_folder_exactly(three):
    from onnxparam import load_peft_adapters

    base, model, folder = three
    adapted = with_torch_weights(Mlp(), base).apply_lora(LoraConfig(rank=8, alpha=8.0, seed=0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the unnamed adapters are kept as "default": nothing to warn about
        served = load_peft_adapters(adapted, folder)
    assert served.lora_adapters.names == ["default", "a1", "a2", "a3"] and served.active_adapter == "default"
    x = torch.randn(6, 5, generator=torch.Generator().manual_seed(11))
    rows = ["a3", "a1", None, "a2", "a3", "a1"]
    expected = peft_rows(model, x, ["__base__" if r is None else r for r in rows])
    np.testing.assert_allclose(served(Tensor.from_numpy(x.numpy()), adapter_index=rows).to_numpy(), expected,
                               atol=ATOL)
