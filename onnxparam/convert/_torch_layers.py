"""PyTorch <-> Burn record names and layouts for the sequence layers.

Each ``*_from_torch`` takes a PyTorch ``state_dict`` subtree (names relative to the PyTorch
module, values numpy arrays) and returns the same weights under Burn's record names and
layouts, ready for :meth:`onnxparam.Module.load_record`; each ``*_to_torch`` is its inverse.
Arrays are copied into the new layout (transposes are made contiguous).

Layouts (PyTorch's ``torch.nn`` docs; Burn's ``burn-nn/src/modules``):

* ``nn.LSTM``: ``weight_ih_l0 (4H, d_input)``, ``weight_hh_l0 (4H, H)``, ``bias_ih_l0 (4H,)``,
  ``bias_hh_l0 (4H,)``, gate blocks in the order **i, f, g, o**; a bidirectional LSTM adds
  ``*_reverse``. Burn's :class:`~onnxparam.nn.Lstm` has one ``GateController`` per gate
  (``input_gate``, ``forget_gate``, ``cell_gate`` (= g), ``output_gate``) with
  ``input_transform.weight (d_input, H)`` (the transpose of a block), ``hidden_transform.weight
  (H, H)`` and their biases; :class:`~onnxparam.nn.BiLstm` nests them under ``forward.`` /
  ``reverse.``.
* ``nn.GRU``: the same packing with gate order **r, z, n** -> ``reset_gate``, ``update_gate``,
  ``new_gate``. PyTorch's GRU applies the reset gate after the hidden projection, which is
  Burn's ``reset_after = true`` (the default).
* ``nn.MultiheadAttention``: ``in_proj_weight (3E, E)`` packs query, key, value (``(out, in)``
  each), ``in_proj_bias (3E,)``, ``out_proj.{weight (E, E), bias}``; Burn's
  ``MultiHeadAttention`` has ``query``, ``key``, ``value``, ``output`` Linears with weights
  ``(d_model, d_model)`` in ``(in, out)`` order.
* ``nn.TransformerEncoderLayer``: ``self_attn.*`` (as above), ``linear1`` / ``linear2``,
  ``norm1`` / ``norm2`` (``weight``, ``bias``) -> Burn's ``mha.*``, ``pwff.linear_inner`` /
  ``pwff.linear_outer``, ``norm_1`` / ``norm_2`` (``gamma``, ``beta``; swapped for a pre-norm
  layer, see :func:`transformer_encoder_layer_from_torch`).

:func:`torch_state_dict_to_record` applies these per sub-module to a whole model's
``state_dict`` (plus the ``Linear`` transpose and norm renames of the ``pytorch`` adapter).

Only single-layer ``nn.LSTM`` / ``nn.GRU`` (``num_layers=1``; pass ``layer`` for one layer of a
stack) without ``proj_size`` map: Burn has no projection.

Raises (every function): :class:`~onnxparam.core.errors.RecordError` naming the missing or
mis-shaped entry.
"""

from __future__ import annotations

from typing import Mapping

import numpy as np

from ..core.errors import RecordError

__all__ = [
    "LSTM_GATES", "GRU_GATES",
    "lstm_from_torch", "lstm_to_torch", "gru_from_torch", "gru_to_torch",
    "mha_from_torch", "mha_to_torch",
    "transformer_encoder_layer_from_torch", "transformer_encoder_layer_to_torch",
    "transformer_decoder_layer_from_torch", "torch_state_dict_to_record",
]

LSTM_GATES = ("input_gate", "forget_gate", "cell_gate", "output_gate")
"""Burn's gate names in PyTorch's ``nn.LSTM`` block order (i, f, g, o)."""

GRU_GATES = ("reset_gate", "update_gate", "new_gate")
"""Burn's gate names in PyTorch's ``nn.GRU`` block order (r, z, n)."""


def _get(state: Mapping, name: str, what: str) -> np.ndarray:
    if name not in state:
        raise RecordError(f"{what}: the PyTorch state_dict has no {name!r}; it has {sorted(state)}")
    return np.asarray(state[name])


