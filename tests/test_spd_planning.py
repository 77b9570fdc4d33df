"""Sensitivity-guided planning (syncdrop/spd/planning.py): synthetic profiles, no model needed."""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path

import pytest

from syncdrop.errors import SyncdropError
from syncdrop.io_utils import portable_path
from syncdrop.plan import SyncPlan, parse_plan
from syncdrop.spd.cli import add_plan_parser
from syncdrop.spd.planning import choose_blocks, config_plan, drop_order, load_profile, make_plan, tiers

BASE = 10.0
#       block:  0     1      2     3      4     5     6      7     8     9
PROG = [3.00, 0.05, -0.02, 0.004, 0.30, 0.01, 0.0, 0.002, 0.08, 0.009]
ISO = [2.50, 0.04, 0.01, 0.003, 0.40, 0.02, 0.001, 0.002, 0.05, 0.50]


def _profile_dict(prog=PROG, iso=ISO, base=BASE) -> dict:
    return {"format": "syncdrop-profile", "version": 1, "model": "tiny", "tp": 2, "num_blocks": len(prog),
            "calib": {"dataset": "wikitext2:valid", "windows": 8, "seq_len": 512}, "baseline_ppl": base,
            "blocks": [{"index": i, "progressive": p, "isolated": q, "ppl_progressive": 0.0, "ppl_isolated": base + q}
                       for i, (p, q) in enumerate(zip(prog, iso, strict=True))]}


@pytest.fixture
def profile_path(tmp_path) -> Path:
    p = tmp_path / "profile.json"
    p.write_text(json.dumps(_profile_dict()))
    return p


def _plan_cli(argv: list[str]) -> int:
    ap = argparse.ArgumentParser()
    add_plan_parser(ap.add_subparsers(dest="command", required=True))
    args = ap.parse_args(["plan", *argv])
    return args.func(args)


def test_drop_order_ascending_ties_to_later_block() -> None:
    assert drop_order([0.5, 0.1, 0.1, -1.0]) == [3, 2, 1, 0]
    assert drop_order(PROG) == [2, 6, 7, 3, 9, 5, 1, 8, 4, 0]


@pytest.mark.parametrize("spd, k", [(0.0, 0), (0.7, 7), (0.25, 2), (1.0, 10)])
def test_spd_fraction_drops_round_f_l_least_sensitive(profile_path, spd, k) -> None:
    plan = make_plan(load_profile(profile_path), spd=spd)
    assert len(plan.dropped) == k == round(spd * 10)
    assert sorted(plan.dropped) == sorted(drop_order(PROG)[:k])
    assert all(str(plan.blocks[i].attn) == "drop" for i in plan.dropped)


def test_isolated_sensitivity_changes_the_order(profile_path) -> None:
    prof = load_profile(profile_path)
    plan = make_plan(prof, spd=0.7, sensitivity="isolated")
    assert sorted(plan.dropped) == sorted(drop_order(ISO)[:7])
    assert 9 not in plan.dropped and 9 in make_plan(prof, spd=0.7).dropped


@pytest.mark.parametrize("x", [0.0, 0.001, 0.002, 0.0075, 0.01, 0.05, 0.5])
def test_max_ppl_increase_respects_the_budget(profile_path, x) -> None:
    prof = load_profile(profile_path)
    plan = make_plan(prof, max_ppl_increase=x)
    order = drop_order(PROG)
    k = len(plan.dropped)
    assert sorted(plan.dropped) == sorted(order[:k])  # a prefix of the order
    budget = x * BASE
    predicted = sum(PROG[i] for i in plan.dropped)
    assert predicted <= budget + 1e-12
    if k < len(order):  # the next block would break the budget
        assert predicted + PROG[order[k]] > budget
    assert plan.meta["predicted_ppl_increase"] == pytest.approx(predicted)
    assert plan.meta["predicted_ppl"] == pytest.approx(BASE + predicted)
    assert plan.meta["target"] == {"max_ppl_increase": x}


def test_negative_sensitivities_pay_for_positive_ones() -> None:
    # order 1, 3, 0, 2; predicted increases -0.2, -0.15, -0.05, +0.1
    assert choose_blocks([0.1, -0.2, 0.15, 0.05], 10.0, max_ppl_increase=0.0) == [1, 3, 0]
    assert choose_blocks([0.1, -0.2, 0.15, 0.05], 10.0, max_ppl_increase=0.05) == [1, 3, 0, 2]
    assert choose_blocks([0.1, 0.2], 10.0, max_ppl_increase=0.0) == []


