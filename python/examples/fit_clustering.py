"""Fit the operators M and F of one EMF layer by gradient descent, so that the flow of random
token clouds on the sphere (docs/MATH.md §4.2, §4.3: SA, Euler steps projected on the sphere)
reaches a target clustering: every token ends at +e_1 or -e_1, by the sign of its first
coordinate at the start. With M = F = I (the start) the flow pulls each cloud towards a single
cluster; the gradient (emflow.torch.attend's backward, docs/MATH.md §8.4) separates the two.

Run: python python/examples/fit_clustering.py [steps]   (prints the loss as it falls, and
how many tokens reach their target)
"""
import sys

import torch

import emflow.torch


def flow(x, m, f, beta=2.0, time=2.0, step=0.25):
    """Euler steps of dx_i/dt = P_x_i (sum_j p_ij F x_j), each ending on the unit sphere."""
    for _ in range(round(time / step)):
        delta = emflow.torch.attend(x, m, f, beta=beta)
        tangent = delta - (delta * x).sum(-1, keepdim=True) * x
        x = torch.nn.functional.normalize(x + step * tangent, dim=-1)
    return x


def fit(steps=30, clouds=4, tokens=12, dim=3, seed=0, verbose=True):
    gen = torch.Generator().manual_seed(seed)
    x0 = torch.nn.functional.normalize(torch.randn(clouds, tokens, dim, generator=gen,
                                                   dtype=torch.float64), dim=-1)
    target = torch.zeros_like(x0)
    target[..., 0] = torch.where(x0[..., 0] >= 0, 1.0, -1.0)
    m = torch.eye(dim, dtype=torch.float64).requires_grad_(True)
    f = torch.eye(dim, dtype=torch.float64).requires_grad_(True)
    optimizer = torch.optim.Adam([m, f], lr=0.05)
    losses = []
    for i in range(steps):
        optimizer.zero_grad()
        # 1 - cos(angle to the target), averaged over the tokens
        loss = (1 - (flow(x0, m, f) * target).sum(-1)).mean()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        if verbose and (i % 5 == 0 or i == steps - 1):
            bar = "#" * round(40 * losses[-1] / losses[0])
            print(f"step {i:3d}  loss {losses[-1]:.4f}  {bar}")
    with torch.no_grad():
        reached = (flow(x0, m, f) * target).sum(-1)  # cos(angle to the target) per token
    if verbose:
        print(f"tokens within 30 degrees of their target: {(reached > 0.866).float().mean():.0%}")
    return losses, reached


if __name__ == "__main__":
    fit(int(sys.argv[1]) if len(sys.argv) > 1 else 30)
