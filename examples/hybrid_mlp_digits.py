"""Hybrid parallelism (OneFlow, "Distributed training", the hybrid MLP): the hidden layer is data parallel
(weights broadcast, each rank its split(0) rows of the batch), the output layer model parallel (W split(1):
each rank its share of the classes). Trained on scikit-learn's handwritten digits beside the same model on
one device, from the same initial weights and batches.

    pip install -e ".[examples]"
    python -m tpflow.launch --nproc_per_node 2 examples/hybrid_mlp_digits.py
    python examples/hybrid_mlp_digits.py
"""

import copy

import torch
import torch.nn.functional as F
from torch import nn

import tpflow as tpf

try:
    from sklearn.datasets import load_digits
except ImportError:
    raise SystemExit("this example trains on scikit-learn's digits: pip install -e '.[examples]'") from None

device = "cuda" if torch.cuda.device_count() >= tpf.get_world_size() else "cpu"
world, rank = tpf.get_world_size(), tpf.get_rank()
P = tpf.placement(device, ranks=list(range(world)))
B, S0 = tpf.sbp.broadcast, tpf.sbp.split(0)


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.hidden = nn.Linear(64, 512)
        self.output = nn.Linear(512, 10)

    def forward(self, x):
        return self.output(F.relu(self.hidden(x)))


digits = load_digits()
images = torch.tensor(digits.data, dtype=torch.float32, device=device) / 16
labels = torch.tensor(digits.target, device=device)
order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(0)).to(device)
train, test = order[:1400], order[1400:]

torch.manual_seed(0)
one_device = MLP().to(device)
model = copy.deepcopy(one_device)
model.hidden = tpf.to_global(model.hidden, placement=P, sbp=B)  # data parallel: every rank a whole copy
model.output = tpf.ColumnParallelLinear.from_linear(model.output, placement=P)  # model parallel: W split(1)

optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
optimizer_one = torch.optim.SGD(one_device.parameters(), lr=0.1, momentum=0.9)
for epoch in range(4):
    for batch in train.split(100):
        x, y = images[batch], labels[batch]
        rows = torch.tensor_split(torch.arange(len(batch)), world)[rank]  # this rank reads only its rows
        x_global = tpf.to_global(x[rows.to(device)], placement=P, sbp=S0)
        logits = model(x_global)  # split(1) over P: each rank holds its classes' columns
        loss = F.cross_entropy(tpf.to_global(logits, sbp=B), tpf.tensor(y, placement=P, sbp=B))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

        loss_one = F.cross_entropy(one_device(x), y)
        optimizer_one.zero_grad()
        loss_one.backward()
        optimizer_one.step()
    if rank == 0:
        print(f"epoch {epoch}: loss {loss.full_tensor().item():.4f} (one device {loss_one.item():.4f})")

with torch.no_grad():
    predicted = tpf.to_global(model(tpf.tensor(images[test], placement=P, sbp=S0)), sbp=B).full_tensor().argmax(1)
    accuracy = (predicted == labels[test]).float().mean().item()
    accuracy_one = (one_device(images[test]).argmax(1) == labels[test]).float().mean().item()
print(f"rank {rank}: test accuracy {accuracy:.1%} on {len(test)} digits (one device {accuracy_one:.1%})")
assert accuracy >= 0.9, "the hybrid MLP should reach 90% on the held-out digits"
assert abs(accuracy - accuracy_one) <= 1 / len(test), "hybrid and one device should classify alike"
for (name, p), p_one in zip(model.named_parameters(), one_device.parameters()):
    torch.testing.assert_close(p.full_tensor(), p_one, rtol=1e-3, atol=1e-4, msg=name)
print(f"rank {rank}: hybrid parallel training matches one device")
