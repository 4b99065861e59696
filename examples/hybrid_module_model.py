"""Hybrid parallelism (OneFlow, "Common distributed parallel strategies", eager ``ModuleModel``):
stage 0 is data-parallel on ranks 0-1, stage 1 is model-parallel on ranks 2-3, and the stage-0
output is gathered and moved to ranks 2-3 between them.

    python -m tpflow.launch --nproc_per_node 4 examples/hybrid_module_model.py
    python examples/hybrid_module_model.py      # fewer ranks: stages share them
"""

import torch
from torch import nn

import tpflow as tpf

device = "cuda" if torch.cuda.device_count() >= tpf.get_world_size() else "cpu"
ranks = list(range(tpf.get_world_size()))
P01 = tpf.placement(device, ranks=ranks[0:2] if len(ranks) >= 4 else ranks)
P23 = tpf.placement(device, ranks=ranks[2:4] if len(ranks) >= 4 else ranks)


class StageModule(nn.Module):
    def __init__(self, in_dims, out_dims, placement=None, sbp=None):
        super().__init__()
        self.w = nn.Parameter(tpf.randn(in_dims, out_dims, placement=placement, sbp=sbp))

    def forward(self, x):
        return tpf.matmul(x, self.w)


class ModuleModel(nn.Module):
    def __init__(self):
        super().__init__()
        # stage 0: data parallel on ranks 0 and 1
        self.m_stage0 = StageModule(5, 8, placement=P01, sbp=tpf.sbp.broadcast)
        # stage 1: model parallel on ranks 2 and 3
        self.m_stage1 = StageModule(8, 3, placement=P23, sbp=tpf.sbp.split(dim=1))

    def forward(self, x):
        out_stage0 = self.m_stage0(x)
        # stage 1 needs the whole input, on ranks 2 and 3
        in_stage1 = tpf.to_global(out_stage0, placement=P23, sbp=tpf.sbp.broadcast)
        out_stage1 = self.m_stage1(in_stage1)
        return out_stage0, out_stage1


if __name__ == "__main__":
    torch.manual_seed(0)
    model = ModuleModel()
    in_stage0 = tpf.randn(4, 5, placement=P01, sbp=tpf.sbp.split(dim=0))  # split for data parallelism
    out_stage0, out_stage1 = model(in_stage0)
    if tpf.get_rank() == 0:
        print(out_stage0.shape, out_stage1.shape)  # torch.Size([4, 8]) torch.Size([4, 3])
        print(tpf.get_sbp(out_stage0), tpf.get_sbp(out_stage1))  # split(0) on P01, split(1) on P23

    torch.manual_seed(0)
    w0, w1 = torch.randn(5, 8, device=device), torch.randn(8, 3, device=device)
    x = torch.randn(4, 5, device=device)
    whole0 = tpf.to_local(tpf.to_global(out_stage0, sbp=tpf.sbp.broadcast))
    whole1 = tpf.to_local(tpf.to_global(out_stage1, sbp=tpf.sbp.broadcast))
    if tpf.get_rank() in P01:
        torch.testing.assert_close(whole0, x @ w0)
        print(f"rank {tpf.get_rank()}: stage 0 (data parallel) matches one device")
    if tpf.get_rank() in P23:
        torch.testing.assert_close(whole1, x @ w0 @ w1)
        print(f"rank {tpf.get_rank()}: stage 1 (model parallel) matches one device")
