"""Real public models: import -> run through the module -> export -> run the export in plain ONNX
Runtime, against plain ONNX Runtime on the original file and the outputs shipped with the model.

Models: ``tests/data/onnx/`` (Magika, PP-OCR; provenance in its README) and the architectures
the installed ``onnx`` package ships under ``onnx/backend/test/data/`` (``light/``: nine ImageNet
CNNs; ``pytorch-converted/``: 82 single-layer models with inputs and expected outputs; ``real/``
only holds download links, so it is not used). A sample runs by default; every model runs with
``-m slow``.

Oracles: ONNX Runtime on the original file (outputs of the exported file must be bit-identical:
the graph is the same), the expected outputs stored beside the model, and the original file's
weights (names and bytes) for the exported file's initializers. Opset-6 models whose old
kernels ONNX Runtime no longer has are skipped: the original cannot run, and neither can an
import that keeps its graph as it is.
"""

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import numpy_helper

from onnxparam import Tensor
from onnxparam.onnx_io import export_onnx, import_onnx, read_onnx_record

DATA = Path(__file__).parent / "data" / "onnx"
BACKEND = Path(onnx.__file__).parent / "backend" / "test" / "data"


def _cases() -> dict:
    """name -> (model path, input arrays or None for generated ones, expected output paths)."""
    cases = {
        "magika": (DATA / "magika_standard_v3_3.onnx", None, []),
        "ppocr_v4_det": (DATA / "ppocr_v4_det.onnx", None, []),
        "ppocr_mobile_v2_cls": (DATA / "ppocr_mobile_v2_cls.onnx", None, []),
    }
    for path in sorted(BACKEND.glob("light/*.onnx")):
        cases[path.stem] = (path, None, [path.with_name(path.stem + "_output_0.pb")])
    for folder in sorted(BACKEND.glob("pytorch-converted/*")):
        data = folder / "test_data_set_0"
        cases["pytorch_" + folder.name[len("test_"):]] = (
            folder / "model.onnx", sorted(data.glob("input_*.pb")), sorted(data.glob("output_*.pb")))
    return cases


CASES = _cases()
SAMPLE = ["magika", "ppocr_v4_det", "ppocr_mobile_v2_cls", "light_squeezenet", "light_inception_v1",
          "light_bvlc_alexnet", "light_zfnet512", "light_resnet50",
          "pytorch_Conv2d_depthwise_padded", "pytorch_ConvTranspose2d", "pytorch_Embedding", "pytorch_Linear_no_bias",
          "pytorch_MaxPool2d_stride_padding_dilation", "pytorch_PixelShuffle", "pytorch_Softplus"]


def _session(model):
    options = ort.SessionOptions()
    options.log_severity_level = 3
    return ort.InferenceSession(str(model), options, providers=["CPUExecutionProvider"])


def _inputs(name: str, session) -> dict:
    path, input_files, _ = CASES[name]
    if input_files:
        arrays = [numpy_helper.to_array(onnx.load_tensor(str(p))) for p in input_files]
        return {i.name: a for i, a in zip(session.get_inputs(), arrays)}
    rng = np.random.default_rng(0)
    feeds = {}
    for i in session.get_inputs():
        if name == "magika":
            feeds[i.name] = rng.integers(0, 257, size=(2, 2048)).astype(np.int32)
        elif name == "ppocr_v4_det":
            feeds[i.name] = rng.normal(size=(1, 3, 64, 96)).astype(np.float32)
        elif name == "ppocr_mobile_v2_cls":
            feeds[i.name] = rng.normal(size=(2, 3, 48, 192)).astype(np.float32)
        else:
            feeds[i.name] = rng.random(size=i.shape).astype(np.float32)
    return feeds


def _opset(path) -> int:
    model = onnx.load(str(path), load_external_data=False)
    return next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))


