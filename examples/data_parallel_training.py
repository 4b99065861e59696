"""Data-parallel training with SBP (OneFlow, "Data parallelism training"): the model is broadcast,
each rank's batch becomes its split(0) block of one global batch, and the weight gradient is
summed over the ranks in backward, as DistributedDataParallel would.

    python -m tpflow.launch --nproc_per_node 2 examples/data_parallel_training.py
    python examples/data_parallel_training.py      # one process trains on both batches
"""

import torch

import tpflow as tpf

train_x = [torch.tensor([[1.0, 2.0], [2.0, 3.0]]), torch.tensor([[4.0, 6.0], [3.0, 1.0]])]
train_y = [torch.tensor([[8.0], [13.0]]), torch.tensor([[26.0], [9.0]])]

world, rank = tpf.get_world_size(), tpf.get_rank()
placement = tpf.placement("cpu", ranks=[0, 1] if world >= 2 else [0])
if world >= 2:
    x_local, y_local = train_x[rank % 2], train_y[rank % 2]  # each rank reads its own batch
else:
    x_local, y_local = torch.cat(train_x), torch.cat(train_y)

w = torch.nn.Parameter(tpf.zeros(2, 1, placement=placement, sbp=tpf.sbp.broadcast))
optimizer = torch.optim.SGD([w], lr=0.01)
x = tpf.to_global(x_local, placement=placement, sbp=tpf.sbp.split(0))
y = tpf.to_global(y_local, placement=placement, sbp=tpf.sbp.split(0))
for i in range(500):
    loss = ((tpf.matmul(x, w) - y) ** 2).sum()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    if (i + 1) % 100 == 0:
        value = loss.full_tensor().item()  # a collective: every rank of the placement takes part
        if rank == 0:
            print(f"{i + 1}/500 loss: {value:.3g}")

if rank in placement:
    print(f"rank {rank}: w = {tpf.to_local(w).flatten().tolist()}")
    torch.testing.assert_close(tpf.to_local(w), torch.tensor([[2.0], [3.0]]), rtol=1e-3, atol=1e-3)
