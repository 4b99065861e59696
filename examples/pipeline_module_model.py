"""The seed's 4-rank hybrid ``ModuleModel`` (OneFlow, "Common distributed parallel strategies") as a
two-stage pipeline, as its graph version sets it up with ``set_stage``: stage 0 data parallel on ranks 0-1,
stage 1 model parallel on ranks 2-3, each batch as 4 micro-batches (GPipe). Trained for a few steps beside
the same model on one device.

    python -m tpflow.launch --nproc_per_node 4 examples/pipeline_module_model.py
"""

import torch
import torch.nn.functional as F
from torch import nn

import tpflow as tpf
from examples.hybrid_module_model import StageModule

if tpf.get_world_size() < 4:
    raise SystemExit("stage 0 runs on ranks 0-1 and stage 1 on ranks 2-3: "
                     "python -m tpflow.launch --nproc_per_node 4 examples/pipeline_module_model.py")
device = "cuda" if torch.cuda.device_count() >= tpf.get_world_size() else "cpu"
P01, P23 = tpf.placement(device, ranks=[0, 1]), tpf.placement(device, ranks=[2, 3])
rank = tpf.get_rank()

torch.manual_seed(0)
m_stage0 = StageModule(5, 8, placement=P01, sbp=tpf.sbp.broadcast)
m_stage1 = StageModule(8, 3, placement=P23, sbp=tpf.sbp.split(dim=1))
pipe = tpf.Pipeline([tpf.stage(m_stage0, stage_id=0, placement=P01, sbp=tpf.sbp.split(0)),  # batch split: data par.
                     tpf.stage(m_stage1, stage_id=1, placement=P23, sbp=tpf.sbp.broadcast)],  # whole input: model par.
                    micro_batches=4, schedule="gpipe", loss_fn=F.mse_loss)
if rank == 0:
    print(pipe.schedule_table())

torch.manual_seed(0)
w0, w1 = nn.Parameter(torch.randn(5, 8, device=device)), nn.Parameter(torch.randn(8, 3, device=device))
optimizer = torch.optim.SGD(pipe.parameters(), lr=0.01)
optimizer_one = torch.optim.SGD([w0, w1], lr=0.01)
generator = torch.Generator().manual_seed(1)
for step in range(5):
    x, y = torch.randn(16, 5, generator=generator).to(device), torch.randn(16, 3, generator=generator).to(device)
    optimizer.zero_grad()
    loss = pipe.step(x, y)  # the loss on ranks 2-3, None on 0-1
    optimizer.step()
    loss_one = F.mse_loss(x @ w0 @ w1, y)
    optimizer_one.zero_grad()
    loss_one.backward()
    optimizer_one.step()
    if loss is not None:
        torch.testing.assert_close(loss, loss_one.detach())
        if rank == 2:
            print(f"step {step}: loss {loss.item():.4f} (one device {loss_one.item():.4f})")

mine, whole = (m_stage0.w, w0) if rank in P01 else (m_stage1.w, w1)
torch.testing.assert_close(mine.full_tensor(), whole.detach())  # a collective among the stage's two ranks
print(f"rank {rank}: stage {0 if rank in P01 else 1} ({tpf.get_sbp(mine)}) after 5 steps matches one device")