def _blocks(array: np.ndarray, n: int, name: str, what: str) -> list:
    if array.ndim < 1 or array.shape[0] % n:
        raise RecordError(f"{what}: {name!r} has shape {tuple(array.shape)}; expected a first dim "
                          f"divisible by {n} (the packed gates)")
    return np.split(array, n, axis=0)


def _gates_from_torch(state: Mapping, gates: tuple, suffix: str, what: str) -> dict:
    out = {}
    for kind, transform in (("ih", "input_transform"), ("hh", "hidden_transform")):
        w_name = f"weight_{kind}{suffix}"
        for gate, block in zip(gates, _blocks(_get(state, w_name, what), len(gates), w_name, what)):
            out[f"{gate}.{transform}.weight"] = np.ascontiguousarray(block.T)
        b_name = f"bias_{kind}{suffix}"
        if b_name in state:
            for gate, block in zip(gates, _blocks(_get(state, b_name, what), len(gates), b_name, what)):
                out[f"{gate}.{transform}.bias"] = np.array(block)
    return out


def _gates_to_torch(record: Mapping, gates: tuple, prefix: str, suffix: str, what: str) -> dict:
    out = {}
    for kind, transform in (("ih", "input_transform"), ("hh", "hidden_transform")):
        out[f"weight_{kind}{suffix}"] = np.concatenate(
            [_get(record, f"{prefix}{g}.{transform}.weight", what).T for g in gates], axis=0)
        if f"{prefix}{gates[0]}.{transform}.bias" in record:
            out[f"bias_{kind}{suffix}"] = np.concatenate(
                [_get(record, f"{prefix}{g}.{transform}.bias", what) for g in gates], axis=0)
    return out


def _check_no_projection(state: Mapping, what: str) -> None:
    extra = [k for k in state if k.startswith("weight_hr")]
    if extra:
        raise RecordError(f"{what}: {extra[0]!r} is an LSTM projection (proj_size > 0), which Burn's Lstm lacks")


def _recurrent_from_torch(state: Mapping, gates: tuple, layer: int, what: str) -> dict:
    """One layer of a packed PyTorch ``nn.LSTM`` / ``nn.GRU`` state_dict as Burn's per-gate
    record; ``forward.`` / ``reverse.`` prefixed when the layer is bidirectional (``*_reverse``)."""
    suffix = f"_l{int(layer)}"
    forward = _gates_from_torch(state, gates, suffix, what)
    if f"weight_ih{suffix}_reverse" not in state:
        return forward
    reverse = _gates_from_torch(state, gates, suffix + "_reverse", what)
    return {**{f"forward.{k}": v for k, v in forward.items()}, **{f"reverse.{k}": v for k, v in reverse.items()}}


def _recurrent_to_torch(record: Mapping, gates: tuple, layer: int, what: str) -> dict:
    """The inverse of :func:`_recurrent_from_torch`."""
    suffix = f"_l{int(layer)}"
    if any(k.startswith("forward.") for k in record):
        return {**_gates_to_torch(record, gates, "forward.", suffix, what),
                **_gates_to_torch(record, gates, "reverse.", suffix + "_reverse", what)}
    return _gates_to_torch(record, gates, "", suffix, what)


def lstm_from_torch(state: Mapping, layer: int = 0) -> dict:
    """Burn names for one layer of a PyTorch ``nn.LSTM`` state_dict.

    Args:
        state: ``{"weight_ih_l0": (4H, d_input), "weight_hh_l0": (4H, H), "bias_ih_l0": (4H,),
            "bias_hh_l0": (4H,), ...}`` as numpy arrays (biases optional, ``bias=False``).
        layer: which layer of a stack (``_l{layer}``).

    Returns:
        For a unidirectional LSTM, :class:`~onnxparam.nn.Lstm`'s record
        (``input_gate.input_transform.weight (d_input, H)`` ...); for a bidirectional one
        (``*_reverse`` present), :class:`~onnxparam.nn.BiLstm`'s (``forward.`` / ``reverse.``).
    """
    _check_no_projection(state, "lstm_from_torch")
    return _recurrent_from_torch(state, LSTM_GATES, layer, "lstm_from_torch")


