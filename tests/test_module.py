"""Module: traversal and paths, value semantics, freezing, devices, display, num_params."""

import numpy as np
import pytest

from onnxparam import Device, LoraConfig, Module, ModuleVisitor, Param, ParamGroup, ParamId, Tensor


class Counter:
    def __init__(self):
        self.calls = 0

    def init(self, shape):
        def run(device, require_grad):
            self.calls += 1
            return Tensor.from_numpy(np.ones(shape, np.float32), device)

        return run


class Lin(Module):
    def __init__(self, d_in, d_out, counter, bias=True):
        self.weight = Param.uninitialized(ParamId(), counter.init((d_in, d_out)), "cpu", True, (d_in, d_out))
        self.bias = Param.uninitialized(ParamId(), counter.init((d_out,)), "cpu", True, (d_out,)) if bias else None
        self.d_in = d_in  # configuration, not a child


class Block(Module):
    def __init__(self, counter):
        self.fc = Lin(4, 3, counter)
        self.norm = Lin(3, 3, counter, bias=False)


class Net(Module):
    def __init__(self, counter):
        self.blocks = [Block(counter), Block(counter)]
        self.heads = {"cls": Lin(3, 2, counter), "unused": None}
        self.extra = (Lin(2, 1, counter),)


def test_paths_follow_attribute_order_with_indices_and_dict_keys():
    net = Net(Counter())
    assert [p for p, _ in net.named_params()] == [
        "blocks.0.fc.weight", "blocks.0.fc.bias", "blocks.0.norm.weight",
        "blocks.1.fc.weight", "blocks.1.fc.bias", "blocks.1.norm.weight",
        "heads.cls.weight", "heads.cls.bias", "extra.0.weight", "extra.0.bias",
    ]


def test_num_params_equals_the_hand_count_and_never_initializes():
    counter = Counter()
    net = Net(counter)
    block = 4 * 3 + 3 + 3 * 3
    assert net.num_params() == 2 * block + (3 * 2 + 2) + (2 * 1 + 1)
    assert counter.calls == 0


def test_display_shows_types_shapes_and_counts_without_initializing():
    counter = Counter()
    text = repr(Net(counter))
    assert text.startswith("Net {")
    assert "fc: Lin {" in text and "weight: [4, 3] F32" in text
    assert "params: 24" in text  # one Block
    assert counter.calls == 0


def test_tied_params_are_visited_once_and_stay_tied_after_map():
    counter = Counter()

    class Tied(Module):
        def __init__(self):
            self.enc = Lin(2, 2, counter, bias=False)
            self.dec = Lin(2, 2, counter, bias=False)
            self.dec.weight = self.enc.weight

    tied = Tied()
    assert [p for p, _ in tied.named_params()] == ["enc.weight"]
    mapped = tied.no_grad()
    assert mapped.enc.weight is mapped.dec.weight


def test_transforms_return_new_modules_and_leave_the_receiver_unchanged():
    net = Net(Counter())
    frozen = net.no_grad()
    assert all(not p.require_grad for _, p in frozen.named_params())
    assert all(p.require_grad for _, p in net.named_params())
    assert frozen.blocks[0] is not net.blocks[0]


def test_freeze_and_unfreeze_group_follow_the_group():
    net = Net(Counter())
    frozen = net.freeze_group(ParamGroup.from_path("blocks.0"))
    flags = {p: param.require_grad for p, param in frozen.named_params()}
    assert flags["blocks.0.fc.weight"] is False and flags["blocks.0.norm.weight"] is False
    assert flags["blocks.1.fc.weight"] is True
    thawed = frozen.no_grad().unfreeze_group(ParamGroup.from_regex(r"bias$"))
    assert [p for p, param in thawed.named_params() if param.require_grad] == [
        "blocks.0.fc.bias", "blocks.1.fc.bias", "heads.cls.bias", "extra.0.bias"]


def test_visit_calls_enter_visit_exit_in_order():
    events = []

    class Recorder(ModuleVisitor):
        def enter_module(self, path, module):
            events.append(("enter", path))

        def exit_module(self, path, module):
            events.append(("exit", path))

        def visit(self, path, param):
            events.append(("visit", path))

    blk = Block(Counter())
    blk.visit(Recorder())
    assert events == [("enter", ""), ("enter", "fc"), ("visit", "fc.weight"), ("visit", "fc.bias"), ("exit", "fc"),
                      ("enter", "norm"), ("visit", "norm.weight"), ("exit", "norm"), ("exit", "")]


def test_map_with_a_function_replaces_params():
    blk = Block(Counter())
    zeroed = blk.map(lambda path, p: p.map(lambda t: Tensor.from_numpy(np.zeros(t.shape, np.float32))))
    assert all(not p.val().to_numpy().any() for _, p in zeroed.named_params())
    assert all(p.val().to_numpy().all() for _, p in blk.named_params())


def test_devices_and_to_device_keep_lazy_params_lazy():
    counter = Counter()
    blk = Block(counter)
    assert blk.devices() == [Device("cpu")]
    same = blk.to_device("cpu")
    assert counter.calls == 0
    assert same.devices() == [Device("cpu")]
    # another device (no CUDA is needed: a lazy param only records where it will initialize)
    moved = blk.to_device("cuda:0")
    assert counter.calls == 0
    assert moved.devices() == [Device("cuda:0")]
    assert blk.devices() == [Device("cpu")]


def test_train_and_valid_set_the_mode_and_valid_merges_lora():
    blk = Block(Counter())
    assert blk.training is False and blk.train().training is True and blk.train().fc.training is True
    adapted = blk.apply_lora(LoraConfig(rank=2, alpha=4.0, seed=0))
    params = dict(adapted.named_params())
    b = np.random.default_rng(1).normal(size=params["fc.weight.lora.b"].lazy_shape()).astype(np.float32)
    adapted = adapted.try_load_record({"fc.weight.lora.b": b}, allow_partial=True)  # b = 0 would merge nothing
    valid = adapted.train().valid()
    assert valid.training is False
    assert all(p.adapter() is None for _, p in valid.named_params())
    base = blk.fc.weight.val().to_numpy()
    a = params["fc.weight.lora.a"].val().to_numpy()
    expected = base + (4.0 / 2) * (a @ b)  # Burn's merge: base + (alpha / rank) * (A @ B), [d_in, d_out]
    assert not np.allclose(expected, base)
    np.testing.assert_allclose(valid.fc.weight.val().to_numpy(), expected, rtol=1e-5, atol=1e-6)


def test_unknown_device_spelling_is_rejected():
    with pytest.raises(ValueError, match="unknown device 'tpu'"):
        Device("tpu")
