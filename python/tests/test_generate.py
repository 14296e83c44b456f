"""emflow.DecodingStack and emflow.generate against the stack applied to the whole grown cloud
(emflow.attend on the reference, layer by layer, under the causal mask), and against the tool's
``emflow flow --generate``."""
import os
import subprocess

import numpy as np
import pytest

import emflow


def rmsnorm(x, eps=1e-5):
    return x / np.sqrt((x.astype(np.float64) ** 2).mean(axis=-1, keepdims=True) + eps)


def whole_cloud(x, m, f, beta, pre_norm):
    """Each layer on the whole cloud at once: the outputs of the last layer."""
    for layer in range(m.shape[0]):
        attended = rmsnorm(x).astype(np.float32) if pre_norm else x
        update = emflow.attend(attended, m[layer], f[layer], beta=beta, mask="causal",
                               device="reference")
        x = x + update
        if not pre_norm:
            x = rmsnorm(x).astype(np.float32)
    return x


@pytest.mark.parametrize("pre_norm", [False, True])
def test_forward_is_the_stack_on_the_grown_cloud(pre_norm):
    rng = np.random.default_rng(3)
    L, H, d, n = 3, 2, 5, 11
    m = (rng.standard_normal((L, H, d, d)) / d).astype(np.float32)
    f = (rng.standard_normal((L, H, d, d)) / d).astype(np.float32)
    cloud = rng.standard_normal((n, d)).astype(np.float32)
    stack = emflow.DecodingStack(d, layers=L, relevance=m, content=f, beta=1.5, norm="rmsnorm",
                                 pre_norm=pre_norm)
    prompt = stack.forward(cloud[:7])
    steps = [stack.forward(cloud[t], trace=True) for t in range(7, n)]
    assert stack.size == n and stack.layers == L and stack.dim == d
    expected = whole_cloud(cloud, m, f, 1.5, pre_norm)
    np.testing.assert_allclose(prompt, expected[:7], rtol=2e-5, atol=2e-6)
    for t, step in enumerate(steps):
        np.testing.assert_allclose(step.tokens, expected[7 + t], rtol=2e-5, atol=2e-6)
        np.testing.assert_array_equal(step.paths[0, 0], cloud[7 + t])  # the input of layer 0
        np.testing.assert_array_equal(step.paths[0, -1], step.tokens)
        assert step.entropy.shape == (1, L) and np.all(step.entropy > 0)
    stack.clear()
    assert stack.size == 0


def test_generate_feeds_each_last_output_back():
    rng = np.random.default_rng(5)
    prompts = rng.standard_normal((2, 6, 4)).astype(np.float32)
    g = emflow.generate(prompts, 5, layers=2, beta=[0.5, 2.0], relevance="random",
                        content="random", seed=7, norm="sphere")
    assert g.paths.shape == (2, 5, 3, 4) and g.entropy.shape == (2, 5, 2)
    assert g.seconds.shape == (5,)
    for b, beta in enumerate([0.5, 2.0]):
        stack = emflow.DecodingStack(4, layers=2, relevance="random", content="random", seed=7,
                                     norm="sphere", beta=beta)
        token = stack.forward(prompts[b])[-1]
        for t in range(5):
            step = stack.forward(token, trace=True)
            np.testing.assert_array_equal(g.paths[b, t], step.paths[0])
            np.testing.assert_array_equal(g.entropy[b, t], step.entropy[0])
            token = step.tokens
    single = emflow.generate(prompts[0], 3, layers=2, relevance="random", content="random",
                             seed=7, norm="sphere", beta=0.5)
    assert single.paths.shape == (3, 3, 4)
    np.testing.assert_array_equal(single.paths, g.paths[0, :3])


def test_generate_is_the_tool_s_generation(tmp_path):
    cli = os.environ.get("EMFLOW_CLI")
    if not cli:
        pytest.skip("the emflow tool is not built (EMFLOW_CLI unset)")
    prompt = np.random.default_rng(1).standard_normal((8, 3)).astype(np.float32)
    np.save(tmp_path / "x.npy", prompt)
    subprocess.run([cli, "flow", "--x", str(tmp_path / "x.npy"), "--layers", "3", "--m",
                    "random", "--f", "random", "--seed", "4", "--norm", "layernorm",
                    "--pre-norm", "--beta", "2", "--generate", "6", "--device", "cpu", "--out",
                    str(tmp_path / "paths.npy")], check=True, capture_output=True)
    g = emflow.generate(prompt, 6, layers=3, relevance="random", content="random", seed=4,
                        norm="layernorm", pre_norm=True, beta=2.0)
    np.testing.assert_array_equal(np.load(tmp_path / "paths.npy"), g.paths)


def test_refusals_name_the_argument():
    with pytest.raises(ValueError, match="argument 'layers' must be >= 1"):
        emflow.DecodingStack(3, layers=0)
    with pytest.raises(ValueError, match="argument 'norm_eps'"):
        emflow.DecodingStack(3, norm_eps=0.0)
    stack = emflow.DecodingStack(3)
    with pytest.raises(ValueError, match="argument 'tokens' has shape \\(2, 4\\)"):
        stack.forward(np.zeros((2, 4)))
    with pytest.raises(ValueError, match="argument 'steps' must be >= 0"):
        emflow.generate(np.zeros((4, 3)), -1)
    with pytest.raises(ValueError, match="argument 'betas'"):
        emflow.generate(np.zeros((2, 4, 3)), 1, beta=[1.0, 2.0, 3.0])
    # 10^12 steps: refused with the bytes before anything is allocated.
    with pytest.raises(MemoryError, match="bytes of memory available"):
        emflow.generate(np.zeros((4, 3)), 10**12)