def lstm_to_torch(record: Mapping, layer: int = 0) -> dict:
    """The inverse of :func:`lstm_from_torch`: an ``Lstm`` / ``BiLstm`` record (numpy arrays by
    Burn name) as ``nn.LSTM`` state_dict entries of layer ``layer``."""
    return _recurrent_to_torch(record, LSTM_GATES, layer, "lstm_to_torch")


def gru_from_torch(state: Mapping, layer: int = 0) -> dict:
    """Burn names for one layer of a PyTorch ``nn.GRU`` state_dict (``weight_ih_l0 (3H, d_input)``
    ..., gates r, z, n): :class:`~onnxparam.nn.Gru`'s record (``reset_after=True``), or
    :class:`~onnxparam.nn.BiGru`'s (``forward.`` / ``reverse.``) when ``*_reverse`` is present."""
    return _recurrent_from_torch(state, GRU_GATES, layer, "gru_from_torch")


def gru_to_torch(record: Mapping, layer: int = 0) -> dict:
    """The inverse of :func:`gru_from_torch` (a ``Gru`` or ``BiGru`` record)."""
    return _recurrent_to_torch(record, GRU_GATES, layer, "gru_to_torch")


def mha_from_torch(state: Mapping) -> dict:
    """Burn names for a PyTorch ``nn.MultiheadAttention`` state_dict (same embedding size for
    query, key and value: the packed ``in_proj_weight (3E, E)`` form).

    Returns:
        ``{"query.weight": (E, E), "query.bias": (E,), "key.*", "value.*", "output.*"}``, weights
        in Burn's ``(d_input, d_output)`` layout.
    """
    what = "mha_from_torch"
    if "in_proj_weight" not in state:
        raise RecordError(f"{what}: no 'in_proj_weight'; separate q/k/v projections (kdim/vdim != embed_dim) "
                          "do not map to Burn's MultiHeadAttention")
    out = {}
    names = ("query", "key", "value")
    for name, block in zip(names, _blocks(_get(state, "in_proj_weight", what), 3, "in_proj_weight", what)):
        out[f"{name}.weight"] = np.ascontiguousarray(block.T)
    if "in_proj_bias" in state:
        for name, block in zip(names, _blocks(_get(state, "in_proj_bias", what), 3, "in_proj_bias", what)):
            out[f"{name}.bias"] = np.array(block)
    out["output.weight"] = np.ascontiguousarray(_get(state, "out_proj.weight", what).T)
    if "out_proj.bias" in state:
        out["output.bias"] = np.array(_get(state, "out_proj.bias", what))
    return out


def mha_to_torch(record: Mapping) -> dict:
    """The inverse of :func:`mha_from_torch`."""
    what = "mha_to_torch"
    names = ("query", "key", "value")
    out = {"in_proj_weight": np.concatenate([_get(record, f"{n}.weight", what).T for n in names], axis=0)}
    if "query.bias" in record:
        out["in_proj_bias"] = np.concatenate([_get(record, f"{n}.bias", what) for n in names], axis=0)
    out["out_proj.weight"] = np.ascontiguousarray(_get(record, "output.weight", what).T)
    if "output.bias" in record:
        out["out_proj.bias"] = np.array(_get(record, "output.bias", what))
    return out


_ENCODER_LINEARS = (("linear1", "pwff.linear_inner"), ("linear2", "pwff.linear_outer"))


def _encoder_norms(norm_first: bool) -> tuple:
    """PyTorch's ``norm1`` sits around attention, ``norm2`` around the feed-forward; Burn's
    post-norm layer names them ``norm_1`` / ``norm_2`` likewise, its pre-norm layer the other
    way round (``norm_2`` before attention, ``norm_1`` before the feed-forward; ``encoder.rs``)."""
    if norm_first:
        return ("norm1", "norm_2"), ("norm2", "norm_1")
    return ("norm1", "norm_1"), ("norm2", "norm_2")


def _sub(state: Mapping, prefix: str) -> dict:
    return {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}


