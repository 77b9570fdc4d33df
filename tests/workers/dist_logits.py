"""Worker for tests/test_distributed.py: run under the launcher (one process per rank), compute
logits for several plans on the same batch, and have rank 0 save them (safetensors).

usage: dist_logits.py MODEL TP EXACT_PLANS RING_PLANS OUT.safetensors

EXACT_PLANS / RING_PLANS: plan lists as ``--plans`` takes them run with ``--exact-reduce`` semantics and with
the backend's own all-reduce (RING_PLANS may be empty); results are saved as ``exact/SPEC`` and
``ring/SPEC``, with ``calls`` = all-reduces issued in total.
"""

import sys

import torch
from safetensors.torch import save_file

from syncdrop.parallel import dist
from syncdrop.plan import parse_plan, split_plan_list
from syncdrop.runtime import build


def main() -> None:
    model_spec, tp, exact_plans, ring_plans, out = sys.argv[1:]
    runs = [(mode, p) for mode, text in (("exact", exact_plans), ("ring", ring_plans)) if text
            for p in split_plan_list(text)]
    # built under the first plan (a distilled directory keeps the weights that plan selects), then
    # the plan and the reduction are swapped in place, so all runs share one process group and one
    # set of weights
    built = build(model_spec, int(tp), runs[0][1], progress=False, exact_reduce=True)
    cfg = built.model.cfg
    ids = torch.randint(0, cfg.vocab_size, (2, 13), generator=torch.Generator().manual_seed(0))
    result = {}
    for mode, spec in runs:
        built.model.comm.exact = mode == "exact"
        built.model.plan = parse_plan(spec, cfg.num_layers)
        result[f"{mode}/{spec}"] = built.model(ids).contiguous()
    result["calls"] = torch.tensor([built.model.comm.calls])
    if built.is_main:
        save_file(result, out)
    dist.shutdown(ok=True)
    dist.exit_worker(0)  # the same way out as `python -m syncdrop` workers


if __name__ == "__main__":
    main()
