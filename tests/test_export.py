"""``syncdrop export`` against its references: stock transformers, the original model, and syncdrop's own
simulated executor on the distilled directory the export came from (no vLLM needed here; the engine
tests are tests/test_vllm_*.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from syncdrop.cli import main
from syncdrop.models.loading import resolve_model
from syncdrop.plan import SyncPlan
from syncdrop.runtime import choose_runtime
from syncdrop.serve.export import export_model
from syncdrop.spd.distill import DistillSettings, distill


def _ids(vocab: int, n: int = 2, seq: int = 24, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, vocab, (n, seq), generator=torch.Generator().manual_seed(seed))


def _hf_logits(path: str, ids: torch.Tensor, **kw) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, trust_remote_code=False, **kw).eval()
    with torch.inference_mode():
        return m(ids).logits


def _sim_logits(spec: str, tp: int, ids: torch.Tensor, plan: str | None = None) -> torch.Tensor:
    built = choose_runtime("simulated", "cpu").build(spec, tp, plan, progress=False)
    with torch.inference_mode():
        return built.model.logits(built.model.hidden_states(ids))


@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_opt_dir", "tiny_qwen2_dir"])
def test_plan_none_is_the_original_model_in_stock_transformers(fixture, tmp_path, request) -> None:
    src = request.getfixturevalue(fixture)
    res = export_model(str(src), 2 if fixture != "tiny_qwen2_dir" else 1, tmp_path / "out", "none", progress=False)
    cfg = json.loads((res.out / "config.json").read_text())
    assert cfg["architectures"] == json.loads((src / "config.json").read_text())["architectures"]
    ids = _ids(resolve_model(str(src)).config.vocab_size)
    assert torch.equal(_hf_logits(str(res.out), ids), _hf_logits(str(src), ids))


def test_smollm2_gguf_exports_to_the_model_transformers_reads_from_the_gguf(smollm2_source, smollm2_hf, tmp_path):
    """The GGUF (llama.cpp's permuted q/k, Q4_1) written as a transformers directory: stock transformers on the
    export equals transformers' own GGUF loader (fp32 dequantised)."""
    res = export_model("smollm2", 3, tmp_path / "smol", "none", progress=False)
    ids = _ids(smollm2_source.config.vocab_size, n=1, seq=32)
    with torch.inference_mode():
        ref = smollm2_hf(ids).logits
    torch.testing.assert_close(_hf_logits(str(res.out), ids), ref, atol=1e-4, rtol=0)
    tok = resolve_model(str(res.out)).load_tokenizer()
    text = "Tensor parallelism splits every layer"
    assert tok(text)["input_ids"] == smollm2_source.load_tokenizer()(text)["input_ids"]


@pytest.fixture(scope="module")
def opt_grouped(tiny_opt_dir, tmp_path_factory) -> Path:
    """Tiny OPT (6 heads, no GQA: heads move one by one) with block 0 head-grouped and distilled for TP=2."""
    src = resolve_model(str(tiny_opt_dir))
    out = tmp_path_factory.mktemp("opt_hg") / "distilled"
    w = _ids(src.config.vocab_size, n=6, seq=16, seed=2)  # calibration on which HG splits the heads {0,2,4}+{1,3,5}
    plan = SyncPlan.dropping(src.config.num_layers, [0])
    distill(src, 2, plan, {0: "hg+b2b"}, w[:4], w[4:], out, DistillSettings(lr=1e-3, epochs=1, keep_best=False),
            {"dataset": "random ids"}, progress=False)
    return out


def test_head_grouping_is_baked_into_the_weights(opt_grouped, tmp_path) -> None:
    """The export, split contiguously (syncdrop's default layout, vLLM's split), computes what syncdrop computes
    on the distilled directory with its head-grouping layout; the permutation really moved heads."""
    ckpt = resolve_model(str(opt_grouped)).spd
    order = ckpt.blocks[0]["head_order"]
    assert {frozenset(order[:3]), frozenset(order[3:])} != {frozenset({0, 1, 2}), frozenset({3, 4, 5})}
    res = export_model(str(opt_grouped), 2, tmp_path / "out", progress=False)
    assert res.permuted_blocks == [0] and res.distilled_blocks == [0]
    assert res.architecture == "SyncdropOPTForCausalLM"
    exported = resolve_model(str(res.out))
    assert exported.own_plan().to_dict()["blocks"] == ckpt.plan.to_dict()["blocks"] and exported.trained.tp == 2
    ids = _ids(exported.config.vocab_size)
    want = _sim_logits(str(opt_grouped), 2, ids)
    torch.testing.assert_close(_sim_logits(str(res.out), 2, ids), want, atol=1e-5, rtol=0)
    # without the permutation the same weights give another model: the baking is what makes them equal
    assert (_sim_logits(str(tiny_opt_dir_of(opt_grouped)), 2, ids, "blocks:0") - want).abs().max() > 1e-3


def tiny_opt_dir_of(distilled: Path) -> str:
    return resolve_model(str(distilled)).spd.base_model


def _cli(capsys, *args: str) -> tuple[int, str]:
    code = main(["export", "-q", *args])
    return code, capsys.readouterr().err


def test_bad_input_exits_2_and_writes_nothing(tiny_llama_dir, tmp_path, capsys) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    code, err = _cli(capsys, "--model", str(tiny_llama_dir), "--tp", "2", "--out", str(out))
    assert code == 2 and "--out" in err and "--force" in err and (out / "keep.txt").read_text() == "mine"

    bad_plan = tmp_path / "plan.json"
    SyncPlan.dropping(5, [1]).save(bad_plan)
    cases = [
        (["--model", "smollm2", "--tp", "2"], "--tp 2: vLLM cannot serve it"),
        (["--model", str(tiny_llama_dir), "--tp", "2", "--plan", str(bad_plan)], "has 5 blocks but the model has 2"),
        (["--model", str(tiny_llama_dir), "--tp", "2", "--plan", "partial:0.5"], "partial-sync (CAAT-Net) plans"),
        (["--model", str(tiny_llama_dir), "--tp", "0"], "--tp must be at least 1"),
    ]
    for args, message in cases:
        code, err = _cli(capsys, *args, "--out", str(tmp_path / "new"))
        assert code == 2 and message in err and err.count("\n") == 1, (args, err)
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    code, err = _cli(capsys, "--model", str(gpt2), "--tp", "1", "--out", str(tmp_path / "new"))
    assert code == 2 and "architecture 'GPT2LMHeadModel' unsupported" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gpt2", "out", "plan.json"]  # no half-written sibling


def test_force_replaces_and_a_failed_write_keeps_the_old_directory(tiny_llama_dir, tmp_path, capsys, monkeypatch):
    out = tmp_path / "out"
    assert main(["export", "-q", "--model", str(tiny_llama_dir), "--tp", "2", "--out", str(out)]) == 0
    assert "SyncdropLlama" not in (out / "config.json").read_text()
    import syncdrop.serve.export as ex

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(ex, "hf_tensor_name", boom)
    with pytest.raises(OSError):
        export_model(str(tiny_llama_dir), 2, out, "all", force=True, progress=False)
    assert "SyncdropLlama" not in (out / "config.json").read_text()
    monkeypatch.undo()
    assert main(["export", "-q", "--model", str(tiny_llama_dir), "--tp", "2", "--plan", "all", "--out", str(out),
                 "--force"]) == 0
    assert json.loads((out / "config.json").read_text())["architectures"] == ["SyncdropLlamaForCausalLM"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