def transformer_encoder_layer_from_torch(state: Mapping, norm_first: bool = False) -> dict:
    """Burn names (:class:`~onnxparam.nn.TransformerEncoderLayer`) for a PyTorch
    ``nn.TransformerEncoderLayer`` state_dict (``self_attn.*``, ``linear1``, ``linear2``,
    ``norm1``, ``norm2``).

    The computation matches when the PyTorch layer uses ``activation="gelu"`` (Burn's
    position-wise feed-forward uses GELU), ``batch_first=True``, and the same ``norm_first``
    (pass it here: it decides which PyTorch norm is Burn's ``norm_1``) and ``layer_norm_eps``
    (Burn's 1e-5).
    """
    what = "transformer_encoder_layer_from_torch"
    out = {f"mha.{k}": v for k, v in mha_from_torch(_sub(state, "self_attn.")).items()}
    for torch_name, burn_name in _ENCODER_LINEARS:
        out[f"{burn_name}.weight"] = np.ascontiguousarray(_get(state, f"{torch_name}.weight", what).T)
        if f"{torch_name}.bias" in state:
            out[f"{burn_name}.bias"] = np.array(_get(state, f"{torch_name}.bias", what))
    for torch_name, burn_name in _encoder_norms(norm_first):
        out[f"{burn_name}.gamma"] = np.array(_get(state, f"{torch_name}.weight", what))
        out[f"{burn_name}.beta"] = np.array(_get(state, f"{torch_name}.bias", what))
    return out


def transformer_encoder_layer_to_torch(record: Mapping, norm_first: bool = False) -> dict:
    """The inverse of :func:`transformer_encoder_layer_from_torch`."""
    what = "transformer_encoder_layer_to_torch"
    out = {f"self_attn.{k}": v for k, v in mha_to_torch(_sub(record, "mha.")).items()}
    for torch_name, burn_name in _ENCODER_LINEARS:
        out[f"{torch_name}.weight"] = np.ascontiguousarray(_get(record, f"{burn_name}.weight", what).T)
        if f"{burn_name}.bias" in record:
            out[f"{torch_name}.bias"] = np.array(_get(record, f"{burn_name}.bias", what))
    for torch_name, burn_name in _encoder_norms(norm_first):
        out[f"{torch_name}.weight"] = np.array(_get(record, f"{burn_name}.gamma", what))
        out[f"{torch_name}.bias"] = np.array(_get(record, f"{burn_name}.beta", what))
    return out


def _decoder_norms(norm_first: bool) -> tuple:
    """PyTorch's ``norm1`` / ``norm2`` / ``norm3`` sit around self-attention, cross-attention and
    the feed-forward; Burn's post-norm decoder layer names them ``norm_1`` / ``norm_2`` /
    ``norm_3`` likewise, its pre-norm layer ``norm_3`` / ``norm_1`` / ``norm_2`` (``decoder.rs``)."""
    if norm_first:
        return ("norm1", "norm_3"), ("norm2", "norm_1"), ("norm3", "norm_2")
    return ("norm1", "norm_1"), ("norm2", "norm_2"), ("norm3", "norm_3")


def transformer_decoder_layer_from_torch(state: Mapping, norm_first: bool = False) -> dict:
    """Burn names (:class:`~onnxparam.nn.TransformerDecoderLayer`) for a PyTorch
    ``nn.TransformerDecoderLayer`` state_dict (``self_attn.*``, ``multihead_attn.*`` ->
    ``cross_attn.*``, ``linear1`` / ``linear2``, ``norm1..3``); conditions as
    :func:`transformer_encoder_layer_from_torch`."""
    what = "transformer_decoder_layer_from_torch"
    out = {f"self_attn.{k}": v for k, v in mha_from_torch(_sub(state, "self_attn.")).items()}
    out.update({f"cross_attn.{k}": v for k, v in mha_from_torch(_sub(state, "multihead_attn.")).items()})
    for torch_name, burn_name in _ENCODER_LINEARS:
        out[f"{burn_name}.weight"] = np.ascontiguousarray(_get(state, f"{torch_name}.weight", what).T)
        if f"{torch_name}.bias" in state:
            out[f"{burn_name}.bias"] = np.array(_get(state, f"{torch_name}.bias", what))
    for torch_name, burn_name in _decoder_norms(norm_first):
        out[f"{burn_name}.gamma"] = np.array(_get(state, f"{torch_name}.weight", what))
        out[f"{burn_name}.beta"] = np.array(_get(state, f"{torch_name}.bias", what))
    return out


