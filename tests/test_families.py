"""Qwen3, Phi-3 and Llama 3.x rope scaling on syncdrop's side (loading, sharding, SPD, head grouping, B2B), and
Gemma's refusal. References are transformers' own models on the same files (tiny random checkpoints, conftest);
the TP 1-4 logits parity, the drop variants at TP=1 and bfloat16 are in tests/test_parity.py, head grouping's
exactness in tests/test_spd_distill.py, the distributed runtime in tests/test_distributed.py."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from syncdrop.cli import main
from syncdrop.errors import SyncdropError
from syncdrop.models.config import model_names
from syncdrop.models.hf_reader import checkpoint_name, checkpoint_slice, config_from_hf, fused_projections
from syncdrop.models.loading import load_dense, resolve_model
from syncdrop.parallel.block import norm
from syncdrop.parallel.executor import simulated_model
from syncdrop.parallel.sharding import ShardLayout
from syncdrop.parallel.weights import TensorSource, block_weights, local_geometry
from syncdrop.plan import SyncPlan
from syncdrop.spd.distill import DistillSettings, distill
from syncdrop.spd.head_grouping import _score_maps_distance
from syncdrop.tiny_models import LLAMA3_ROPE

NEW = ["tiny_qwen3_dir", "tiny_phi3_dir"]


def _ids(vocab: int, batch: int = 2, seq: int = 21, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


def _hf(path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()


def _reference_tensors(hf: torch.nn.Module, cfg) -> dict[str, torch.Tensor]:
    """Canonical name -> transformers' parameter, cut by hand from Phi-3's fused projections (rows q, k, v and
    gate, up, as Phi3Attention / Phi3MLP slice them), written out independently of the reader."""
    d, H, K, F = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size
    out = {"embed": hf.model.embed_tokens.weight, "final_norm.weight": hf.model.norm.weight}
    if not cfg.tie_embeddings:
        out["lm_head"] = hf.lm_head.weight
    for i, layer in enumerate(hf.model.layers):
        a, m, p = layer.self_attn, layer.mlp, f"layers.{i}."
        out |= {p + "attn_norm.weight": layer.input_layernorm.weight, p + "o.weight": a.o_proj.weight,
                p + "mlp_norm.weight": layer.post_attention_layernorm.weight, p + "down.weight": m.down_proj.weight}
        if hasattr(a, "qkv_proj"):
            q, k, v = a.qkv_proj.weight.split([H * d, K * d, K * d])
            gate, up = m.gate_up_proj.weight.split([F, F])
        else:
            q, k, v, gate, up = (a.q_proj.weight, a.k_proj.weight, a.v_proj.weight, m.gate_proj.weight,
                                 m.up_proj.weight)
        out |= {p + "q.weight": q, p + "k.weight": k, p + "v.weight": v, p + "gate.weight": gate, p + "up.weight": up}
        if hasattr(a, "q_norm"):
            out |= {p + "q_norm.weight": a.q_norm.weight, p + "k_norm.weight": a.k_norm.weight}
    return {k: v.detach() for k, v in out.items()}


@pytest.mark.parametrize("family", NEW)
def test_new_families_load_every_tensor_as_transformers(family, request) -> None:
    """Config and every canonical tensor bit for bit; the reader's partial reads (what each rank of the
    distributed runtime asks for) equal slices of the whole tensor, also inside Phi-3's fused projections."""
    path = request.getfixturevalue(family)
    src = resolve_model(str(path))
    c, hf = src.config, _hf(path)
    h = hf.config
    head_dim = getattr(h, "head_dim", None) or h.hidden_size // h.num_attention_heads  # as the attention reads it
    assert (c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size) == (
        h.num_attention_heads, h.num_key_value_heads, head_dim, h.intermediate_size)
    assert (c.norm_eps, c.rope_theta, c.rope_scaling, c.tie_embeddings) == (
        h.rms_norm_eps, h.rope_parameters["rope_theta"], None, h.tie_word_embeddings)
    assert c.qk_norm == (family == "tiny_qwen3_dir") and not (c.qkv_bias or c.o_bias or c.mlp_bias)
    if c.qk_norm:  # Qwen3's head_dim is its own key: here q is twice as wide as the hidden state
        assert c.num_heads * c.head_dim == 2 * c.hidden_size
    ref = _reference_tensors(hf, c)
    dense = load_dense(src)
    assert sorted(dense) == sorted(ref) == sorted(model_names(c))
    for name, t in dense.items():
        assert torch.equal(t, ref[name]), name
    reader = src.reader
    g = torch.Generator().manual_seed(0)
    for name in [n for n in reader.names() if n.startswith("layers.1.")]:
        full = ref[name]
        assert tuple(reader.shape(name)) == tuple(full.shape)
        for idx in (torch.arange(full.shape[0]), torch.arange(3, full.shape[0] - 2), torch.randperm(full.shape[0],
                    generator=g)[:7], torch.tensor([full.shape[0] - 1, 0, -1]), torch.tensor([], dtype=torch.long)):
            assert torch.equal(reader.get_rows(name, idx), full[idx]), name
        if full.dim() == 2:
            cols = torch.tensor([full.shape[1] - 1, 2, 5, 2])
            assert torch.equal(reader.get_cols(name, cols), full[:, cols]), name
    with pytest.raises(IndexError, match="out of bounds"):  # a part's rows end where the part ends
        reader.get_rows("layers.0.q.weight", torch.tensor([c.num_heads * c.head_dim]))


