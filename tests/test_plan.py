"""Sync plans: spec parsing, JSON round trip, and clear errors for malformed input."""

from __future__ import annotations

import json

import pytest

from syncdrop.errors import SyncdropError
from syncdrop.plan import SyncPlan, parse_plan, split_plan_list


def test_spec_forms() -> None:
    assert parse_plan("none", 6).dropped == []
    assert parse_plan("all", 6).dropped == list(range(6))
    assert parse_plan("last:2", 6).dropped == [4, 5]
    assert parse_plan("first:2", 6).dropped == [0, 1]
    assert parse_plan("last:0", 6).dropped == []
    assert parse_plan("blocks:0,3, 5", 6).dropped == [0, 3, 5]
    assert {b.attn for b in parse_plan("all", 4, "naive").blocks} == {"naive"}
    assert parse_plan("blocks:1", 4).blocks[1].attn == "drop"
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
