"""Model parallelism (OneFlow, "Common distributed parallel strategies"): the data is whole on
every rank, the model is split by columns.

    python -m tpflow.launch --nproc_per_node 2 examples/model_parallel.py
    python examples/model_parallel.py
"""

import torch

import tpflow as tpf

device = "cuda" if torch.cuda.device_count() >= tpf.get_world_size() else "cpu"
placement = tpf.placement(device, ranks=[0, 1] if tpf.get_world_size() >= 2 else [0])

torch.manual_seed(0)
x = tpf.randn(4, 5, placement=placement, sbp=tpf.sbp.broadcast)
w = tpf.randn(5, 8, placement=placement, sbp=tpf.sbp.split(dim=1))
out = tpf.matmul(x, w)
if tpf.get_rank() == 0:
    print(out.shape, tpf.get_sbp(out))  # torch.Size([4, 8]) (sbp.split(dim=1),)

torch.manual_seed(0)
x_ref, w_ref = torch.randn(4, 5, device=device), torch.randn(5, 8, device=device)
whole = tpf.to_local(tpf.to_global(out, sbp=tpf.sbp.broadcast))
if tpf.get_rank() in placement:
    torch.testing.assert_close(whole, x_ref @ w_ref)
    print(f"rank {tpf.get_rank()}: local out {tuple(tpf.to_local(out).shape)}, matches one device")
