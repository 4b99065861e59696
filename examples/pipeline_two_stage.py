"""Pipeline parallelism (OneFlow, "Common distributed parallel strategies"): stage 0 on rank 0,
stage 1 on rank 1; ``to_global`` hands the activations from one to the other.

    python -m tpflow.launch --nproc_per_node 2 examples/pipeline_two_stage.py
    python examples/pipeline_two_stage.py
"""

import torch

import tpflow as tpf

device = "cuda" if torch.cuda.device_count() >= tpf.get_world_size() else "cpu"
P0 = tpf.placement(device, ranks=[0])
P1 = tpf.placement(device, ranks=[1 if tpf.get_world_size() >= 2 else 0])
BROADCAST = tpf.sbp.broadcast

torch.manual_seed(0)
w0 = tpf.randn(5, 8, placement=P0, sbp=BROADCAST)  # stage 0's weights live on rank 0
w1 = tpf.randn(8, 3, placement=P1, sbp=BROADCAST)  # stage 1's on rank 1
in_stage0 = tpf.randn(4, 5, placement=P0, sbp=BROADCAST)
out_stage0 = tpf.matmul(in_stage0, w0)
in_stage1 = tpf.to_global(out_stage0, placement=P1, sbp=BROADCAST)
out_stage1 = tpf.matmul(in_stage1, w1)
if tpf.get_rank() == 0:
    print(out_stage0.shape, out_stage1.shape)  # torch.Size([4, 8]) torch.Size([4, 3])

torch.manual_seed(0)
w0_ref, w1_ref = torch.randn(5, 8, device=device), torch.randn(8, 3, device=device)
x_ref = torch.randn(4, 5, device=device)
if tpf.get_rank() in P0:
    torch.testing.assert_close(tpf.to_local(out_stage0), x_ref @ w0_ref)
    print(f"rank {tpf.get_rank()}: stage 0 output matches one device")
if tpf.get_rank() in P1:
    torch.testing.assert_close(tpf.to_local(out_stage1), x_ref @ w0_ref @ w1_ref)
    print(f"rank {tpf.get_rank()}: stage 1 output matches one device")
