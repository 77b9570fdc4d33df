"""Sync plans: spec parsing, JSON round trip, clear errors for malformed input, and the facts a plan states
(sync points, collectives, communication units, diverging ranks, vocab gather) against hand counts and
against what the simulated executor does in one forward."""

from __future__ import annotations

import json

import pytest
import torch

from syncdrop.errors import SyncdropError
from syncdrop.parallel.block import block_forward
from syncdrop.parallel.comm import SimulatedComm
from syncdrop.parallel.executor import simulated_model
from syncdrop.plan import DROP, BlockSync, Naive, Partial, SyncPlan, SyncPoint, parse_plan, split_plan_list


def test_spec_forms() -> None:
    assert parse_plan("none", 6).dropped == []
    assert parse_plan("all", 6).dropped == list(range(6))
    assert parse_plan("last:2", 6).dropped == [4, 5]
    assert parse_plan("first:2", 6).dropped == [0, 1]
    assert parse_plan("last:0", 6).dropped == []
    assert parse_plan("blocks:0,3, 5", 6).dropped == [0, 3, 5]
    assert {b.attn for b in parse_plan("all", 4, "naive").blocks} == {Naive()}
    assert parse_plan("blocks:1", 4).blocks[1].attn == DROP and str(DROP) == "drop"
    assert parse_plan("all", 4).spd_fraction == 1.0
    assert parse_plan("frac:0.5", 6).dropped == [3, 4, 5]
    assert parse_plan("frac:0", 6).dropped == [] and parse_plan("frac:1", 6).dropped == list(range(6))


def test_plan_lists() -> None:
    assert split_plan_list("none,blocks:0,3,7,all, last:2") == ["none", "blocks:0,3,7", "all", "last:2"]
    with pytest.raises(SyncdropError, match="at least one plan"):
        split_plan_list(" , ")


def test_json_round_trip(tmp_path) -> None:
    plan = parse_plan("blocks:1,2", 5, "desync")
    plan.meta["note"] = "x"
    path = tmp_path / "plan.json"
    plan.save(path)
    again = parse_plan(str(path), 5)
    assert again.blocks == plan.blocks and again.meta == {"note": "x"}
    assert json.loads(path.read_text())["format"] == "syncdrop-plan"


@pytest.mark.parametrize(
    "spec, message",
    [
        ("blocks:0,9", "out of range"),
        ("blocks:-1", "out of range"),
        ("blocks:a", "must be an integer"),
        ("blocks:", "at least one block"),
        ("last:7", "between 0 and 6"),
        ("last:x", "must be an integer"),
        ("sometimes", "malformed plan"),
        ("frac:1.5", "between 0 and 1"),
        ("frac:x", "must be a number"),
        ("missing.json", "not found"),
    ],
)
def test_bad_specs(spec: str, message: str) -> None:
    with pytest.raises(SyncdropError, match=message):
        parse_plan(spec, 6)


@pytest.mark.parametrize(
    "content, message",
    [
        ("{not json", "not valid JSON"),
        ('{"blocks": 3}', "'blocks' list"),
        ('{"blocks": [{"attn": "maybe"}]}', "expected one of"),
        ('{"blocks": [{"attn": "drop"}]}', "plan has 1 blocks but the model has 6"),
        ('{"blocks": ["drop"]}', "must be an object"),
    ],
)
def test_bad_plan_files(tmp_path, content: str, message: str) -> None:
    path = tmp_path / "p.json"
    path.write_text(content)
    with pytest.raises(SyncdropError, match=message):
        parse_plan(str(path), 6)


def test_dropping_rejects_unknown_variant() -> None:
    with pytest.raises(SyncdropError, match="drop variant"):
        SyncPlan.dropping(4, [1], "sideways")


# ---------------------------------------------------------------------------- plan facts

H = 576  # SmolLM2's hidden size: k = round(p * 576)


