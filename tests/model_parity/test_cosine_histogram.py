"""`emflow flow --model --cosine-histogram P.png --cosine-counts C.npy` and the effective rank
of --metrics, numpy only: on small hand-made llama (causal, rotary, RMSNorm) and BERT
checkpoints, the counts equal a histogram of the recorded clouds' pairwise cosines computed here,
the effective rank equals the one of their singular values, and the pictures are PNGs of the
size the heat map draws.
"""
import struct

import numpy as np
import pytest
from emflow_cli import run

from test_convert_errors import (D, LAYERS, bert_config, bert_tensors, llama_config,
                                 llama_tensors, make_model)

BINS = 40
PNG = b"\x89PNG\r\n\x1a\n"


def png_size(path):
    """(width, height) from a PNG's IHDR chunk, after checking the signature."""
    data = path.read_bytes()
    assert data[:8] == PNG and data[12:16] == b"IHDR", path
    return struct.unpack(">II", data[16:24])


def unit(x):
    n = np.linalg.norm(x, axis=-1, keepdims=True)
    return x / np.where(n > 0, n, 1)


def histogram(cloud):
    u = unit(cloud)
    c = (u @ u.T)[np.triu_indices(len(u), k=1)]
    k = np.clip(np.floor((c + 1) / 2 * BINS), 0, BINS - 1).astype(np.int64)
    return np.bincount(k, minlength=BINS)


def effective_rank(cloud):
    s = np.linalg.svd(unit(cloud), compute_uv=False)
    p = s / s.sum()
    p = p[p > 0]
    return float(np.exp(-(p * np.log(p)).sum()))


def metrics(path):
    lines = path.read_text().splitlines()
    header = lines[0].split(",")
    return [dict(zip(header, line.split(","))) for line in lines[1:]]


def converted(tmp_path, layout):
    if layout == "llama":
        model = make_model(tmp_path / "model", llama_tensors(), llama_config())
    else:
        model = make_model(tmp_path / "model", bert_tensors(), bert_config())
    run("convert", model, "--out", tmp_path / "ops")
    return tmp_path / "ops"


@pytest.mark.parametrize("layout", ["llama", "bert"])
@pytest.mark.parametrize("layers", ["--full-layer", "--attention-only"])
def test_counts_and_effective_rank_equal_a_direct_computation(tmp_path, layout, layers):
    ops = converted(tmp_path, layout)
    x = np.random.default_rng(5).normal(size=(2, 7, D))
    x[0, 0] *= 50  # one token far longer than the rest: only its direction counts
    lengths = np.array([7, 4], dtype=np.int64)
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "k.npy", lengths)
    (tmp_path / "labels.txt").write_text("".join(f"t{i}\n" for i in range(7)))
    run("flow", "--model", ops, "--cloud", tmp_path / "x.npy", "--key-lengths", tmp_path / "k.npy",
        "--labels", tmp_path / "labels.txt", layers, "--out", tmp_path / "traj.npy", "--metrics",
        tmp_path / "m.csv", "--plot", tmp_path / "p.png", "--cosine-histogram",
        tmp_path / "h.png", "--cosine-counts", tmp_path / "c.npy")
    traj, counts = np.load(tmp_path / "traj.npy"), np.load(tmp_path / "c.npy")
    assert counts.dtype == np.int64 and counts.shape == (LAYERS + 1, 2, BINS)
    rows = metrics(tmp_path / "m.csv")
    assert len(rows) == (LAYERS + 1) * 2
    for r in range(LAYERS + 1):
        for b, n in enumerate(lengths):
            cloud = traj[r, b, :n]  # the real tokens only
            np.testing.assert_array_equal(counts[r, b], histogram(cloud))
            assert counts[r, b].sum() == n * (n - 1) // 2
            row = rows[r * 2 + b]
            assert (int(row["layer"]), int(row["cloud"])) == (r, b)
            assert float(row["effective_rank"]) == pytest.approx(effective_rank(cloud), rel=1e-7)
    width, height = png_size(tmp_path / "h.png")
    assert width == 900 and height == 60 * (LAYERS + 1) + 150  # rows of 60 pixels at most
    assert png_size(tmp_path / "p.png")[0] > 0


def test_a_cloud_of_one_direction_stays_in_the_last_bin_with_rank_one(tmp_path):
    """Identical tokens stay identical through a causal llama layer (each attends to copies of
    itself): every pair has cosine 1 and the directions have effective rank 1, layer by layer."""
    ops = converted(tmp_path, "llama")
    np.save(tmp_path / "x.npy", np.tile(np.random.default_rng(6).normal(size=D), (5, 1)))
    run("flow", "--model", ops, "--cloud", tmp_path / "x.npy", "--metrics", tmp_path / "m.csv",
        "--cosine-counts", tmp_path / "c.npy")
    counts = np.load(tmp_path / "c.npy")
    assert (counts[:, 0, BINS - 1] == 10).all() and counts[:, 0, :BINS - 1].sum() == 0
    for row in metrics(tmp_path / "m.csv"):
        assert float(row["effective_rank"]) == pytest.approx(1.0, abs=1e-6)


def test_errors_leave_no_picture(tmp_path):
    ops = converted(tmp_path, "llama")
    np.save(tmp_path / "x.npy", np.random.default_rng(8).normal(size=(4, D)))
    (tmp_path / "three.txt").write_text("a\nb\nc\n")
    result = run("flow", "--model", ops, "--cloud", tmp_path / "x.npy", "--labels",
                 tmp_path / "three.txt", "--cosine-histogram", tmp_path / "h.png",
                 "--cosine-counts", tmp_path / "c.npy", ok=False)
    assert result.returncode == 1 and "holds 3 lines" in result.stderr, result.stderr
    assert not (tmp_path / "h.png").exists() and not (tmp_path / "c.npy").exists()
    result = run("flow", "--model", ops, "--cloud", tmp_path / "x.npy", "--cosine-counts",
                 tmp_path / "x.npy", ok=False)
    assert result.returncode == 1, result.stderr
    assert f"--cosine-counts '{tmp_path / 'x.npy'}' is the input file of" in result.stderr
    result = run("flow", "--cosine-histogram", tmp_path / "h.png", ok=False)
    assert result.returncode != 0 and "--cosine-histogram requires --model" in result.stderr, \
        result.stderr
    assert not (tmp_path / "h.png").exists()