def test_phi3_fused_names_for_writers(tiny_phi3_dir, tmp_path) -> None:
    """What an exporter needs: which canonical tensors each fused Phi-3 tensor stacks, in row order, and a
    loud error where a per-tensor name is asked for a fused part; a fused tensor whose rows do not match
    config.json is refused rather than cut wrongly."""
    cfg = resolve_model(str(tiny_phi3_dir)).config
    assert fused_projections(cfg) == {"self_attn.qkv_proj": ("q", "k", "v"), "mlp.gate_up_proj": ("gate", "up")}
    assert checkpoint_slice("layers.1.k.weight", cfg) == ("layers.1.self_attn.qkv_proj.weight", (48, 72))
    assert checkpoint_slice("layers.0.up.weight", cfg) == ("layers.0.mlp.gate_up_proj.weight", (96, 192))
    assert checkpoint_name("layers.0.o.weight", cfg) == "layers.0.self_attn.o_proj.weight"
    with pytest.raises(ValueError, match="qkv_proj"):
        checkpoint_name("layers.0.q.weight", cfg)
    bad = Path(shutil.copytree(tiny_phi3_dir, tmp_path / "m"))
    raw = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**raw, "num_key_value_heads": 2}))
    with pytest.raises(SyncdropError, match="qkv_proj.weight has 96 rows, config.json implies 80"):
        resolve_model(str(bad))


@pytest.mark.parametrize("family", NEW)
def test_spd_at_tp2_changes_the_output(family, request) -> None:
    """Guard against a plan silently ignored: all-SPD at TP=2 (and TP=4, an uneven split) moves the logits."""
    src = resolve_model(str(request.getfixturevalue(family)))
    ids = _ids(src.config.vocab_size)
    for tp in (2, 4):
        model = simulated_model(src.config, src.reader, tp)
        full = model(ids)
        model.plan = SyncPlan.uniform(src.config.num_layers, "drop")
        assert (model(ids) - full).abs().max().item() > 1e-3


@pytest.mark.parametrize("family", NEW)
def test_head_grouping_attention_maps_are_transformers(family, request) -> None:
    """Head grouping's per-head distances come from the attention maps transformers computes (eager attention,
    ``output_attentions``): Qwen3's q/k norms and Phi-3's fused q/k rows included."""
    path = request.getfixturevalue(family)
    src = resolve_model(str(path))
    cfg, H = src.config, src.config.num_heads
    ids = _ids(cfg.vocab_size, seq=13)
    with torch.no_grad():
        maps = _hf(path)(ids, output_attentions=True).attentions[0]  # (B, H, S, S): block 0's softmax maps
    flat = maps.transpose(0, 1).reshape(H, -1).double()
    want = (flat[:, None] - flat[None]).pow(2).sum(-1)  # (H, H)
    teacher = simulated_model(cfg, src.reader, 1)
    per_head = ShardLayout.build(cfg, H)
    geo = local_geometry(cfg, per_head, range(H))
    w = block_weights(TensorSource(src.reader), cfg, geo, per_head, 0)
    x, ctx = teacher.embed_tokens(ids), teacher.context(*ids.shape)
    got = _score_maps_distance(norm(x, w.attn_norm_w, None, cfg), w, geo, cfg, ctx)
    assert want.max() > 1e-2
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


def test_qwen3_hg_b2b_distillation_lowers_held_out_loss(tiny_qwen3_dir, tmp_path) -> None:
    """Head grouping + B2B at TP=2 on Qwen3 (block 1; block 0 dropped zero-shot): the student-teacher MSE on
    held-out windows drops, the q/k norms are trained with the rest, and the directory runs as a model."""
    src = resolve_model(str(tiny_qwen3_dir))
    L = src.config.num_layers
    w = _ids(src.config.vocab_size, 10, 24, seed=1)
    plan = SyncPlan.uniform(L, "drop")
    m = distill(src, 2, plan, {0: "zs", 1: "hg+b2b"}, w[:8], w[8:], tmp_path / "ck",
                DistillSettings(lr=5e-4, epochs=3), {"dataset": "random ids"}, progress=False)
    st = m["blocks"]["1"]["stats"]
    assert st["heldout_loss"] < 0.95 * st["heldout_loss_zs"], st
    ck = resolve_model(str(tmp_path / "ck"))
    for n in ("layers.1.q_norm.weight", "layers.1.k_norm.weight"):
        assert not torch.equal(ck.reader.get(n), src.reader.get(n)), n
    assert torch.equal(ck.reader.get("layers.0.q_norm.weight"), src.reader.get("layers.0.q_norm.weight"))
    assert torch.isfinite(simulated_model(ck.config, ck.reader, 2, plan)(w[:2])).all()


