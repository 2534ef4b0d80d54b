"""The wheel's package list and data: every subpackage listed, the model data mapped and found."""

from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def setuptools_config():
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def test_pyproject_lists_every_onnxparam_subpackage(setuptools_config):
    listed = set(setuptools_config["packages"])
    on_disk = {
        ".".join(d.relative_to(ROOT).parts)
        for d in [ROOT / "onnxparam", *(ROOT / "onnxparam").rglob("*")]
        if d.is_dir() and d.name != "__pycache__" and any(d.glob("*.py"))
    }
    missing = sorted(on_disk - listed)
    assert not missing, f"add {missing} to [tool.setuptools] packages in pyproject.toml, or the wheel lacks them"


def test_model_data_is_packaged_as_onnxparam_models(setuptools_config):
    assert setuptools_config["package-dir"]["onnxparam._models"] == "models"
    data = setuptools_config["package-data"]
    for package, patterns in data.items():
        if not package.startswith("onnxparam._models"):
            continue
        folder = ROOT / "models" / Path(*package.split(".")[2:])
        for pattern in patterns:
            assert list(folder.glob(pattern)), f"{package}: {pattern} matches no file in {folder}"
    assert "*.bpk" in data["onnxparam._models.mnist"] and "*.npz" in data["onnxparam._models.mnist"]


def test_zoo_finds_the_data_through_importlib_resources():
    from onnxparam.zoo import mnist

    assert mnist.weights_path().samefile(ROOT / "models" / "mnist" / "model.bpk")
    assert mnist.digits_path().samefile(ROOT / "models" / "mnist" / "digits28.npz")
