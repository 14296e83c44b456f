# Three tokens in the plane and one head whose relevance M and content F are the identity, under
# a causal mask: each token's update is the softmax-weighted mean of itself and the tokens before
# it, weighted by exp(x_i . x_j). Then 64 tokens on the sphere flow into clusters.
import numpy as np

import emflow

x = np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]], dtype=np.float32)
identity = np.eye(2, dtype=np.float32)
result = emflow.attend(x, identity, identity, mask="causal", lse=True)
print("update:", result.update.astype(float).round(4).tolist())
print("lse:", result.lse.astype(float).round(4).tolist())

# The same update from the double-precision reference.
update, lse, entropy, _ = emflow.reference.attend(x, identity, identity, mask="causal")
assert np.allclose(result.update, update, atol=1e-6)

cloud = emflow.initial_clouds("sphere", batch=1, tokens=64, dim=3, seed=0)
run = emflow.flow(cloud, beta=4.0, norm="sphere", time=20.0, dt=0.1)
print("clusters at t = 0 and t = 20:", run.observables["clusters"][[0, -1], 0].tolist())
