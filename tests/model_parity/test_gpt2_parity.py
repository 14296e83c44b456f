"""The GPT-2 layout (fused c_attn, Conv1D weights stored (in, out), pre-norm, ln_f, causal
mask): a small randomly initialised GPT2Model built by transformers from a config and saved as
safetensors, converted by `emflow convert` and run by `emflow flow --model` on a right-padded
batch, equals the framework's attention outputs and hidden states layer by layer.
"""
import numpy as np
import pytest
from emflow_cli import relative_error, run

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

LAYERS = 3


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
    torch.manual_seed(7)
    # A larger initializer range than GPT-2's 0.02, so that attention is far from uniform.
    config = transformers.GPT2Config(n_layer=LAYERS, n_head=4, n_embd=64, n_positions=32,
                                     vocab_size=97, initializer_range=0.2, bos_token_id=0,
                                     eos_token_id=0,
                                     attn_implementation="eager")
    model = transformers.GPT2Model(config).eval()
    folder = tmp_path_factory.mktemp("gpt2")
    model.save_pretrained(folder / "model", safe_serialization=True)
    ops = folder / "ops"
    out = run("convert", str(folder / "model"), "--out", str(ops), "--report").stdout
    assert "gpt2" in out and (ops / "spectrum.csv").exists()
    return model, ops


@pytest.mark.parametrize("precision", ["float64", "float32"])
def test_gpt2_layers_match_the_framework(gpt2, tmp_path, precision):
    model, ops = gpt2
    dtype = torch.float64 if precision == "float64" else torch.float32
    model = model.to(dtype)
    generator = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 97, (3, 12), generator=generator)
    lengths = np.array([12, 7, 9], dtype=np.int64)
    mask = (torch.arange(12)[None, :] < torch.from_numpy(lengths)[:, None]).long()
    captured = []
    hooks = [block.attn.c_proj.register_forward_hook(
        lambda module, inputs, output: captured.append(output.detach().numpy().copy()))
        for block in model.h]
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
    for hook in hooks:
        hook.remove()
    hidden = [h.numpy() for h in out.hidden_states]
    np.save(tmp_path / "x.npy", hidden[0])
    np.save(tmp_path / "k.npy", lengths)
    run("flow", "--model", str(ops), "--cloud", str(tmp_path / "x.npy"), "--key-lengths",
        str(tmp_path / "k.npy"), "--device", "cpu", "--out", str(tmp_path / "traj.npy"),
        "--attention-out", str(tmp_path / "att.npy"))
    traj, att = np.load(tmp_path / "traj.npy"), np.load(tmp_path / "att.npy")
    tol = 1e-12 if precision == "float64" else 3e-6
    for layer in range(LAYERS):
        errors = [relative_error(att[layer], captured[layer], lengths),
                  relative_error(traj[layer + 1], hidden[layer + 1], lengths)]
        print(f"gpt2 {precision} layer {layer}: attention rel err {errors[0]:.3e}, "
              f"hidden state rel err {errors[1]:.3e}")
        assert errors[0] < tol and errors[1] < 10 * tol, (layer, errors)