def test_tiers_assigned_by_thresholds(profile_path) -> None:
    prof = load_profile(profile_path)
    # absolute thresholds (ppl deltas); boundaries: s == tau1 -> zs, s == tau2 -> b2b
    plan = make_plan(prof, spd=1.0, tau1="0.01", tau2="0.3")
    want = {i: "zs" if s <= 0.01 else ("b2b" if s <= 0.3 else "hg+b2b") for i, s in enumerate(PROG)}
    assert tiers(plan) == want
    assert tiers(plan)[5] == "zs" and tiers(plan)[4] == "b2b" and tiers(plan)[0] == "hg+b2b"
    # percentages of the baseline ppl
    pct = make_plan(prof, spd=1.0, tau1="0.1%", tau2="1%")
    assert pct.meta["tau1"] == pytest.approx(0.01) and pct.meta["tau2"] == pytest.approx(0.1)
    assert tiers(make_plan(prof, spd=1.0)) == tiers(make_plan(prof, spd=1.0, tau1="0", tau2="1%"))  # defaults
    assert tiers(pct)[1] == "b2b" and tiers(pct)[8] == "b2b" and tiers(pct)[4] == "hg+b2b"
    # only dropped blocks get a tier
    assert set(tiers(make_plan(prof, spd=0.3))) == set(make_plan(prof, spd=0.3).dropped)


def test_plan_cli_round_trips_through_parse_plan(profile_path, tmp_path, capsys) -> None:
    out = tmp_path / "plans" / "plan.json"
    assert _plan_cli(["--profile", str(profile_path), "--spd", "0.7", "--tau1", "0.005", "--tau2", "1%",
                      "--out", str(out)]) == 0
    assert "predicted ppl" in capsys.readouterr().out
    plan = parse_plan(str(out), 10)
    assert sorted(plan.dropped) == sorted(drop_order(PROG)[:7])
    assert tiers(plan) == {i: ("zs" if PROG[i] <= 0.005 else "b2b" if PROG[i] <= 0.1 else "hg+b2b")
                           for i in plan.dropped}
    prof_meta = plan.meta["profile"]
    assert prof_meta["sha256"] == hashlib.sha256(profile_path.read_bytes()).hexdigest()
    assert prof_meta["model"] == "tiny" and prof_meta["tp"] == 2
    assert Path(prof_meta["path"]) == profile_path.resolve()
    assert plan.meta["sensitivity"] == "progressive" and "command" in plan.meta["provenance"]
    # stable on a second save/load
    plan.save(tmp_path / "again.json")
    again = parse_plan(str(tmp_path / "again.json"), 10)
    assert again.blocks == plan.blocks and again.meta == plan.meta
    with pytest.raises(SyncdropError, match="plan has 10 blocks but the model has 12"):
        parse_plan(str(out), 12)


def test_plan_cli_needs_exactly_one_target(profile_path, tmp_path) -> None:
    for argv in (["--profile", str(profile_path), "--out", "x.json"],
                 ["--profile", str(profile_path), "--spd", "0.5", "--max-ppl-increase", "0.01", "--out", "x.json"]):
        with pytest.raises(SystemExit) as e:
            _plan_cli(argv)
        assert e.value.code == 2


@pytest.mark.parametrize("kw, msg", [
    ({"spd": 1.5}, "--spd must be a fraction between 0 and 1"),
    ({"spd": -0.1}, "--spd must be a fraction between 0 and 1"),
    ({"max_ppl_increase": -0.01}, "--max-ppl-increase must be"),
    ({"spd": 0.5, "tau1": "2%", "tau2": "1%"}, "--tau1 .* must not exceed --tau2"),
    ({"spd": 0.5, "tau1": "abc"}, "--tau1 must be a perplexity delta"),
    ({"spd": 0.5, "tau2": "-1"}, "--tau2 must be a finite number >= 0"),
    ({"spd": 0.5, "sensitivity": "random"}, "--sensitivity must be one of"),
    ({}, "exactly one of --spd or --max-ppl-increase"),
])
def test_bad_planning_arguments(profile_path, kw, msg) -> None:
    with pytest.raises(SyncdropError, match=msg):
        make_plan(load_profile(profile_path), **kw)


def _bad(tmp_path, content) -> Path:
    p = tmp_path / "bad.json"
    p.write_text(content if isinstance(content, str) else json.dumps(content))
    return p


