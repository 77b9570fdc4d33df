"""Worker for tests/test_distributed.py: run under the launcher (one process per rank), compute
logits for several plans on the same batch, and have rank 0 save them (safetensors).

usage: dist_logits.py MODEL TP EXACT(0|1) OUT.safetensors PLAN [PLAN ...]
"""

import sys

import torch
from safetensors.torch import save_file

from syncdrop.parallel import dist
from syncdrop.plan import parse_plan
from syncdrop.runtime import build


def main() -> None:
    model_spec, tp, exact, out, *plans = sys.argv[1:]
    # built under the first plan (a distilled directory keeps the weights that plan selects), then
    # the plan is swapped in place, so all plans share one process group and one set of weights
    built = build(model_spec, int(tp), plans[0], progress=False, exact_reduce=exact == "1")
    cfg = built.model.cfg
    ids = torch.randint(0, cfg.vocab_size, (2, 13), generator=torch.Generator().manual_seed(0))
    result = {}
    for spec in plans:
        built.model.plan = parse_plan(spec, cfg.num_layers)
        result[spec] = built.model(ids).contiguous()
    result["calls"] = torch.tensor([built.model.comm.calls])
    if built.is_main:
        save_file(result, out)
    dist.shutdown()


if __name__ == "__main__":
    main()
