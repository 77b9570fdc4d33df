"""Streaming blocks from the checkpoint (``TPModel(resident_blocks=k)``, ``syncdrop ppl --stream``): the
same numbers as the all-in-memory model, bit for bit, with one block's weights held at a time."""

from __future__ import annotations

import json
import math

import pytest
import torch

from syncdrop.cli import main
from syncdrop.eval.perplexity import perplexity
from syncdrop.models.loading import resolve_model
from syncdrop.parallel.block_store import BlockStore
from syncdrop.parallel.executor import simulated_model
from syncdrop.plan import BlockSync, Partial, SyncPlan, parse_plan


def test_block_store_holds_at_most_resident_blocks() -> None:
    built: list[int] = []
    store = BlockStore(lambda i: built.append(i) or f"w{i}", 4, resident=2)  # type: ignore[arg-type, return-value]
    assert built == [] and [store[0], store[1], store[0], store[2]] == ["w0", "w1", "w0", "w2"]
    assert built == [0, 1, 2] and store.loads == 3 and len(store.held()) == 2  # block 1, least recent, dropped
    assert store[1] == "w1" and built[-1] == 1  # read again
    store[3] = "donor"  # type: ignore[assignment]
    assert store[3] == "donor" and 3 not in built
    del store[3]
    assert store[3] == "w3" and built[-1] == 3
    eager = BlockStore(lambda i: f"w{i}", 3)  # type: ignore[arg-type, return-value]
    assert eager.loads == 3 and not eager.streams and list(eager) == ["w0", "w1", "w2"]
    with pytest.raises(IndexError):
        eager[3]


PLANS = {
    "none": lambda L: SyncPlan.uniform(L),
    "all": lambda L: parse_plan("all", L),
    "naive": lambda L: parse_plan("all", L, "naive"),
    "partial": lambda L: SyncPlan([BlockSync("drop", Partial(0.5)), *[BlockSync(Partial(0.25))] * (L - 1)]),
}


@pytest.mark.parametrize("family", ["tiny_llama_dir", "tiny_opt_dir", "tiny_qwen2_dir"])
@pytest.mark.parametrize("plan", list(PLANS))
def test_streamed_perplexity_is_bit_identical(family, plan, request) -> None:
    """Layer-wise over streamed blocks (one held) against window by window over all blocks: the same
    per-window NLL, bit for bit; the streamed model read each block once and holds one."""
    src = resolve_model(str(request.getfixturevalue(family)))
    cfg, L = src.config, src.config.num_layers
    windows = torch.randint(3, cfg.vocab_size, (5, 17), generator=torch.Generator().manual_seed(0))
    ref = perplexity(simulated_model(cfg, src.reader, 3, PLANS[plan](L)), windows, batch_size=2, progress=False)
    streamed = simulated_model(cfg, src.reader, 3, PLANS[plan](L), resident_blocks=1)
    assert streamed.blocks.loads == 0
    got = perplexity(streamed, windows, batch_size=2, progress=False)
    assert got.window_nll == ref.window_nll and got.nll_sum == ref.nll_sum
    assert streamed.blocks.loads == L  # each block read once
    # one entry held at a time: the last read is the LM head (the embedding itself when tied)
    assert streamed.blocks.held() == [] and list(streamed.blocks.held_replicated()) == [streamed._head_name]


def test_ppl_stream_flag(tiny_llama_dir, text_file, tmp_path) -> None:
    """``syncdrop ppl --stream`` writes the perplexity of the default path, and says it streamed."""
    out = {}
    for name, extra in (("ref", []), ("stream", ["--stream"])):
        path = tmp_path / f"{name}.json"
        assert main(["ppl", "--model", str(tiny_llama_dir), "--tp", "2", "--plan", "frac:0.5", "--dataset",
                     str(text_file), "--seq-len", "16", "--max-windows", "6", "--batch-size", "2", "-q",
                     "--json", str(path), *extra]) == 0
        out[name] = json.loads(path.read_text())
    assert out["stream"]["stream"] and not out["ref"]["stream"]
    assert out["stream"]["window_nll"] == out["ref"]["window_nll"] and math.isfinite(out["ref"]["ppl"])


@pytest.mark.parametrize("resident", [None, 1])
def test_a_dropped_model_frees_its_weights_at_once(tiny_llama_dir, resident) -> None:
    """Reference counting alone frees a model (no cycle through its block store): a loop that builds a model
    per step (end-to-end distillation re-shards every step) holds one model's weights, not one per step until
    the next garbage collection."""
    import gc
    import weakref

    src = resolve_model(str(tiny_llama_dir))
    gc.disable()
    try:
        model = simulated_model(src.config, src.reader, 2, resident_blocks=resident)
        model.blocks[0]  # noqa: B018 - a streaming store builds on demand
        refs = [weakref.ref(model), weakref.ref(model.blocks)]
        del model
        assert [r() for r in refs] == [None, None]
    finally:
        gc.enable()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_chunked_read_equals_the_whole_read(tiny_llama_dir, dtype) -> None:
    """``TensorSource.read`` (row chunks, each converted as read) gives ``get(name).to(dtype)`` bit for bit,
    with chunks that do not divide the rows."""
    from syncdrop.parallel.weights import TensorSource

    src = resolve_model(str(tiny_llama_dir)).reader
    whole = src.get("embed").to(dtype)
    got = TensorSource(src).read("embed", dtype, rows_per_read=7)
    assert whole.shape[0] > 7 and whole.shape[0] % 7 and got.dtype == dtype and torch.equal(got, whole)