# -- a whole module ----------------------------------------------------------------------------------

_IGNORED_TORCH_KEYS = ("num_batches_tracked",)


def _type_names(module) -> set:
    return {cls.__name__ for cls in type(module).__mro__}


def layer_mapper(module):
    """The mapping function for a module whose PyTorch counterpart packs or renames tensors, by
    the class names in its MRO (as :class:`~onnxparam.convert._adapters.PyTorchAdapter` decides
    by the holding module's type), or ``None``."""
    names = _type_names(module)
    if names & {"Lstm", "BiLstm"}:
        return lstm_from_torch
    if names & {"Gru", "BiGru"}:
        return gru_from_torch
    if "MultiHeadAttention" in names:
        return mha_from_torch
    if "TransformerEncoderLayer" in names:
        return lambda state: transformer_encoder_layer_from_torch(state, bool(getattr(module, "norm_first", False)))
    if "TransformerDecoderLayer" in names:
        return lambda state: transformer_decoder_layer_from_torch(state, bool(getattr(module, "norm_first", False)))
    return None


def torch_state_dict_to_record(module, state: Mapping) -> dict:
    """A whole PyTorch ``state_dict`` as a record for ``module`` (built with this library's layers
    and the PyTorch model's attribute names), ready for :meth:`onnxparam.Module.load_record`.

    Sub-modules are matched by path: a :class:`~onnxparam.nn.Lstm` / ``BiLstm`` / ``Gru`` /
    ``BiGru`` / ``MultiHeadAttention`` / ``TransformerEncoderLayer`` / ``TransformerDecoderLayer``
    at path ``p`` takes the PyTorch tensors under ``p.`` through the functions above (the
    pre-norm flag is read from the layer); every other param is decided by the PyTorch adapter
    (:class:`~onnxparam.convert._adapters.PyTorchAdapter`, the one place these rules live: a
    ``Linear``'s weight is transposed, a norm's ``weight`` / ``bias`` become ``gamma`` /
    ``beta``, ``num_batches_tracked`` is dropped, embeddings and convolutions are taken as is).
    :func:`onnxparam.convert.apply_record` with ``adapter="pytorch"`` does the same and loads.

    Args:
        module: the target :class:`~onnxparam.Module`.
        state: PyTorch names -> numpy arrays (``{k: v.detach().numpy() for k, v in
            model.state_dict().items()}``).

    Raises:
        RecordError: listing every PyTorch tensor that no param of ``module`` takes (missing
            params are reported by ``load_record``).
    """
    from ..core.module import named_modules
    from ..core.record import as_record
    from ._adapters import PyTorchAdapter

    adapter = PyTorchAdapter()
    snaps = dict(as_record({str(k): v for k, v in state.items()}))
    mapped, consumed = adapter.restructure(module, snaps, layer_mapper)
    record = {path: snap.to_data().to_numpy() for path, snap in mapped.items()}
    types = {path: tuple(c.__name__ for c in type(m).__mro__) for path, m in named_modules(module)}
    used = set(consumed)
    for path, _ in module.named_params():
        if path in record:
            continue
        owner = types.get(path.rpartition(".")[0], ())
        name = path if path in snaps else adapter.file_name(path, owner)
        if name not in snaps or name in used:
            continue  # load_record reports it as missing
        value = snaps[name].to_data().to_numpy()
        if adapter.transposes(path, owner, tuple(value.shape)):
            value = np.ascontiguousarray(value.T)
        record[path] = value
        used.add(name)
    unexpected = [k for k in snaps if k not in used and not k.endswith(_IGNORED_TORCH_KEYS)]
    if unexpected:
        raise RecordError(f"torch_state_dict_to_record: {len(unexpected)} PyTorch tensor(s) match no param of "
                          f"{type(module).__name__}; name the sub-modules as the PyTorch model does",
                          [f"unexpected {k!r} {tuple(snaps[k].shape)}" for k in unexpected])
    return record
