"""SPD sensitivity profiling (syncdrop/spd/profile.py) on tiny models, with real math.

The fragile-block model: a 4-block tiny Llama whose embeddings are enlarged (so block 0's MLP input is
not dominated by its attention, which otherwise makes block 0 the most sensitive), every other
block's o_proj shrunk, and one middle block's o_proj and down_proj scaled up, so that dropping *its*
attention sync changes its MLP input (``X + A_r`` instead of ``X + sum A``) and the large MLP output a
lot. The calibration windows are sampled from the dense model itself, so any perturbation raises the
expected NLL (it is the KL divergence) and sensitivities are positive in expectation, not noise.
"""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from syncdrop.errors import SyncdropError
from syncdrop.eval.perplexity import perplexity
from syncdrop.models.loading import load_dense, resolve_model
from syncdrop.parallel.executor import simulated_model
from syncdrop.plan import SyncPlan, parse_plan
from syncdrop.spd.cli import add_plan_parser, add_profile_parser
from syncdrop.spd.profile import profile_sensitivity
from syncdrop.tiny_models import TINY, TOKENIZER_CORPUS, build_tiny

L4 = 4
FRAGILE = 2


@pytest.fixture(scope="module")
def tiny4_source(tmp_path_factory):
    from transformers import LlamaConfig

    cfg = LlamaConfig(**{**TINY, "num_hidden_layers": L4}, num_key_value_heads=2, intermediate_size=96,
                      rope_theta=10000.0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    return resolve_model(str(build_tiny(tmp_path_factory.mktemp("tiny4"), cfg, seed=7)))


def _sample(model, n: int, seq: int, seed: int) -> torch.Tensor:
    """``n`` sequences sampled (temperature 1) from ``model`` itself."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, TINY["vocab_size"], (n, 1), generator=g)
    for _ in range(seq - 1):
        p = torch.softmax(model(ids)[:, -1].float(), -1)
        ids = torch.cat([ids, torch.multinomial(p, 1, generator=g)], 1)
    return ids


def _fragile_weights(src, fragile: int | None) -> dict[str, torch.Tensor]:
    W = load_dense(src)
    W["embed"] = W["embed"] * 5.0
    W["lm_head"] = W["lm_head"] * 3.0  # sharper predictions: larger, cleaner perplexity deltas
    for j in range(src.config.num_layers):
        W[f"layers.{j}.o.weight"] = W[f"layers.{j}.o.weight"] * (4.0 if j == fragile else 0.5)
        if j == fragile:
            W[f"layers.{j}.down.weight"] = W[f"layers.{j}.down.weight"] * 4.0
    return W


@pytest.mark.parametrize("seed", [0, 1])
def test_fragile_block_ranks_most_sensitive_in_both_definitions(tiny4_source, seed) -> None:
    model = simulated_model(tiny4_source.config, _fragile_weights(tiny4_source, FRAGILE), 2)
    windows = _sample(model, 4, 32, seed)
    prof = profile_sensitivity(model, windows, batch_size=2, progress=False)
    prog = [b.progressive for b in prof.blocks]
    iso = [b.isolated for b in prof.blocks]
    assert max(range(L4), key=prog.__getitem__) == FRAGILE, prog
    assert max(range(L4), key=iso.__getitem__) == FRAGILE, iso
    others = max(max(abs(s) for j, s in enumerate(v) if j != FRAGILE) for v in (prog, iso))
    assert min(prog[FRAGILE], iso[FRAGILE]) > 5 * others  # a clear margin, not a coin toss
    assert model.plan.dropped == []  # the caller's plan is restored


def test_cached_profile_equals_perplexity_from_scratch(tiny4_source) -> None:
    """Every ppl in the profile equals perplexity() run from the token ids with model.plan set, and the
    block-forward count is W * (L + L(L+1) - 1) against W * L * (2L+1) from scratch."""
    model = simulated_model(tiny4_source.config, _fragile_weights(tiny4_source, FRAGILE), 2)
    windows = _sample(model, 3, 24, 5)  # 3 windows at batch size 2: one short batch
    prof = profile_sensitivity(model, windows, batch_size=2, progress=False)

    def ref(dropped) -> float:
        model.plan = SyncPlan.dropping(L4, dropped)
        return perplexity(model, windows, batch_size=1, progress=False).ppl

    def close(a: float, b: float) -> bool:
        return abs(a - b) <= 1e-5 * abs(b)

    base = ref([])
    assert close(prof.baseline_ppl, base)
    for i, b in enumerate(prof.blocks):
        assert b.index == i
        p_prog, p_iso, p_next = ref(range(i, L4)), ref([i]), ref(range(i + 1, L4))
        assert close(b.ppl_progressive, p_prog) and close(b.ppl_isolated, p_iso)
        assert abs(b.progressive - (p_prog - p_next)) <= 1e-5 * p_prog
        assert abs(b.isolated - (p_iso - base)) <= 1e-5 * p_iso
    # progressive deltas telescope: the sum from i on is ppl(SPD on i..L-1) - baseline
    for i in range(L4):
        tail = sum(b.progressive for b in prof.blocks[i:])
        assert abs(tail - (prof.blocks[i].ppl_progressive - prof.baseline_ppl)) <= 1e-9 * prof.baseline_ppl
    W = windows.shape[0]
    assert prof.block_forwards_done == W * (L4 + L4 * (L4 + 1) - 1) == 3 * 23
    assert prof.block_forwards_naive == W * L4 * (2 * L4 + 1) == 3 * 36
    assert prof.cache_bytes == W * 24 * TINY["hidden_size"] * 4 * L4


def test_run_blocks_records_block_inputs_and_resumes(tiny_llama_dir) -> None:
    src = resolve_model(str(tiny_llama_dir))
    model = simulated_model(src.config, src.reader, 2, SyncPlan.dropping(2, [1]))
    ids = torch.randint(3, 300, (2, 9), generator=torch.Generator().manual_seed(0))
    rec: list[torch.Tensor] = []
    ctx = model.context(2, 9)
    full = model.run_blocks(model.embed_tokens(ids), 0, ctx, record=rec)
    assert [tuple(t.shape) for t in rec] == [(1, 18, 48)] * 2
    assert torch.equal(full, model.hidden_states(ids))
    assert torch.equal(model.run_blocks(rec[1], 1, ctx), full)


def _calib_file(tmp_path):
    path = tmp_path / "calib.txt"
    path.write_text("".join(TOKENIZER_CORPUS) * 6)
    return path


def _run(argv: list[str]) -> int:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="command", required=True)
    add_profile_parser(sub)
    add_plan_parser(sub)
    args = ap.parse_args(argv)
    return args.func(args)


def test_profile_cli_writes_profile_png_and_a_usable_plan(tiny_llama_dir, tmp_path, capsys) -> None:
    from syncdrop.eval.perplexity import make_windows
    from syncdrop.runtime import build

    calib = _calib_file(tmp_path)
    out = tmp_path / "prof" / "profile.json"
    assert _run(["profile", "--model", str(tiny_llama_dir), "--tp", "2", "--calib", str(calib),
                 "--samples", "3", "--seq-len", "16", "--batch-size", "2", "--out", str(out), "-q"]) == 0
    d = json.loads(out.read_text())
    assert d["format"] == "syncdrop-profile" and d["tp"] == 2 and d["num_blocks"] == 2
    assert d["calib"]["windows"] == 3 and d["calib"]["seq_len"] == 16 and d["calib"]["dataset"] == "calib.txt"
    assert [b["index"] for b in d["blocks"]] == [0, 1]
    assert set(d["blocks"][0]) == {"index", "progressive", "isolated", "ppl_progressive", "ppl_isolated"}
    assert d["block_forwards"]["done"] == 3 * (2 + 2 * 3 - 1) and d["block_forwards"]["naive"] == 3 * 2 * 5
    assert "command" in d["provenance"]
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "block forwards" in capsys.readouterr().out

    # the baseline is `syncdrop ppl --plan none` on the same windows
    built = build(str(tiny_llama_dir), 2, "none", executor="simulated", progress=False)
    ids = built.source.load_tokenizer()(calib.read_text(), add_special_tokens=False)["input_ids"]
    ref = perplexity(built.model, make_windows(ids, 16, 3), progress=False).ppl
    assert abs(d["baseline_ppl"] - ref) <= 1e-5 * ref

    plan_path = tmp_path / "plan.json"
    assert _run(["plan", "--profile", str(out), "--spd", "0.5", "--out", str(plan_path)]) == 0
    plan = parse_plan(str(plan_path), 2)
    sens = [b["progressive"] for b in d["blocks"]]
    assert plan.dropped == [min(range(2), key=lambda i: (sens[i], -i))]
    # accepted by --plan like any plan file: build + evaluate under it
    built = build(str(tiny_llama_dir), 2, str(plan_path), executor="simulated", progress=False)
    assert built.plan.dropped == plan.dropped
    got = perplexity(built.model, make_windows(ids, 16, 3), progress=False).ppl
    want = d["blocks"][plan.dropped[0]]["ppl_isolated"]
    assert abs(got - want) <= 1e-5 * want


def test_profile_cli_errors(tiny_llama_dir, tmp_path) -> None:
    calib = _calib_file(tmp_path)
    base = ["profile", "--model", str(tiny_llama_dir), "--calib", str(calib), "--seq-len", "16",
            "--out", str(tmp_path / "p.json"), "-q", "--no-png"]
    with pytest.raises(SyncdropError, match="--tp must be at least 2"):
        _run([*base, "--tp", "1"])
    too_few = r"\(for --skip 0 --samples 1000\) has only \d+ windows of 16 tokens; 1000 are needed"
    with pytest.raises(SyncdropError, match=too_few):
        _run([*base, "--tp", "2", "--samples", "1000"])
    with pytest.raises(SyncdropError, match="not found"):
        _run([*base[:4], str(tmp_path / "missing.txt"), *base[5:], "--tp", "2"])
    with pytest.raises(SyncdropError, match="--samples must be at least 1"):
        _run([*base, "--tp", "2", "--samples", "0"])
    assert not (tmp_path / "p.json").exists()


@pytest.mark.parametrize("with_donor", [False, True])
def test_streamed_profile_equals_the_cached_one(tiny4_source, with_donor) -> None:
    """A model that streams its blocks is profiled in one sweep over the blocks (each read once): every
    perplexity equals the cached path's bit for bit, with the same number of block forwards; with a donor
    (the recovered profile), the donor's blocks run where a block is dropped, in both."""
    cfg = tiny4_source.config
    weights = _fragile_weights(tiny4_source, FRAGILE)
    windows = _sample(simulated_model(cfg, weights, 2), 3, 24, 5)
    donor_w = _fragile_weights(tiny4_source, 1) if with_donor else None
    profiles = []
    for resident in (None, 1):
        model = simulated_model(cfg, weights, 2, resident_blocks=resident)
        donor = simulated_model(cfg, donor_w, 2, resident_blocks=resident) if with_donor else None
        profiles.append(profile_sensitivity(model, windows, batch_size=2, progress=False, donor=donor))
        if resident:
            # each block read once; one entry held at the end (the LM head: read last, for the logits)
            assert model.blocks.loads == L4 and len(model.blocks.held()) + len(model.blocks.held_replicated()) == 1
    cached, streamed = profiles
    assert streamed.baseline_ppl == cached.baseline_ppl and streamed.blocks == cached.blocks
    assert streamed.block_forwards_done == cached.block_forwards_done


def test_compression_profile_equals_perplexity_from_scratch(tiny4_source) -> None:
    """Every ppl of the compression profile (int4 in groups of 8, every sync point progressive and isolated)
    equals perplexity() from the token ids under the plan compressing those points; the deltas telescope;
    compressing every point is the plan ``int4:g8``."""
    from syncdrop.compression.profile import compressing, profile_compression
    from syncdrop.plan.wire import WireFormat

    model = simulated_model(tiny4_source.config, _fragile_weights(tiny4_source, FRAGILE), 3)
    windows = _sample(model, 3, 24, 5)
    wire = WireFormat("int4", 8)
    prof = profile_compression(model, windows, wire, batch_size=2, progress=False)

    def ref(points) -> float:
        model.plan = compressing(L4, frozenset(points), wire)
        return perplexity(model, windows, batch_size=1, progress=False).ppl

    def close(a: float, b: float) -> bool:
        return abs(a - b) <= 1e-5 * abs(b)

    base = ref([])
    assert close(prof.baseline_ppl, base) and model.plan.blocks[0].is_dense
    assert [(p.block, p.point) for p in prof.points[:3]] == [(0, "attn"), (0, "mlp"), (1, "attn")]
    for k, p in enumerate(prof.points):
        p_prog, p_iso = ref(range(k, 2 * L4)), ref([k])
        assert close(p.ppl_progressive, p_prog) and close(p.ppl_isolated, p_iso), k
        assert abs(p.isolated - (p_iso - base)) <= 1e-5 * p_iso
    assert sum(p.progressive for p in prof.points) == pytest.approx(prof.all_compressed_ppl - prof.baseline_ppl)
    model.plan = parse_plan("int4:g8", L4)
    assert close(prof.all_compressed_ppl, perplexity(model, windows, progress=False).ppl)
    assert prof.all_compressed_ppl != prof.baseline_ppl  # int4 in groups of 8 moves it
    assert prof.block_forwards == 3 * (L4 + 2 * L4 * (L4 + 1) - 1) == 3 * 43  # 4L - 1 evaluations, from their block


def test_compression_profile_cli(tiny_llama_dir, tmp_path, capsys) -> None:
    """`syncdrop profile --wire int8:g8` writes one entry per sync point; a bad format or a group size that
    does not divide the hidden size is refused before anything is written."""
    calib = _calib_file(tmp_path)
    out = tmp_path / "wire.json"
    base = ["profile", "--model", str(tiny_llama_dir), "--tp", "2", "--calib", str(calib), "--samples", "2",
            "--seq-len", "16", "--out", str(out), "-q"]
    assert _run([*base, "--wire", "int8:g8"]) == 0
    d = json.loads(out.read_text())
    assert d["kind"] == "compression" and d["wire"] == "int8:g8" and d["num_blocks"] == 2
    assert [(p["block"], p["point"]) for p in d["points"]] == [(0, "attn"), (0, "mlp"), (1, "attn"), (1, "mlp")]
    assert "every point compressed" in capsys.readouterr().out
    out.unlink()
    with pytest.raises(SyncdropError, match="--wire 'int3': wire format must be one of"):
        _run([*base, "--wire", "int3"])
    with pytest.raises(SyncdropError, match="wire group size 32 does not divide the hidden size 48"):
        _run([*base, "--wire", "int4:g32"])
    assert not out.exists()
