"""``.pt`` checkpoints whose tensors torch pickles through its other rebuild functions load
without torch and without running anything: ``state_dict(keep_vars=True)`` (Parameters), a
Parameter carrying Python attributes (``_rebuild_parameter_with_state``), a plain tensor
carrying attributes (``_rebuild_from_type_v2``), and tensors with the conjugate / negative bits
set; a tensor subclass defined in the user's code is refused by name, nothing run.

Oracle: ``torch.load`` of the same file (torch's own reading of its format).
"""

from __future__ import annotations

import numpy as np
import pytest

import onnxparam as op
from onnxparam.formats._pytorch import read_pytorch

torch = pytest.importorskip("torch")


def _saved(tmp_path, name, obj):
    path = tmp_path / f"{name}.pt"
    torch.save(obj, path)
    return path


def _same_as_torch(path):
    truth = torch.load(path, weights_only=False)
    tensors = read_pytorch(path).tensors
    assert set(tensors) == set(truth)
    for key, value in truth.items():
        expected = value.detach().resolve_conj().resolve_neg().numpy()
        got = np.asarray(tensors[key])
        assert got.dtype == expected.dtype and got.shape == expected.shape
        np.testing.assert_array_equal(got, expected)


def test_parameters_of_keep_vars_load_as_torch_reads_them(tmp_path):
    torch.manual_seed(0)
    _same_as_torch(_saved(tmp_path, "kv", torch.nn.Linear(3, 2).state_dict(keep_vars=True)))


def test_a_parameter_and_a_tensor_with_python_attributes_load_as_torch_reads_them(tmp_path):
    p = torch.nn.Parameter(torch.arange(6, dtype=torch.float32).reshape(2, 3))
    p.note = "tied"  # pickled with its state: _rebuild_parameter_with_state
    t = torch.arange(4, dtype=torch.float64)
    t.tag = 3  # pickled through _rebuild_from_type_v2
    _same_as_torch(_saved(tmp_path, "state", {"p": p, "t": t}))


def test_conjugate_and_negative_views_load_with_their_bits_resolved(tmp_path):
    z = torch.tensor([1 + 2j, -3 - 0.5j], dtype=torch.complex64)
    w = torch.tensor([0.5 - 1j, 2 + 4j], dtype=torch.complex64)  # another storage: torch saves no two views
    _same_as_torch(_saved(tmp_path, "bits", {"conj": z.conj(), "neg_imag": w.conj().imag}))


class UserTensor(torch.Tensor):
    pass


def test_a_tensor_subclass_of_user_code_is_refused_by_name_and_not_run(tmp_path):
    path = _saved(tmp_path, "sub", {"t": torch.ones(2).as_subclass(UserTensor)})
    with pytest.raises(op.RecordError, match=r"global '.*UserTensor' is not allowed in a weights file; nothing in "
                                             r"it was run"):
        read_pytorch(path)
