"""The committed type stubs of the extension (python/emflow/_emflow.pyi) are what nanobind's
stubgen generates from the module as built."""
import pathlib
import subprocess
import sys

import pytest

import emflow

STUB = pathlib.Path(__file__).resolve().parents[1] / "emflow" / "_emflow.pyi"


def test_stubs_are_current(tmp_path):
    pytest.importorskip("nanobind.stubgen")
    out = tmp_path / "_emflow.pyi"
    subprocess.run([sys.executable, "-m", "nanobind.stubgen", "-q", "-m", "emflow._emflow",
                    "-o", str(out)], check=True)
    assert out.read_text() == STUB.read_text(), (
        f"{STUB} is stale: regenerate it with `python -m nanobind.stubgen -m emflow._emflow "
        f"-o {STUB}` (with the built module on PYTHONPATH)")


def test_package_is_typed():
    assert (pathlib.Path(emflow.__file__).parent / "py.typed").exists()