def _mixed() -> SyncPlan:
    """Counted by hand (h = 576): block 0 full/full: 2 all-reduces of payload 1; block 1 drop/full: the
    attention one goes, the MLP one carries P_r + Z_r (1); block 2 full/partial 0.25: 1 and 144/576;
    block 3 topk partial 0.5/full: the topk ablation all-reduces all h channels (1), then 1.
    7 collectives, 1 + 1 + 1 + 1 + 0.25 + 1 + 1 = 6.25 units."""
    return SyncPlan([BlockSync(), BlockSync("drop"), BlockSync("full", Partial(0.25)),
                     BlockSync(Partial(0.5, mask="topk"), "full")])


def test_sync_points_by_hand() -> None:
    assert _mixed().sync_points(H) == [SyncPoint(0, "attn", 1.0), SyncPoint(0, "mlp", 1.0), SyncPoint(1, "mlp", 1.0),
                                       SyncPoint(2, "attn", 1.0), SyncPoint(2, "mlp", 144 / 576),
                                       SyncPoint(3, "attn", 1.0), SyncPoint(3, "mlp", 1.0)]
    # drop + partial MLP: one collective of k/h (the attention partials ride in it); p = 0: nothing sent
    spd_partial = SyncPlan([BlockSync("drop", Partial(0.5)), BlockSync(Partial(0.0), Partial(0.0))])
    assert spd_partial.sync_points(H) == [SyncPoint(0, "mlp", 0.5)]
    # k = round(p h): 0.3 * 10 = 3 channels of 10
    assert SyncPlan.partial(1, 0.3).sync_points(10) == [SyncPoint(0, "attn", 0.3), SyncPoint(0, "mlp", 0.3)]
    with pytest.raises(SyncdropError, match="hidden size must be a positive integer"):
        _mixed().sync_points(0)


@pytest.mark.parametrize("spec, L, collectives, units", [
    ("none", 6, 12, 12.0),
    ("all", 6, 6, 6.0),
    ("last:2", 6, 10, 10.0),
    ("frac:0.5", 30, 45, 45.0),
    ("partial:0.25", 4, 8, 8 * 0.25),
    ("partial:0", 4, 0, 0.0),
    ("partial:1", 3, 6, 6.0),
])
def test_collectives_and_comm_units_by_hand(spec: str, L: int, collectives: int, units: float) -> None:
    plan = parse_plan(spec, L)
    assert plan.collectives_per_forward == collectives == len(plan.sync_points(H))
    assert plan.comm_units(H) == pytest.approx(units, abs=1e-12)
    assert plan.comm_units(H) == pytest.approx(sum(plan.payload_fraction(H)), abs=1e-12)


def test_mixed_plan_counts_and_naive_variants() -> None:
    assert _mixed().collectives_per_forward == 7 and _mixed().comm_units(H) == pytest.approx(6.25)
    for variant in ("naive", "desync", "bias-in-sum"):  # every drop variant removes the attention all-reduce only
        plan = parse_plan("blocks:0,2", 4, variant)
        assert plan.collectives_per_forward == 2 * 4 - 2 and plan.comm_units(H) == 6.0


@pytest.mark.parametrize("plan, diverge, gather", [
    (SyncPlan.uniform(4), False, False),
    (parse_plan("all", 4), False, False),  # drop: the MLP all-reduce sums the attention partials
    (parse_plan("all", 4, "bias-in-sum"), False, False),
    (parse_plan("all", 4, "desync"), False, False),  # its output is an all-reduce
    (parse_plan("blocks:3", 4, "naive"), True, False),  # X + A_r stays per rank; rank 0's stream feeds the head
    (parse_plan("partial:0.5", 4), True, True),
    (parse_plan("partial:0", 4), True, True),
    (parse_plan("partial:1", 4), False, True),  # an ordinary all-reduce, but the head is still vocab-parallel
    (SyncPlan([BlockSync("drop", Partial(0.5)), BlockSync()]), True, True),
])
def test_ranks_diverge_and_vocab_gather(plan: SyncPlan, diverge: bool, gather: bool) -> None:
    assert plan.ranks_diverge is diverge
    assert plan.needs_vocab_gather is gather == plan.has_partial


