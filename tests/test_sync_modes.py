"""Sync modes as objects (syncdrop.plan.modes) and the one owner of a plan (syncdrop.plan.resolve).

A mode is one class: its block math, payload and servability. These tests check the facts modes
state against what the block code does, that a new mode lands as one class (a bf16-on-the-wire
all-reduce, defined here, runs through the plan, the simulated executor and the payload accounting
with nothing else changed), and that every command resolves plans through one function.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch

from syncdrop.errors import SyncdropError
from syncdrop.parallel.executor import simulated_model
from syncdrop.plan import (
    DROP,
    FULL,
    BiasInSum,
    BlockSync,
    Desync,
    Naive,
    Partial,
    SyncPlan,
    parse_plan,
    resolve_plan,
)
from syncdrop.plan import modes as modes_module
from syncdrop.plan.modes import Full, add_bias


def test_modes_state_their_facts() -> None:
    h = 576
    assert (FULL.payload(h), DROP.payload(h), Partial(0.25).payload(h)) == (1.0, 0.0, 144 / h)
    assert Partial(0.25, mask="topk").payload(h) == 1.0 and Partial(0.0, mask="topk").payload(h) == 0.0
    assert Partial(0.25).wire_bytes(10, h, 2) == 144 * 10 * 2 and DROP.wire_bytes(10, h, 2) == 0
    assert [m.diverges for m in (FULL, DROP, Naive(), Desync(), BiasInSum(), Partial(0.5), Partial(1.0))] == [
        False, False, True, False, False, True, False]
    assert FULL.vllm_blocker() is None and DROP.vllm_blocker() is None
    assert "ablation" in Naive().vllm_blocker() and "partial-sync" in Partial(0.5).vllm_blocker()
    assert [m.issues_collective for m in (FULL, DROP, Partial(0.0), Partial(0.1))] == [True, False, False, True]
    with pytest.raises(SyncdropError, match=r"\[0, 1\]"):
        Partial(1.5)


def test_plan_asks_its_modes() -> None:
    plan = SyncPlan([BlockSync(), BlockSync("drop"), BlockSync(Partial(0.5)), BlockSync("naive")])
    assert plan.dropped == [1, 3] and plan.has_partial and plan.ranks_diverge
    assert "partial-sync" in plan.vllm_blocker()  # the first blocking mode, in block order
    assert SyncPlan([BlockSync("desync")]).vllm_blocker().endswith("'desync' is an ablation variant")
    assert parse_plan("frac:0.5", 4).vllm_blocker() is None
    with pytest.raises(SyncdropError, match="combines with attn full, drop, partial, not bias-in-sum"):
        BlockSync("bias-in-sum", Partial(0.5))
    with pytest.raises(SyncdropError, match="mlp='drop'"):
        BlockSync("full", "drop")  # a drop mode stands at the attention point only


@dataclass(frozen=True)
class _Bf16Wire(Full):
    """A mode defined outside the library: a full all-reduce whose partials travel in bfloat16 (the
    sum is taken in bfloat16 and cast back), so half the bytes of an fp32 wire."""

    name: ClassVar[str] = "test-bf16-wire"

    def payload(self, hidden: int) -> float:
        return 1.0

    def wire_bytes(self, tokens: int, hidden: int, element_size: int) -> int:
        return tokens * hidden * 2

    def reduce(self, comm, y, x, *biases):
        return add_bias(x + comm.all_reduce(y.to(torch.bfloat16)).to(y.dtype), *biases)


@pytest.fixture
def bf16_wire():
    modes_module.register(_Bf16Wire)
    yield _Bf16Wire()
    del modes_module._REGISTRY[_Bf16Wire.name]


def test_a_new_mode_is_one_class(tiny_llama_dir, bf16_wire) -> None:
    """Registered, the new mode is a plan entry like any other (JSON round trip, at both sync points,
    combined with SPD), runs in the simulated executor, and the wire bytes it states are what the block
    sends; its output is the dense forward's up to bf16 rounding and differs from it (it really runs)."""
    from syncdrop.models.loading import resolve_model

    src = resolve_model(str(tiny_llama_dir))
    cfg, L = src.config, src.config.num_layers
    plan = resolve_plan({"blocks": [{"attn": "test-bf16-wire", "mlp": "test-bf16-wire"},
                                    {"attn": "drop", "mlp": "test-bf16-wire"}]}, L)
    assert plan.blocks[0].attn == bf16_wire and plan.dropped == [1]
    assert SyncPlan.from_dict(json.loads(json.dumps(plan.to_dict()))).blocks == plan.blocks
    sent: list[int] = []

    class Counting(type(simulated_model(cfg, src.reader, 2).comm)):
        def all_reduce(self, x):
            sent.append(x[0].numel() * x.element_size())
            return super().all_reduce(x)

    ids = torch.randint(0, cfg.vocab_size, (1, 9), generator=torch.Generator().manual_seed(0))
    out = simulated_model(cfg, src.reader, 2, plan, comm=Counting(2))(ids)
    assert sum(sent) == plan.wire_bytes(9, cfg.hidden_size, 4)
    ref = simulated_model(cfg, src.reader, 2, parse_plan("blocks:1", L))(ids)
    assert torch.allclose(out, ref, atol=0.05) and not torch.equal(out, ref)


def test_resolve_plan_is_the_one_owner(caplog) -> None:
    own = parse_plan("last:1", 4)
    assert resolve_plan(None, 4).dropped == [] and resolve_plan(None, 4, own=own) is own
    assert resolve_plan("model", 4, own=own) is own
    assert resolve_plan("blocks:0", 4, variant="naive").blocks[0].attn == Naive()
    with pytest.raises(SyncdropError, match="has no plan of its own") as e:
        resolve_plan("model", 4, what="plans")
    assert e.value.field == "plans"
    with pytest.raises(SyncdropError, match="has 4 blocks but the model has 5") as e:
        resolve_plan(own, 5)
    assert e.value.field == "plan"
    with pytest.raises(SyncdropError, match="cannot be served by vLLM: only the SPD drop block"):
        resolve_plan("all", 4, variant="desync", serving=True)
    with pytest.raises(SyncdropError, match="positive integer"):
        resolve_plan("none", 4, tp=0)
    made_at_3 = parse_plan("last:1", 4)
    made_at_3.meta = {"profile": {"tp": 3}}
    with caplog.at_level("WARNING"):
        resolve_plan(made_at_3, 4, tp=2)
    assert "measured at tp=3" in caplog.text


def test_bench_refuses_plan_with_plans(tiny_llama_dir) -> None:
    """``--plan`` beside ``--plans`` was silently ignored: now one line, exit 2, before any rank starts."""
    r = subprocess.run([sys.executable, "-m", "syncdrop.cli", "bench", "--model", str(tiny_llama_dir), "--tp", "2",
                        "--launch", "--plan", "all", "--plans", "none"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "--plan all: bench measures the plans listed in --plans" in lines[0], r.stderr


def test_no_mode_names_outside_the_plan_package() -> None:
    """Commands ask modes, never compare their names: no ``.attn == "..."``-style checks in syncdrop/."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "syncdrop"
    pat = re.compile(r"\.(attn|mlp)\s*(==|!=|in|not in)\s*[\"'(]|isinstance\([^)]*\b(Partial|Full|Drop)\b")
    hits = [f"{p.relative_to(root)}:{i}" for p in root.rglob("*.py") if p.parent.name != "plan"
            for i, line in enumerate(p.read_text().splitlines(), 1) if pat.search(line)]
    assert hits == []
