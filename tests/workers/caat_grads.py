"""Worker for tests/test_caat_train.py: one training step's gradients in the distributed runtime.

usage: caat_grads.py PLAN_JSON OUT.safetensors   (under the launcher, one process per rank)
Rank 0 saves the all-reduced dense gradients and the loss.
"""

import sys

import torch
from safetensors.torch import save_file

from syncdrop.caat.grad_comm import GradComm
from syncdrop.caat.model import init_params, llama_config, lm_loss, tp_forward
from syncdrop.caat.train import _all_reduce_grads
from syncdrop.parallel import dist
from syncdrop.parallel.sharding import ShardLayout
from syncdrop.plan import SyncPlan


def main() -> None:
    plan_path, out = sys.argv[1:]
    ctx = dist.init(60.0)
    cfg = llama_config(64, 32, 2, 4, 2, 64, 16)
    params = {k: v.requires_grad_(True) for k, v in init_params(cfg, 0).items()}
    batch = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(1))
    comm = GradComm(dist.DistComm(ctx.world), ctx.rank)
    plan = SyncPlan.load(plan_path)
    loss = lm_loss(tp_forward(params, cfg, ShardLayout.build(cfg, ctx.world), plan, comm, [ctx.rank],
                              batch[:, :-1]), batch[:, 1:])
    loss.backward()
    _all_reduce_grads(params, comm.inner)
    if ctx.is_main:
        save_file({**{k: p.grad.contiguous() for k, p in params.items()}, "loss": loss.detach()[None]}, out)
    dist.shutdown(ok=True)
    dist.exit_worker(0)  # the same way out as `python -m syncdrop` workers


if __name__ == "__main__":
    main()
