"""bench/torch_cuda_sdpa.py, the GPU peers' harness, run on the CPU (--device cpu): its rows, its
check of each backend against torch's float32 math backend, and its refusals. Its GPU figures
come from scripts/device-check.sh on a machine with a GPU; this only keeps the harness working."""
import json
import os
import pathlib
import subprocess
import sys

import pytest

pytest.importorskip("torch")

ROOT = pathlib.Path(os.environ.get("EMFLOW_SOURCE_DIR", pathlib.Path(__file__).resolve().parents[2]))
SCRIPT = ROOT / "bench" / "torch_cuda_sdpa.py"


def run(*args):
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True,
                          timeout=300)


def test_rows_for_each_shape_backend_and_pass(tmp_path):
    out = tmp_path / "torch.json"
    done = run("--device", "cpu", "--tokens", "96", "--dim", "32", "--mask", "both",
               "--backends", "flash", "cudnn", "--repeats", "2", "--out", str(out))
    assert done.returncode == 0, done.stderr
    report = json.loads(out.read_text())
    assert not (tmp_path / "torch.json.part").exists()
    rows = {row["name"]: row for row in report["benchmarks"]}
    # 2 masks x 2 backends x (forward, backward)
    assert len(rows) == 8
    for causal in (0, 1):
        label = f"N:96/d:32/causal:{causal}"
        batch = 16384 // 96
        flop = 4.0 * batch * 96 * 96 * 32 * (0.5 if causal else 1.0)
        for name, work in ((f"BM_TorchSdpa_flash/{label}", flop),
                           (f"BM_TorchSdpaBackward_flash/{label}", 2.5 * flop)):
            row = rows[name]
            assert row["real_time"] > 0 and row["time_unit"] == "ms"
            assert row["TFLOP/s"] == pytest.approx(work / (row["real_time"] * 1e-3) * 1e-12)
            assert row["B"] == batch
            # The flash kernel agrees with the float32 math backend to bf16 roundings, and the
            # comparison is real: not exactly zero for bf16 outputs against float32 ones.
            assert 0 < row["max_relative_error"] < 3e-2
        # No cuDNN on the CPU: a row with the reason, as Google Benchmark writes a skipped run.
        for name in (f"BM_TorchSdpa_cudnn/{label}", f"BM_TorchSdpaBackward_cudnn/{label}"):
            assert rows[name]["error_occurred"] is True
            assert "torch cudnn" in rows[name]["error_message"]


def test_without_a_gpu_it_says_so_and_writes_nothing(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is visible to torch here")
    out = tmp_path / "torch.json"
    done = run("--tokens", "64", "--out", str(out))
    assert done.returncode == 2
    assert "no CUDA device visible to torch" in done.stderr
    assert not out.exists()


@pytest.mark.parametrize("args, message", [
    (["--tokens", "0"], "--tokens: expected positive integers, got [0]"),
    (["--dim", "-4"], "--dim: expected positive integers, got [-4]"),
    (["--repeats", "0"], "--repeats: expected at least 1, got 0"),
    (["--backends", "xformers"], "invalid choice: 'xformers'"),
])
def test_bad_arguments_are_named(args, message):
    done = run("--device", "cpu", *args)
    assert done.returncode == 2
    assert message in done.stderr
