"""The README's Python examples are python/tests/example.py and train_example.py verbatim, and
they run."""
import os
import pathlib
import subprocess
import sys

import pytest

HERE = pathlib.Path(__file__).resolve().parent
EXAMPLE = HERE / "example.py"
README = pathlib.Path(os.environ.get("EMFLOW_SOURCE_DIR", HERE.parents[1])) / "README.md"


def test_readme_shows_the_example_verbatim():
    assert "```python\n" + EXAMPLE.read_text() + "```" in README.read_text(), (
        "README.md does not show python/tests/example.py verbatim in a ```python block; copy "
        "the file into the README's Python example")


def test_example_runs():
    done = subprocess.run([sys.executable, str(EXAMPLE)], capture_output=True, text=True,
                          check=True, timeout=300)
    lines = done.stdout.splitlines()
    # Token 1 sees tokens 0 and 1 with weights 1 / (1 + e) and e / (1 + e).
    assert lines[0] == "update: [[1.0, 0.0], [0.2689, 0.7311], [0.7881, 0.7881]]"
    assert lines[1] == "lse: [1.0, 1.3133, 2.5514]"
    start, end = eval(lines[2].split(":")[1])
    assert start > 50 and 1 <= end < 10


TRAIN_EXAMPLE = HERE / "train_example.py"


def test_readme_shows_the_training_example_verbatim():
    assert "```python\n" + TRAIN_EXAMPLE.read_text() + "```" in README.read_text(), (
        "README.md does not show python/tests/train_example.py verbatim in a ```python block")


def test_training_example_fits_the_clustering(tmp_path):
    pytest.importorskip("torch")
    svg = tmp_path / "loss.svg"
    done = subprocess.run([sys.executable, str(TRAIN_EXAMPLE), str(svg)], capture_output=True,
                          text=True, check=True, timeout=300)
    start, end = (float(v) for v in done.stdout.split(":")[1].split("->"))
    # Random clouds start about 1 from their poles (2 - 2 E|x_1| on the sphere); the fitted head
    # must bring them at least ten times closer.
    assert 0.5 < start < 1.5 and end < start / 10, done.stdout
    picture = svg.read_text()
    assert picture.startswith("<svg") and picture.count(",") >= 200
