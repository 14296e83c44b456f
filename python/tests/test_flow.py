"""emflow.flow, emflow.phase and emflow.io against direct computations."""
import io

import numpy as np
import pytest

import emflow


def test_euler_flow_is_the_reference_update_stepped():
    x0 = emflow.initial_clouds("gaussian", batch=2, tokens=6, dim=3, seed=4)
    assert x0.shape == (2, 6, 3) and x0.dtype == np.float64
    calls = []
    run = emflow.flow(x0, beta=[1.0, 2.0], time=0.3, dt=0.1, integrator="euler", device="cpu",
                      callback=lambda done, total: calls.append((done, total)))
    assert calls == [(1, 3), (2, 3), (3, 3)]
    assert run.trajectory.shape == (4, 2, 6, 3)
    np.testing.assert_allclose(run.times, [0, 0.1, 0.2, 0.3], atol=1e-12)
    np.testing.assert_array_equal(run.steps, [0, 1, 2, 3])
    eye = np.eye(3)
    for b, beta in enumerate([1.0, 2.0]):
        x = x0[b]
        for r in range(1, 4):
            x = x + 0.1 * emflow.reference.attend(x[None], eye, eye, beta=beta)[0][0]
            np.testing.assert_allclose(run.trajectory[r, b], x, rtol=1e-12, atol=1e-12)
    # Observables of each record (docs/MATH.md §5), computed here from the trajectory.
    obs = run.observables
    for r in range(4):
        for b, beta in enumerate([1.0, 2.0]):
            x = run.trajectory[r, b]
            g = x @ x.T
            i, j = np.triu_indices(6, 1)
            assert obs["min_inner"][r, b] == pytest.approx(g[i, j].min(), rel=1e-12)
            assert obs["mean_inner"][r, b] == pytest.approx(g[i, j].mean(), rel=1e-12)
            energy = np.exp(beta * g).sum() / (2 * beta * 36)
            assert obs["energy"][r, b] == pytest.approx(energy, rel=1e-12)
            dist = np.linalg.norm(x[:, None] - x[None], axis=-1).max()
            assert obs["diameter"][r, b] == pytest.approx(dist, rel=1e-12)
    assert obs["clusters"].dtype == np.int64 and np.all(obs["entropy"] > 0)


def test_discrete_stack_on_the_sphere_keeps_unit_norms():
    x0 = emflow.initial_clouds("sphere", batch=1, tokens=16, dim=4, seed=1, dtype=np.float32)
    run = emflow.flow(x0, layers=5, norm="sphere", relevance="random", content="identity",
                      beta=3.0, seed=9)
    assert run.trajectory.dtype == np.float32 and run.trajectory.shape == (6, 1, 16, 4)
    np.testing.assert_allclose(np.linalg.norm(run.trajectory, axis=-1), 1.0, atol=1e-5)
    assert not np.allclose(run.trajectory[0], run.trajectory[-1])


def test_flow_with_tqdm():
    tqdm = pytest.importorskip("tqdm")
    with tqdm.tqdm(total=20, file=io.StringIO()) as bar:
        emflow.flow(np.eye(3)[None] + 0.1, time=2.0, dt=0.1,
                    callback=lambda done, total: bar.update(done - bar.n))
        assert bar.n == 20


def test_flow_refuses_bad_settings():
    with pytest.raises(ValueError, match="integrator"):
        emflow.flow(np.ones((1, 3, 2)), integrator="leapfrog")
    with pytest.raises(ValueError, match="relevance"):
        emflow.flow(np.ones((1, 3, 2)), relevance=np.eye(3))


def test_callback_exception_stops_the_run():
    def stop(done, total):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        emflow.flow(np.ones((1, 3, 2)), time=1.0, dt=0.1, callback=stop)


def test_phase_diagram_agrees_with_its_generic_path():
    settings = dict(tokens=8, dim=2, beta_start=0.5, beta_stop=4.0, beta_count=3, time=1.0,
                    dt=0.1, clouds=16, seed=3, device="cpu")
    calls = []
    fast = emflow.phase(**settings, callback=lambda done, total: calls.append((done, total)))
    generic = emflow.phase(**settings, generic=True)
    assert fast.clustered.shape == (11, 3) and calls[-1][0] == calls[-1][1]
    np.testing.assert_allclose(fast.betas, [0.5, 2.25, 4.0])
    np.testing.assert_allclose(fast.times, np.arange(11) * 0.1, atol=1e-12)
    # Same clouds for every beta: the same fraction at t = 0; clustering grows with time.
    assert np.all(fast.clustered[0] == fast.clustered[0, 0])
    assert np.all(fast.clustered[-1] >= fast.clustered[0]) and fast.clustered[-1, -1] > 0
    np.testing.assert_allclose(fast.clustered, generic.clustered, atol=2 / (16 * 28))


def test_npy_round_trip(tmp_path):
    for array in (np.arange(24, dtype=np.float32).reshape(2, 3, 4), np.linspace(0, 1, 5),
                  np.arange(6, dtype=np.int64).reshape(3, 2)):
        path = tmp_path / f"a_{array.dtype}.npy"
        emflow.io.write_npy(path, array)
        np.testing.assert_array_equal(np.load(path), array)
        back = emflow.io.read_npy(str(path))
        assert back.dtype == array.dtype
        np.testing.assert_array_equal(back, array)
    np.save(tmp_path / "f.npy", np.asfortranarray(np.ones((2, 3))))
    with pytest.raises(RuntimeError, match="f.npy"):
        emflow.io.read_npy(tmp_path / "f.npy")
    with pytest.raises(RuntimeError, match="missing.npy"):
        emflow.io.read_npy(tmp_path / "missing.npy")