def check_weights_survive_import(name: str) -> None:
    path = CASES[name][0]
    record = read_onnx_record(path)
    module = import_onnx(path)
    params = dict(module.named_params())
    assert list(params) == list(record)
    for key, snap in record.items():
        param = params[key]
        assert param.shape == snap.shape and param.dtype == snap.dtype
        assert module.onnx_names[key] in _weight_names(path)
    assert not any(p.is_initialized() for p in params.values())


def _weight_names(path) -> set:
    model = onnx.load(str(path), load_external_data=False)
    names = {i.name for i in model.graph.initializer}
    names |= {n.output[0] for n in model.graph.node if n.op_type == "Constant"}
    return names


def check_round_trip(name: str, tmp_path: Path) -> None:
    path, _, expected_files = CASES[name]
    try:
        session = _session(path)
    except Exception as e:  # noqa: BLE001 - e.g. "Could not find an implementation for Gemm(6)"
        pytest.skip(f"plain ONNX Runtime cannot run the original: {str(e)[:150]}")
    feeds = _inputs(name, session)
    reference = session.run(None, feeds)
    module = import_onnx(path)
    outputs = module(*[Tensor.from_numpy(feeds[n]) for n in module.input_names])
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    for got, want in zip(outputs, reference, strict=True):
        np.testing.assert_allclose(got.to_numpy(), want, rtol=1e-5, atol=1e-6)
    for file, got in zip(expected_files, outputs):
        expected = numpy_helper.to_array(onnx.load_tensor(str(file)))
        np.testing.assert_allclose(got.to_numpy(), expected, rtol=1e-3, atol=1e-5)

    exported = export_onnx(module, tmp_path / "exported.onnx")
    onnx.checker.check_model(str(exported), full_check=True)
    original, written = onnx.load(str(path)), onnx.load(str(exported))
    assert [i.name for i in written.graph.input if i.name in feeds] == list(module.input_names)
    assert [o.name for o in written.graph.output] == [o.name for o in original.graph.output]
    for got, want in zip(_session(exported).run(None, feeds), reference, strict=True):
        np.testing.assert_array_equal(got, want)
    # the export holds the original weights, by their original names, byte for byte
    source, target = read_onnx_record(path), read_onnx_record(exported)
    assert set(source) <= set(target)
    for key, snap in source.items():
        assert target[key].dtype == snap.dtype
        np.testing.assert_array_equal(target[key].to_data().to_numpy(), snap.to_data().to_numpy())
    # the graph that came in goes out: the same nodes in the same order, weights where they were
    weight_names = {module.onnx_names[k] for k in source}
    assert weight_names <= _weight_names(exported)
    assert [(n.op_type, n.name, list(n.output)) for n in written.graph.node] == \
        [(n.op_type, n.name, list(n.output)) for n in original.graph.node]


@pytest.mark.parametrize("name", SAMPLE)
def test_real_model_weights_import_as_lazy_params_named_after_the_file(name):
    check_weights_survive_import(name)


# NOTE: light_zfnet512's round trip (its ops a subset of light_bvlc_alexnet's, same opset and
# layout) runs with -m slow only (here and in test_every_shipped_model_round_trips): ~5 s of the
# default suite for no path alexnet's does not take. Its weights still import in the default run.
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n == "light_zfnet512" else n
                                  for n in SAMPLE])
def test_real_model_runs_exports_and_reruns_as_the_original(name, tmp_path):
    check_round_trip(name, tmp_path)


@pytest.mark.slow
def test_every_shipped_model_round_trips(request, tmp_path):
    failures = []
    for name in CASES:
        folder = tmp_path / name
        folder.mkdir()
        try:
            check_weights_survive_import(name)
            check_round_trip(name, folder)
        except pytest.skip.Exception:
            continue
        except Exception as e:  # noqa: BLE001 - collect every model's problem
            failures.append(f"{name}: {type(e).__name__}: {str(e)[:300]}")
    assert not failures, "\n".join(failures)