def _llama3_old_style(path: Path) -> None:
    """Rewrite a transformers-5 ``rope_parameters`` config as the hub's Llama 3.1 files have it: ``rope_theta``
    and ``rope_scaling`` keys."""
    cfg = json.loads((path / "config.json").read_text())
    params = cfg.pop("rope_parameters")
    cfg |= {"rope_theta": params.pop("rope_theta"), "rope_scaling": params}
    (path / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("style", ["rope_parameters", "rope_scaling"])
def test_llama3_rope_scaling_matches_transformers(tiny_llama3_dir, tmp_path, style) -> None:
    """A Llama 3.x ``llama3`` rope scaling (one frequency kept, one interpolated, two divided by the factor)
    is read from either config style and matches transformers at TP 1 and 3; without it the logits differ
    (the scaling is in effect at these positions)."""
    path = tiny_llama3_dir
    if style == "rope_scaling":
        path = Path(shutil.copytree(tiny_llama3_dir, tmp_path / "m"))
        _llama3_old_style(path)
    src = resolve_model(str(path))
    assert src.config.rope_scaling == LLAMA3_ROPE
    ids = _ids(src.config.vocab_size, seq=40)
    with torch.no_grad():
        ref = _hf(path)(ids).logits
    for tp in (1, 3):
        out = simulated_model(src.config, src.reader, tp)(ids)
        assert (out - ref).abs().max().item() <= 2e-4
    plain = dataclasses.replace(src.config, rope_scaling=None)
    assert (simulated_model(plain, src.reader, 1)(ids) - ref).abs().max().item() > 1e-2


@pytest.mark.parametrize("arch, name", [("Gemma2ForCausalLM", "Gemma 2"), ("Gemma3ForCausalLM", "Gemma 3")])
def test_gemma_is_refused_with_the_reason(tmp_path, capsys, arch, name) -> None:
    """`syncdrop info` on a Gemma 2/3 directory: exit 2, one line saying why (a norm on the attention output)."""
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": [arch], "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2,
        "vocab_size": 10, "intermediate_size": 32}))
    assert main(["info", "--model", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err, err
    assert f"{arch} is not supported: {name} normalises the attention output" in err
    assert "the norm of a sum is not the sum of the norms" in err


def test_config_refusals_name_what_is_unsupported() -> None:
    """Phi-3 long-context RoPE (longrope, or its old name su), a partial rotary factor, an unknown scaling: one
    line each, raised when config.json is read."""
    base = {"architectures": ["Phi3ForCausalLM"], "hidden_size": 64, "num_attention_heads": 4,
            "num_hidden_layers": 2, "vocab_size": 10, "intermediate_size": 32}
    factors = {"short_factor": [1.0] * 8, "long_factor": [2.0] * 8, "original_max_position_embeddings": 16}
    for kind in ("longrope", "su"):
        with pytest.raises(SyncdropError, match=f"unsupported rope scaling '{kind}' \\(Phi-3's long-context"):
            config_from_hf({**base, "rope_scaling": {"type": kind, **factors}})
    with pytest.raises(SyncdropError, match="partial_rotary_factor=0.75"):
        config_from_hf({**base, "partial_rotary_factor": 0.75})
    with pytest.raises(SyncdropError, match="partial_rotary_factor=0.5"):
        config_from_hf({**base, "rope_parameters": {"rope_theta": 1e4, "rope_type": "default",
                                                    "partial_rotary_factor": 0.5}})
    with pytest.raises(SyncdropError, match="unsupported rope scaling 'yarn': syncdrop supports"):
        config_from_hf({**base, "architectures": ["Qwen3ForCausalLM"], "rope_scaling": {"rope_type": "yarn"}})
    phi = config_from_hf({**base, "rope_parameters": {"rope_theta": 1e4, "rope_type": "default",
                                                      "partial_rotary_factor": 1.0}, "sliding_window": 2047})
    assert (phi.rope_scaling, phi.sliding_window, phi.norm_eps, phi.max_positions) == (None, 2047, 1e-5, 4096)
    qwen3 = config_from_hf({**base, "architectures": ["Qwen3ForCausalLM"], "attention_bias": True})
    assert (qwen3.head_dim, qwen3.qk_norm, qwen3.qkv_bias, qwen3.o_bias) == (128, True, True, True)