class _CountingComm(SimulatedComm):
    """The simulated communicator, also recording each all-reduce's payload width (channels sent)."""

    def __init__(self, tp: int) -> None:
        super().__init__(tp)
        self.widths: list[int] = []

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        self.widths.append(x.shape[-1])
        self.bytes_per_rank = getattr(self, "bytes_per_rank", 0) + x[0].numel() * x.element_size()  # (R, M, w)
        return super().all_reduce(x)


@pytest.fixture(scope="module")
def tiny4(tmp_path_factory):
    """A tiny Llama (hidden 48, 6 heads, 2 KV heads) with 4 blocks, resolved by syncdrop."""
    from syncdrop.models.loading import resolve_model
    from syncdrop.tiny_models import build_tiny, tiny_config

    cfg = tiny_config("llama")
    cfg.num_hidden_layers = 4
    return resolve_model(str(build_tiny(tmp_path_factory.mktemp("tiny4"), cfg, seed=3)))


FORWARD_PLANS = {
    "none": SyncPlan.uniform(4),
    "all": parse_plan("all", 4),
    "partial": parse_plan("partial:0.25", 4),
    "partial0": parse_plan("partial:0", 4),
    "partial1": parse_plan("partial:1", 4),
    "desync": parse_plan("all", 4, "desync"),
    "naive": parse_plan("all", 4, "naive"),
    "naive+desync": SyncPlan([BlockSync("naive"), BlockSync("desync"), BlockSync(), BlockSync("bias-in-sum")]),
    "mixed": SyncPlan([BlockSync("drop", Partial(0.5)), BlockSync(Partial(0.25, mask="topk"), "full"),
                       BlockSync(Partial(0.0), "full"), BlockSync("full", Partial(0.5, mask="random"))]),
}


@pytest.mark.parametrize("name", list(FORWARD_PLANS))
def test_simulated_forward_issues_the_plans_collectives(tiny4, name: str) -> None:
    """One forward of the simulated executor (tp=2) issues exactly collectives_per_forward all-reduces
    (SimulatedComm.calls), of the widths sync_points states (payload x h channels)."""
    plan, cfg = FORWARD_PLANS[name], tiny4.config
    comm = _CountingComm(2)
    model = simulated_model(cfg, tiny4.reader, 2, plan, comm=comm)
    ids = torch.randint(0, cfg.vocab_size, (1, 7), generator=torch.Generator().manual_seed(0))
    model(ids)
    assert comm.calls == plan.collectives_per_forward
    assert comm.widths == [round(p.payload * cfg.hidden_size) for p in plan.sync_points(cfg.hidden_size)]
    # what each mode says it puts on the wire is what the block hands the all-reduce (link emulation, cost model)
    assert getattr(comm, "bytes_per_rank", 0) == plan.wire_bytes(7, cfg.hidden_size, 4)


@pytest.mark.parametrize("name", list(FORWARD_PLANS))
def test_ranks_diverge_matches_the_block_code(tiny4, name: str) -> None:
    """Run the blocks one by one (the executor's block_forward, tp=2) and look at the residual stream
    after each: ranks_diverge is True exactly when at some block the two ranks' streams differ."""
    plan, cfg = FORWARD_PLANS[name], tiny4.config
    model = simulated_model(cfg, tiny4.reader, 2, plan)
    ids = torch.randint(0, cfg.vocab_size, (1, 7), generator=torch.Generator().manual_seed(1))
    ctx = model.context(1, 7)
    x = model.embed_tokens(ids)  # (1, M, h)
    differed = False
    with torch.inference_mode():
        for i, b in enumerate(plan.blocks):
            x = block_forward(x, model.blocks[i], model.geos[i], cfg, model.comm, ctx, b)
            differed |= x.shape[0] > 1 and (x[0] - x[1]).abs().max().item() > 1e-6  # (R, M, h)
    assert plan.ranks_diverge is differed
