"""Pipeline parallelism (OneFlow, "Distributed training", the LeNet pipeline): the convolutions are a stage
on rank 0, the dense layers a stage on rank 1, and each batch runs as 4 micro-batches on the 1F1B schedule.
Trained on scikit-learn's handwritten digits beside the same network on one device.

    pip install -e ".[examples]"
    python -m tpflow.launch --nproc_per_node 2 examples/pipeline_lenet.py
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

if tpf.get_world_size() < 2:
    raise SystemExit("a pipeline gives each stage its own rank: "
                     "python -m tpflow.launch --nproc_per_node 2 examples/pipeline_lenet.py")
device = "cuda" if torch.cuda.device_count() >= tpf.get_world_size() else "cpu"
rank = tpf.get_rank()

torch.manual_seed(0)
convolutions = nn.Sequential(  # 1 x 8 x 8 digits -> 64 x 2 x 2
    nn.Conv2d(1, 32, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
    nn.Conv2d(32, 64, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten())
dense = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 10))
one_device = nn.Sequential(copy.deepcopy(convolutions), copy.deepcopy(dense)).to(device)

pipe = tpf.Pipeline([tpf.stage(convolutions, stage_id=0, placement=tpf.placement(device, [0])),
                     tpf.stage(dense, stage_id=1, placement=tpf.placement(device, [1]))],
                    micro_batches=4, schedule="1f1b", loss_fn=F.cross_entropy)
if rank == 0:
    print(pipe.schedule_table())

digits = load_digits()
images = torch.tensor(digits.images, dtype=torch.float32, device=device).unsqueeze(1) / 16
labels = torch.tensor(digits.target, device=device)
order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(0)).to(device)
train, test = order[:1400], order[1400:]

optimizer = torch.optim.SGD(pipe.parameters(), lr=0.1, momentum=0.9)  # on each rank, its stage's parameters step
optimizer_one = torch.optim.SGD(one_device.parameters(), lr=0.1, momentum=0.9)
for epoch in range(5):
    for batch in train.split(100):
        optimizer.zero_grad()
        loss = pipe.step(images[batch], labels[batch])  # the loss on the last stage's rank, None elsewhere
        optimizer.step()

        loss_one = F.cross_entropy(one_device(images[batch]), labels[batch])
        optimizer_one.zero_grad()
        loss_one.backward()
        optimizer_one.step()
        if loss is not None:
            # float32 in another summation order (micro-batches): equal at first, then rounding compounds
            torch.testing.assert_close(loss, loss_one.detach(), rtol=1e-4 if epoch == 0 else 5e-2, atol=0)
    if loss is not None:
        print(f"epoch {epoch}: loss {loss.item():.4f} (one device {loss_one.item():.4f})")

with torch.no_grad():
    logits = pipe(images[test])  # the stages in order, eagerly: the logits live on rank 1
    accuracy_one = (one_device(images[test]).argmax(1) == labels[test]).float().mean().item()
if rank == 1:
    accuracy = (tpf.to_local(logits).argmax(1) == labels[test]).float().mean().item()
    print(f"rank 1: test accuracy {accuracy:.1%} on {len(test)} digits (one device {accuracy_one:.1%})")
    assert accuracy >= 0.9 and abs(accuracy - accuracy_one) <= 1 / len(test)
for p, p_one in zip(pipe.parameters(), one_device.parameters()):
    if rank in tpf.get_placement(p):
        # the same steps in another summation order: float32 rounding grows over 70 momentum steps to ~1e-3
        torch.testing.assert_close(tpf.to_local(p), p_one, rtol=0, atol=1e-2)
print(f"rank {rank}: its pipeline stage trained as on one device; matches one device")
