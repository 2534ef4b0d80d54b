"""ParamGroup: each constructor matches exactly the paths it should."""

import re

import numpy as np
import pytest

from onnxparam import Module, Param, ParamGroup, ParamId, Tensor

PATHS = ["fc1.weight", "fc1.bias", "fc10.weight", "conv.weight", "conv.bias", "head.fc1.weight"]


def selected(group, paths=PATHS, ids=None):
    ids = ids or {p: ParamId(i) for i, p in enumerate(paths)}
    return [p for p in paths if group.matches(ids[p], p)]


def test_all_matches_everything():
    assert selected(ParamGroup.all()) == PATHS


def test_from_path_matches_the_path_and_below_but_not_siblings_with_the_same_prefix():
    assert selected(ParamGroup.from_path("fc1")) == ["fc1.weight", "fc1.bias"]
    assert selected(ParamGroup.from_path("conv.bias")) == ["conv.bias"]


def test_from_paths_is_a_union():
    assert selected(ParamGroup.from_paths(["fc10", "conv"])) == ["fc10.weight", "conv.weight", "conv.bias"]


def test_from_predicate_and_predicates_and_any_predicates():
    is_weight = lambda p: p.endswith(".weight")  # noqa: E731
    in_fc = lambda p: p.startswith("fc")  # noqa: E731
    assert selected(ParamGroup.from_predicate(is_weight)) == ["fc1.weight", "fc10.weight", "conv.weight", "head.fc1.weight"]
    assert selected(ParamGroup.from_predicates([is_weight, in_fc])) == ["fc1.weight", "fc10.weight"]
    assert selected(ParamGroup.from_any_predicates([in_fc, lambda p: p == "conv.bias"])) == [
        "fc1.weight", "fc1.bias", "fc10.weight", "conv.bias"]


def test_from_regex_searches_and_from_regexes_is_an_and():
    assert selected(ParamGroup.from_regex(r"^fc\d+\.weight$")) == ["fc1.weight", "fc10.weight"]
    assert selected(ParamGroup.from_regex(r"fc1\.")) == ["fc1.weight", "fc1.bias", "head.fc1.weight"]
    assert selected(ParamGroup.from_regexes([r"weight", r"^(fc|head)"])) == ["fc1.weight", "fc10.weight", "head.fc1.weight"]
    with pytest.raises(re.error):
        ParamGroup.from_regex("(")


def test_excluding_removes_the_other_group():
    group = ParamGroup.all().excluding(ParamGroup.from_regex("bias$"))
    assert selected(group) == ["fc1.weight", "fc10.weight", "conv.weight", "head.fc1.weight"]


class Pair(Module):
    def __init__(self):
        self.a = Param.initialized(ParamId(1), Tensor.from_numpy(np.zeros(2, np.float32)))
        self.b = Param.initialized(ParamId(2), Tensor.from_numpy(np.zeros(2, np.float32)))


def test_ids_from_module_matches_by_id_whatever_the_path():
    group = ParamGroup.ids_from_module(Pair())
    assert group.matches(ParamId(1), "anything") and group.matches(ParamId(2), "x")
    assert not group.matches(ParamId(3), "a")
