"""The latency bench's bookkeeping (:func:`syncdrop.bench.latency.latency_bench`): which model runs
each plan, and how many all-reduces and barriers a run issues, counted on a simulated communicator.
No timing."""

from __future__ import annotations

import torch

from syncdrop.parallel.comm import SimulatedComm
from syncdrop.parallel.executor import simulated_model
from syncdrop.plan import parse_plan


class _Counting(SimulatedComm):
    def __init__(self, tp: int) -> None:
        super().__init__(tp)
        self.barriers = 0

    def barrier(self) -> None:
        self.barriers += 1


def test_latency_bench_runs_each_plan_through_model_for(tiny_llama_dir) -> None:
    """latency_bench never sets a plan: one simulated model per plan (tp=2, one shared communicator),
    each keeps its own plan, and the all-reduces issued are exactly 2 x 23 timed ones plus, per run,
    (decode_tokens + 1) forwards x the plan's collectives_per_forward; barriers: one per timed
    all-reduce and one per run. Rows carry the plan's facts (JSON keys of old files kept)."""
    from syncdrop.bench.latency import latency_bench
    from syncdrop.models.loading import resolve_model

    src = resolve_model(str(tiny_llama_dir))
    L, h = src.config.num_layers, src.config.hidden_size
    specs = ["none", "all", "partial:0.5", "partial:0"]
    comm = _Counting(2)
    models = {s: simulated_model(src.config, src.reader, 2, parse_plan(s, L), comm=comm) for s in specs}
    plans = [(s, parse_plan(s, L)) for s in specs]
    by_plan = {id(p): models[s] for s, p in plans}
    asked = []

    def model_for(plan):
        asked.append(plan)
        return by_plan[id(plan)]

    prompt = torch.randint(0, src.config.vocab_size, (1, 8), generator=torch.Generator().manual_seed(0))
    res = latency_bench(model_for, plans, prompt, decode_tokens=2, reps=2, warmup=1, progress=False)
    runs = 3  # warmup + reps
    assert all(models[s].plan.to_dict() == p.to_dict() for s, p in plans)  # nothing was switched
    # per rep: every plan's generation of 3 forwards, then the baseline's (none: 4 sync points) once more, timed
    # the payload sweep: 1, 8 // 8 = 1, 8 // 2 = 4 and 8 tokens, i.e. 3 sizes, 23 timed all-reduces each
    assert [x["tokens"] for x in res["allreduce_sizes"]] == [1, 4, 8]
    assert comm.calls == 3 * 23 + runs * 3 * (sum(p.collectives_per_forward for _, p in plans) + 4) == 69 + 9 * 14
    assert comm.barriers == 3 * 23 + runs * (len(plans) + 1)
    assert len(asked) == 1 + runs * (len(plans) + 1)
    rows = {r["plan"]: r for r in res["plans"]}
    assert [(rows[s]["allreduces_per_forward"], rows[s]["comm_units"]) for s in specs] == [(4, 4.0), (2, 2.0),
                                                                                          (4, 2.0), (0, 0.0)]
    assert rows["partial:0.5"]["sync_points"][0] == [0, "attn", round(0.5 * h) / h]
    assert [(rows[s]["ranks_diverge"], rows[s]["vocab_gather"]) for s in ("none", "partial:0")] == [(False, False),
                                                                                                     (True, True)]
    assert res["baseline_plan"] == "none"
    for key in ("spd_fraction", "ttft_ms", "decode_ms", "ideal_saving_ms", "realised_over_ideal", "partial"):
        assert key in rows["all"], key
