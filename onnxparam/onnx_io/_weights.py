"""Finding the weights of an ONNX graph: which tensors become params, under which paths.

A **weight** is a tensor of the model that feeds computation the way a trained parameter does.
Candidates are, in every graph of the model (the main graph and every ``If`` / ``Loop`` /
``Scan`` body, recursively), the **initializers** (constant ones, and those that are also graph
inputs: IR < 4 models list every initializer as an input; callers may override those, see
``OnnxModule.forward``) and the tensors held by **``Constant`` nodes** (``value`` attribute).
A candidate is a weight when (:func:`is_weight`):

1. its element type has a Burn dtype (float, signed / unsigned int, bool) and it has at least
   one element;
2. it is not used *only* at inputs the ONNX operator schema marks non-differentiable (the
   ``shape`` of ``Reshape`` / ``Expand``, ``starts`` / ``axes`` of ``Slice``, ``scales`` of
   ``Resize``, ``min`` / ``max`` of ``Clip``, ``Equal``'s operands ...; the schema's
   ``differentiation_category`` at the model's opset, or the newest schema's for the same input
   name when the model's version predates categories): those are shapes, indices, bounds and
   flags, not parameters. Inputs the library's gradient rules differentiate although the schema
   marks them so (``initial_h`` / ``initial_c`` of ``GRU`` / ``LSTM`` / ``RNN``, ``GridSample``'s
   grid, ``AffineGrid``'s theta, ``Pad``'s constant value, ``DFT`` / ``STFT``'s signal ...:
   :data:`onnxparam.autodiff._rules.DIFFERENTIATED_INPUTS`) are weight uses. Inputs of unknown category (custom domains) count as weight uses, as
   does being a graph output or having no use at all;
3. a non-float candidate has more than :data:`MAX_INLINE_CONSTANT_ELEMENTS` elements (quantized
   weights are large; index and shape vectors are small);
4. a 0-d tensor held by a ``Constant`` node is a literal of an expression (the ``0.2`` of a
   hard-sigmoid, ``1/sqrt(d)``: TorchScript's ``/Constant_output_0``), not a weight. A 0-d
   float **initializer** is a weight: PyTorch exporters write a scalar ``nn.Parameter``
   (a pre-emphasis coefficient, a learned logit scale, a ReZero alpha) as one, under its
   state-dict name. Exporters write their own scalar constants as initializers too. Where the
   file itself marks what is a parameter, an unmarked 0-d initializer is such a constant and
   not a weight (:func:`marked_constants`: torch dynamo's ``InputSpec`` metadata, onnxparam's
   own ``onnxparam.params`` table), unless the exporter's optimizer folded it from a value
   that may have been a parameter (a doubt: then it is a weight, frozen and listed). Other
   exporters' constants (``onnx::Mul_12``, jax2tf's ``Const_4:0``) import as frozen params,
   listed in ``OnnxModule.onnx_tables`` with the evidence
   (:func:`onnxparam.autodiff._tables.find_scalar_constants`).

5. rules 2-4 do not apply to the codes, scale and zero point of a quantized weight (the
   constant data, scale and zero-point inputs of ``DequantizeLinear``, the weight inputs of
   ``MatMulInteger`` / ``ConvInteger`` / ``QLinearMatMul`` / ``QLinearConv`` and ONNX Runtime's
   ``MatMulNBits``): they are weights whatever their size. (The importer first folds the forms
   Burn can hold into one ``QFloat`` weight each, :mod:`onnxparam.quant._qdq_import`; what is
   left, e.g. asymmetric ``uint8`` codes with a zero point, is carried as it is.)

What is not a weight is not a param: it stays part of the graph, keeping its name (an export
writes it as an initializer), and so do ``Constant`` nodes with ``value_float`` /
``value_ints`` / ... / ``sparse_value`` attributes and tensors of element types Burn has no
dtype for (strings, float8, int4, complex; graphs that compute on those cannot be traced).

NOTE: Paddle and some PyTorch exporters put every weight in ``Constant`` nodes, so ``Constant``
nodes must be looked at too (PP-OCR: 342 of them, no initializer at all).

One tensor used by several nodes is one value, so it is one weight (tied weights stay tied).
The weight's **name** is the initializer's name or the ``Constant`` output's name; its **path**
is :func:`~onnxparam.onnx_io._naming.onnx_name_to_path` of the name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import onnx
import onnx_ir as ir

from ..core.dtype import DTYPE_FROM_ONNX, DType, dtype_from_onnx_element
from ..core.errors import OnnxFormatError
from ..core.tensor import TensorData
from ..trace.evidence import stored_tensor
from ._naming import onnx_name_to_path
from ._source import iter_graphs

__all__ = [
    "MAX_INLINE_CONSTANT_ELEMENTS",
    "INITIALIZER",
    "CONSTANT",
    "WeightSite",
    "find_weights",
    "is_weight",
    "burn_dtype",
    "weight_dtype",
    "tensor_data",
    "feeds_quantized_weight",
    "stored_tensor",
]

MAX_INLINE_CONSTANT_ELEMENTS = 64
"""A non-float tensor with at most this many elements (a shape, axes, indices) is not a weight
(rule 3 of the module docstring)."""

INITIALIZER = "initializer"
CONSTANT = "constant"


def burn_dtype(dtype: ir.DataType) -> Optional[DType]:
    """The Burn dtype of an ONNX element type, or ``None`` when Burn has none."""
    return DTYPE_FROM_ONNX.get(int(dtype.value))


_ONNX_ONLY_WEIGHTS = frozenset({DType.F8E4M3FN, DType.F8E4M3FNUZ, DType.F8E5M2, DType.F8E5M2FNUZ, DType.F8E8M0FNU})
"""ONNX-only element types whose tensors import as params (float8 weights, one byte each); other
ONNX-only tensors (strings, packed int4 ...) stay in the graph as it came in."""


def weight_dtype(dtype: ir.DataType) -> Optional[DType]:
    """The param dtype of a tensor of ONNX element type ``dtype``: Burn's, or an ONNX-only float8
    type (see :mod:`onnxparam.core.dtype`), else ``None`` (not a weight)."""
    hit = burn_dtype(dtype)
    if hit is not None:
        return hit
    try:
        other = dtype_from_onnx_element(int(dtype.value))
    except ValueError:
        return None
    return other if other in _ONNX_ONLY_WEIGHTS else None


@dataclass(frozen=True, eq=False)
class WeightSite:
    """Where a weight lives in the source graph.

    Attributes:
        name: the ONNX name (initializer name or ``Constant`` output name).
        path: the module path of ``name``.
        kind: :data:`INITIALIZER` or :data:`CONSTANT`.
        value: the ``onnx_ir`` value (the initializer, or the ``Constant``'s output).
        node: the ``Constant`` node, for :data:`CONSTANT` weights.
        graph: the graph holding it (the main graph or a subgraph).
        tensor: the ``onnx_ir`` tensor (in memory, or external and memory-mapped on access).
        dtype: its Burn dtype.
        shape: its shape.
        is_graph_input: an initializer that is also an input of the main graph (overridable).
    """

    name: str
    path: str
    kind: str
    value: ir.Value
    node: Optional[ir.Node]
    graph: ir.Graph
    tensor: ir.TensorProtocol
    dtype: DType
    shape: tuple
    is_graph_input: bool


_NON_DIFFERENTIABLE = onnx.defs.OpSchema.DifferentiationCategory.NonDifferentiable
_UNKNOWN = onnx.defs.OpSchema.DifferentiationCategory.Unknown


def _differentiated_inputs() -> dict:
    """``op_type`` -> the ``ai.onnx`` inputs that carry gradients though their schemas say
    ``NonDifferentiable``: the ones the library's gradient rules declare they differentiate
    (:data:`onnxparam.autodiff._rules.DIFFERENTIATED_INPUTS`: an RNN's ``initial_h`` /
    ``initial_c``, ``GridSample``'s grid, ``AffineGrid``'s theta, ``DFT`` / ``STFT``'s signal
    and window, ``Pad``'s constant value ...)."""
    from ..autodiff import _backward  # noqa: F401  (every rule module registers its rules)
    from ..autodiff._rules import DIFFERENTIATED_INPUTS

    return DIFFERENTIATED_INPUTS


def _input_category(node: ir.Node, index: int, opsets: dict):
    """The differentiation category of ``node``'s input ``index`` (``None`` when unknown).

    Categories were added to the schemas in ONNX 1.8 and older operator versions often say
    ``Unknown``; then the newest schema's category of the input with the same name is used."""
    domain = "" if node.domain == "ai.onnx" else node.domain
    if domain == "" and index in _differentiated_inputs().get(node.op_type, ()):
        return onnx.defs.OpSchema.DifferentiationCategory.Differentiable
    try:
        schema = onnx.defs.get_schema(node.op_type, int(opsets.get(domain, 1)), domain)
    except onnx.defs.SchemaError:
        return None
    formal = schema.inputs
    if not formal:
        return None
    spec = formal[min(index, len(formal) - 1)]
    category = spec.differentiation_category
    if category == _UNKNOWN:
        try:
            latest = onnx.defs.get_schema(node.op_type, domain)
        except onnx.defs.SchemaError:
            return None
        for other in latest.inputs:
            if other.name == spec.name:
                return other.differentiation_category
    return category


def _only_non_differentiable_uses(value: ir.Value, opsets: dict) -> bool:
    uses = list(value.uses())
    if not uses or value.is_graph_output():
        return False
    return all(_input_category(node, index, opsets) == _NON_DIFFERENTIABLE for node, index in uses)


_QUANTIZED_WEIGHT_INPUTS = {
    ("", "DequantizeLinear"): (0, 1, 2),
    ("", "MatMulInteger"): (1, 3),
    ("", "ConvInteger"): (1, 3),
    ("", "QLinearMatMul"): (3, 4, 5),
    ("", "QLinearConv"): (3, 4, 5, 8),
    ("com.microsoft", "MatMulNBits"): (1, 2, 3, 5),
}
"""Operator inputs that hold a quantized weight's codes, scale, zero point (and ``QLinearConv``'s
int32 bias), by (domain, op type): ONNX operator spec for the ``ai.onnx`` ones, ONNX Runtime's
contrib-op docs for ``MatMulNBits``. Their schemas mark them non-differentiable (integer data),
yet they are the model's weights (rule 5 of the module docstring)."""


_REDUCE_OPS = ("ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1", "ReduceL2",
               "ReduceLogSum", "ReduceLogSumExp", "ReduceSumSquare")

SHAPE_DATA_INPUTS = {
    "Reshape": (1,), "Expand": (1,), "Tile": (1, 2), "ConstantOfShape": (0,), "TopK": (1,), "Unsqueeze": (1,),
    "Squeeze": (1,), "Slice": (1, 2, 3, 4), "Pad": (1, 3), "Resize": (1, 2, 3), "Upsample": (1,), "Split": (1,),
    "OneHot": (1,), "Range": (0, 1, 2), "CenterCropPad": (1,), "Col2Im": (1, 2), "NonMaxSuppression": (2,),
    "MaxUnpool": (2,), "DFT": (1, 2), "STFT": (1, 3), "Compress": (1,), **{op: (1,) for op in _REDUCE_OPS},
}
"""Inputs of ``ai.onnx`` operators whose values decide an output's shape (ONNX operator spec:
``Reshape``'s shape, ``Resize``'s roi / scales / sizes, ``Upsample``'s scales, ``Slice``'s
starts / ends / axes / steps ...). An initializer read there is never a param: ONNX Runtime's
shape inference reads its value when the session is built, which it cannot do for an injected
or fed value ("Cannot parse data from external tensors")."""


def reads_as_shape(value: ir.Value) -> bool:
    """True when some ``ai.onnx`` node reads ``value`` at a shape input (:data:`SHAPE_DATA_INPUTS`)."""
    for node, index in value.uses():
        if node.domain in ("", "ai.onnx") and index in SHAPE_DATA_INPUTS.get(node.op_type, ()):
            return True
    return False


def _is_constant(value: Optional[ir.Value]) -> bool:
    if value is None:
        return False
    producer = value.producer()
    return value.const_value is not None or (producer is not None and producer.op_type == "Constant")


def feeds_quantized_weight(value: ir.Value) -> bool:
    """True when ``value`` is used at a quantized-weight input (:data:`_QUANTIZED_WEIGHT_INPUTS`);
    for ``DequantizeLinear``, only when its data input is a constant (a weight's codes, not an
    activation's)."""
    for node, index in value.uses():
        domain = "" if node.domain == "ai.onnx" else node.domain
        if index not in _QUANTIZED_WEIGHT_INPUTS.get((domain, node.op_type), ()):
            continue
        if node.op_type == "DequantizeLinear" and not _is_constant(node.inputs[0]):
            continue
        return True
    return False


def is_weight(tensor: ir.TensorProtocol, value: ir.Value, opsets: dict) -> bool:
    """True when ``tensor`` (the data of ``value``) is a weight by the module docstring's rules.

    Args:
        tensor: the initializer's or ``Constant``'s tensor.
        value: the initializer value or the ``Constant``'s output (its uses are looked at).
        opsets: the model's opset imports (domain -> version), for the operator schemas.
    """
    dtype = weight_dtype(tensor.dtype)
    if dtype is None:
        return False
    shape = tuple(tensor.shape.numpy())
    size = int(np.prod(shape)) if shape else 1
    if size < 1:
        return False
    if feeds_quantized_weight(value):
        return True  # rule 5: codes, scales and zero points of a quantized weight, any size or rank
    if (len(shape) == 0 and (value.producer() is not None or not dtype.is_float)) or reads_as_shape(value):
        return False  # rule 4: a 0-d Constant is a literal; a 0-d float initializer may be a param
    if not dtype.is_float and size <= MAX_INLINE_CONSTANT_ELEMENTS:
        return False
    return not _only_non_differentiable_uses(value, opsets)


_INPUT_KIND = "pkg.torch.export.graph_signature.InputSpec.kind"
_FOLDED_FROM = "pkg.onnxscript.optimizer.folded_from"


def _folded_from_possible_parameter(value: ir.Value) -> bool:
    """True when the exporter's optimizer says it folded ``value`` from a value not named as
    an exporter names its own constants (possibly a parameter)."""
    from ..autodiff._tables import is_generated_name

    text = value.metadata_props.get(_FOLDED_FROM)
    if not text:
        return False
    try:
        import ast

        sources = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return True
    return not all(isinstance(n, str) and is_generated_name(n) for n in sources)


def marked_constants(model: ir.Model):
    """A predicate ``(name, value) -> bool``: True for a 0-d initializer that the file's own
    marks say is an exporter's constant, not a parameter (rule 4 of the module docstring).

    Marks: torch dynamo writes ``pkg.torch.export.graph_signature.InputSpec.kind``
    (``PARAMETER`` / ``BUFFER``) on every parameter and buffer; onnxparam's exporter lists
    every param in the model's ``onnxparam.params`` metadata. A file with neither has no
    marks: nothing is decided here."""
    from ._metadata import PARAMS_KEY

    listed = model.metadata_props.get(PARAMS_KEY)
    if listed is not None:
        import json

        try:
            paths = set(json.loads(listed))
        except (ValueError, TypeError):
            return lambda name, value: False
        return lambda name, value: name not in paths and onnx_name_to_path(name) not in paths
    if any(_INPUT_KIND in v.metadata_props for v in model.graph.initializers.values()):
        return lambda name, value: (_INPUT_KIND not in value.metadata_props
                                    and not _folded_from_possible_parameter(value))
    return lambda name, value: False


def find_weights(model: ir.Model, source: str = "the model") -> list[WeightSite]:
    """The weights of ``model`` in graph order: per graph (main graph first, then subgraphs depth
    first), initializers in declaration order, then weight ``Constant`` nodes in node order.

    Sibling subgraphs (the two branches of an ``If``) may hold weights of the same name: the
    later one's path gets a ``__1`` (``__2`` ...) suffix.

    Raises:
        OnnxFormatError: when two weights of one graph (or a subgraph and the main graph) have
            the same name or path.
    """
    sites: list[WeightSite] = []
    main = model.graph
    from ._op_registry import model_opsets

    opsets = model_opsets(model)
    main_inputs = {id(v) for v in main.inputs}
    constant = marked_constants(model)
    for graph in iter_graphs(main):
        for name, value in graph.initializers.items():
            tensor = value.const_value
            if tensor is None:
                continue
            if not is_weight(tensor, value, opsets):
                continue
            if len(tensor.shape) == 0 and not feeds_quantized_weight(value) and constant(name, value):
                continue  # rule 4: the file marks its parameters, not this scalar
            dtype = weight_dtype(tensor.dtype)
            sites.append(WeightSite(name, onnx_name_to_path(name), INITIALIZER, value, None, graph, tensor, dtype,
                                    tuple(int(d) for d in tensor.shape.numpy()),
                                    graph is main and id(value) in main_inputs))
        for node in graph:
            if node.op_type != "Constant" or len(node.outputs) != 1:
                continue
            value = node.outputs[0]
            tensor = stored_tensor(value)
            if tensor is None:
                continue
            if not is_weight(tensor, value, opsets):
                continue
            sites.append(WeightSite(value.name, onnx_name_to_path(value.name), CONSTANT, value, node, graph, tensor,
                                    weight_dtype(tensor.dtype), tuple(int(d) for d in tensor.shape.numpy()), False))
    seen: dict[str, WeightSite] = {}
    unique = []
    for site in sites:
        other = seen.get(site.path)
        if other is not None:
            if other.graph is site.graph or other.graph is main or site.graph is main:
                raise OnnxFormatError(
                    f"{source}: two weights share the name {site.name!r} (graphs {other.graph.name!r} and "
                    f"{site.graph.name!r}); ONNX names must be unique within a graph and its enclosing graphs"
                )
            # NOTE: sibling subgraphs (an If's two branches) may each hold a weight of the same
            # name: the later one's path gets a suffix, its ONNX name stays
            k = 1
            while f"{site.path}__{k}" in seen:
                k += 1
            site = WeightSite(site.name, f"{site.path}__{k}", site.kind, site.value, site.node, site.graph,
                              site.tensor, site.dtype, site.shape, site.is_graph_input)
        seen[site.path] = site
        unique.append(site)
    return unique


def tensor_data(tensor: ir.TensorProtocol, dtype: DType) -> TensorData:
    """The tensor's values as :class:`TensorData`: a zero-copy view of the memory-mapped file for
    external tensors, of the protobuf bytes otherwise."""
    from ._data_watch import check_tensor

    check_tensor(tensor)  # an external data file changed since import: named, not NaN
    try:
        array = tensor.numpy()
    except (ValueError, TypeError, AssertionError, OSError) as e:
        # NOTE (reliability fuzzing): onnx_ir reports data that does not fit the declared dims
        # or type (typed fields, external data) with numpy's or its own builtin errors.
        from ..core.errors import OnnxFormatError

        where = f" from the external data file '{tensor.path}'" if isinstance(tensor, ir.ExternalTensor) else ""
        raise OnnxFormatError(
            f"the data of tensor {tensor.name!r} ({tensor.dtype.name} {list(tensor.shape)}) cannot be read{where}: {e}"
        ) from e
    want = dtype.to_numpy()
    if array.dtype != want:
        array = array.view(want) if array.dtype.itemsize == want.itemsize else array.astype(want)
    if array.dtype.byteorder == ">":
        array = array.astype(array.dtype.newbyteorder("<"))
    return TensorData(array, dtype, tuple(array.shape))