def test_bad_profile_files(tmp_path) -> None:
    with pytest.raises(SyncdropError, match="profile file not found"):
        load_profile(tmp_path / "missing.json")
    with pytest.raises(SyncdropError, match="is a directory"):
        load_profile(tmp_path)
    with pytest.raises(SyncdropError, match="is not valid JSON"):
        load_profile(_bad(tmp_path, "{not json"))
    with pytest.raises(SyncdropError, match="expected a JSON object"):
        load_profile(_bad(tmp_path, [1, 2]))
    plan_like = {"format": "syncdrop-plan", "version": 1, "num_blocks": 1, "blocks": [{"attn": "drop"}]}
    with pytest.raises(SyncdropError, match="format is 'syncdrop-plan', expected 'syncdrop-profile'"):
        load_profile(_bad(tmp_path, plan_like))
    d = _profile_dict()
    d["num_blocks"] = 12
    with pytest.raises(SyncdropError, match="num_blocks=12 but 10 blocks listed"):
        load_profile(_bad(tmp_path, d))
    with pytest.raises(SyncdropError, match="has 10 blocks but the model has 30"):
        load_profile(_bad(tmp_path, _profile_dict()), num_blocks=30)
    d = _profile_dict()
    d["blocks"][3]["index"] = 7
    with pytest.raises(SyncdropError, match=r"blocks\[3\] must be an object with index 3"):
        load_profile(_bad(tmp_path, d))
    d = _profile_dict()
    d["blocks"][2]["isolated"] = None
    with pytest.raises(SyncdropError, match=r"blocks\[2\]\.isolated must be a finite number"):
        load_profile(_bad(tmp_path, d))
    d = _profile_dict()
    d["baseline_ppl"] = 0
    with pytest.raises(SyncdropError, match="baseline_ppl must be a positive number"):
        load_profile(_bad(tmp_path, d))
    with pytest.raises(SyncdropError, match="non-empty 'blocks' list"):
        load_profile(_bad(tmp_path, {**_profile_dict(), "blocks": []}))


def test_bad_profile_through_the_cli_is_a_syncdrop_error(tmp_path) -> None:
    with pytest.raises(SyncdropError, match="not valid JSON"):
        _plan_cli(["--profile", str(_bad(tmp_path, "")), "--spd", "0.5", "--out", str(tmp_path / "p.json")])
    assert not (tmp_path / "p.json").exists()


def test_bad_plan_files_are_syncdrop_errors(tmp_path) -> None:
    with pytest.raises(SyncdropError, match="plan file not found"):
        parse_plan(str(tmp_path / "missing.json"), 4)
    with pytest.raises(SyncdropError, match="not valid JSON"):
        parse_plan(str(_bad(tmp_path, "nope")), 4)
    with pytest.raises(SyncdropError, match="expected a JSON object with a 'blocks' list"):
        parse_plan(str(_bad(tmp_path, _profile_dict() | {"blocks": "x"})), 4)


def test_a_plan_records_its_profile_relative_to_the_working_directory(profile_path, monkeypatch) -> None:
    """Plans travel between machines: a profile below the working directory is recorded relative to it."""
    monkeypatch.chdir(profile_path.parent.parent)
    absolute = make_plan(load_profile(profile_path.resolve()), spd=0.5)
    assert absolute.meta["profile"]["path"] == f"{profile_path.parent.name}/profile.json"
    outside = Path("/") / "nonexistent-syncdrop" / "profile.json"
    assert portable_path(outside) == str(outside)


def test_config_plan_spells_spd_and_wire_combinations() -> None:
    """``spd:F`` drops the first round(F L) blocks of the order, ``+WIRE`` compresses every sync that stays."""
    order = drop_order(PROG)
    L = len(PROG)
    assert config_plan("spd:0.3", L, order).to_dict() == SyncPlan.dropping(L, sorted(order[:3])).to_dict()
    both = config_plan("spd:0.3+int4:g32", L, order)
    assert both.to_dict() == SyncPlan.dropping(L, sorted(order[:3])).compressed("int4", 32).to_dict()
    assert both.spd_fraction == pytest.approx(0.3) and both.codec_units(64) > 0
    assert config_plan("int8", L, order).to_dict() == parse_plan("int8", L).to_dict()
    with pytest.raises(SyncdropError):
        config_plan("spd:0.3+int3", L, order)
