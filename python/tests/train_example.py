# Training through emflow: fit the relevance M and the content F of one attention head so that
# six steps of the flow x <- normalize(x + dt Delta(x)) carry random clouds on the sphere to a
# target clustering, every token to the pole +e1 or -e1 of the side it starts on. The gradients
# are emflow's backward pass (emflow.torch under torch autograd); the loss curve is drawn into
# train_loss.svg (or the file named on the command line).
import sys

import torch

import emflow
import emflow.torch

clouds = torch.from_numpy(emflow.initial_clouds("sphere", batch=16, tokens=32, dim=3, seed=1))
poles = torch.zeros_like(clouds)
poles[..., 0] = torch.sign(clouds[..., 0])  # the target clustering: +e1 or -e1

generator = torch.Generator().manual_seed(0)
M = (0.1 * torch.randn(1, 3, 3, generator=generator, dtype=torch.float64)).requires_grad_()
F = (0.1 * torch.randn(1, 3, 3, generator=generator, dtype=torch.float64)).requires_grad_()
optimizer = torch.optim.Adam([M, F], lr=0.05)


def flow(x, steps=6, dt=0.5):
    for _ in range(steps):
        x = x + dt * emflow.torch.attend(x, M, F, beta=2.0)
        x = x / x.norm(dim=-1, keepdim=True)
    return x


losses = []
for step in range(200):
    optimizer.zero_grad()
    loss = ((flow(clouds) - poles) ** 2).sum(dim=-1).mean()
    loss.backward()
    optimizer.step()
    losses.append(loss.item())
print(f"loss: {losses[0]:.4f} -> {losses[-1]:.4f}")

# The loss curve as an SVG polyline (log scale), 480 x 240.
low, high = min(losses), max(losses)
span = max(torch.tensor(high / low).log().item(), 1e-12)
points = " ".join(
    f"{40 + 430 * i / (len(losses) - 1):.1f},"
    f"{220 - 200 * torch.tensor(loss / low).log().item() / span:.1f}"
    for i, loss in enumerate(losses))
with open(sys.argv[1] if len(sys.argv) > 1 else "train_loss.svg", "w") as svg:
    svg.write(
        '<svg xmlns="http://www.w3.org/2000/svg" width="480" height="240" font-size="12">'
        '<rect width="480" height="240" fill="white"/>'
        '<path d="M40 20V220H470" stroke="black" fill="none"/>'
        f'<polyline points="{points}" stroke="#1f77b4" stroke-width="2" fill="none"/>'
        f'<text x="44" y="16">loss {high:.3g} (log scale)</text>'
        f'<text x="44" y="236">step 0</text><text x="420" y="236">{len(losses) - 1}</text>'
        f'<text x="380" y="210">{low:.3g}</text></svg>\n')
