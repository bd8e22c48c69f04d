"""The package as users import it: its version, its device choice, its errors."""

import pathlib
import re

import pytest
import torch

import torchtools


def test_the_version_is_the_crates():
    cargo = pathlib.Path(__file__).resolve().parents[3] / "Cargo.toml"
    version = re.search(r'^version = "([^"]+)"', cargo.read_text(), re.M).group(1)
    assert torchtools.__version__ == version


def test_device_from_env_follows_the_variable(monkeypatch):
    monkeypatch.setenv("TORCHTOOLS_DEVICE", "cpu")
    assert torchtools.get_device_from_env() == torch.device("cpu")
    monkeypatch.setenv("TORCHTOOLS_DEVICE", "auto")
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert torchtools.get_device_from_env().type == expected


def test_a_bad_variable_is_an_error_naming_it(monkeypatch):
    monkeypatch.setenv("TORCHTOOLS_DEVICE", "gpu please")
    with pytest.raises(torchtools.TorchtoolsError, match="TORCHTOOLS_DEVICE"):
        torchtools.get_device_from_env()
    # Ours are RuntimeErrors, as torch's own are.
    assert issubclass(torchtools.TorchtoolsError, RuntimeError)


def test_cuda_is_chosen_where_there_is_cuda_and_refused_elsewhere(monkeypatch):
    monkeypatch.setenv("TORCHTOOLS_DEVICE", "cuda")
    if torch.cuda.is_available():
        assert torchtools.get_device_from_env().type == "cuda"
    else:
        with pytest.raises(torchtools.TorchtoolsError, match="CUDA"):
            torchtools.get_device_from_env()


def test_the_type_stubs_match_the_native_module():
    """`_native.pyi` is written by hand: every name, class, method and property it
    declares exists in the extension, and every public name of the extension is
    declared (a renamed or missing function fails here, not in a user's type check)."""
    import ast
    import inspect
    import os

    from torchtools import _native

    stub = os.path.join(os.path.dirname(_native.__file__), "_native.pyi")
    if not os.path.exists(stub):  # the source tree's, beside an installed wheel's
        stub = os.path.join(os.path.dirname(__file__), "..", "python", "torchtools", "_native.pyi")
    tree = ast.parse(open(stub).read())
    declared = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            declared[node.name] = node
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            declared[node.target.id] = node
    public = {n for n in dir(_native) if not n.startswith("_")} | {"__version__"}
    assert sorted(set(declared) - public) == [], "declared in the stubs, missing in the module"
    assert sorted(public - set(declared)) == [], "in the module, missing from the stubs"
    for name, node in declared.items():
        if not isinstance(node, ast.ClassDef):
            continue
        cls = getattr(_native, name)
        members = [m.name for m in node.body if isinstance(m, ast.FunctionDef)]
        missing = [m for m in members if m != "__init__" and not hasattr(cls, m)]
        assert missing == [], f"{name}: {missing} declared but not in the class"
        bases = [ast.unparse(b) for b in node.bases]
        assert [b.__name__ for b in cls.__bases__] == bases or not bases, (name, bases, cls.__bases__)
        assert inspect.isclass(cls)
