"""lm-evaluation-harness: the ``syncdrop`` model against transformers, the local tasks against
lm-eval's official task configs, and ``syncdrop eval``.

References: transformers' own model on the tiny checkpoints, with lm-eval's tokenization, rolling-window
and left-truncation conventions written out here, for log-likelihoods (plain, rolling, truncated,
chunked) and greedy generation; lm-eval's installed task YAMLs and literal first-document prompts for
the local tasks.
"""

from __future__ import annotations

import inspect
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from lm_eval.api.instance import Instance
from transformers import AutoModelForCausalLM, AutoTokenizer

from syncdrop.cli import main
from syncdrop.errors import SyncdropError
from syncdrop.eval.harness import SyncdropLM
from syncdrop.eval.tasks import CONFIG_DIR, check_data, mmlu_subjects, task_manager
from syncdrop.runtime import build

PAIRS = [
    ("The quick brown fox", " jumps over the lazy dog."),
    ("Tensor parallelism splits ", "each layer across devices."),  # trailing space moves to the continuation
    ("", "Sync points are all-reduce operations."),  # empty context: BOS is the context
    ("The quick brown fox jumps over the lazy dog. Answer:", " A"),  # these two differ in their last token
    ("The quick brown fox jumps over the lazy dog. Answer:", " B"),  # only: one forward row scores both
    ("Sync points are all-reduce operations after attention and", " the MLP."),
    ("A", " b"),
]


def _requests(kind: str, args_list: list[tuple]) -> list[Instance]:
    return [Instance(request_type=kind, doc={}, arguments=a, idx=i) for i, a in enumerate(args_list)]


def _lm(model_dir: Path, tp: int = 1, plan: str = "none", **kw) -> SyncdropLM:
    built = build(str(model_dir), tp, plan, executor="simulated", progress=False)
    return SyncdropLM(built=built, progress=False, **kw)


def reference_loglikelihood(hf, tok, context: str, continuation: str) -> tuple[float, bool]:
    """lm-eval's convention (TemplateLM.loglikelihood / _encode_pair), scored by transformers."""
    n = len(context) - len(context.rstrip())
    if n:
        context, continuation = context[:-n], context[-n:] + continuation
    if context:
        whole, ctx = tok.encode(context + continuation), tok.encode(context)
        ctx_ids, cont_ids = ctx, whole[len(ctx):]
    else:
        ctx_ids, cont_ids = [tok.bos_token_id], tok.encode(continuation, add_special_tokens=False)
    ids = torch.tensor([ctx_ids + cont_ids])
    with torch.no_grad():
        logp = F.log_softmax(hf(ids[:, :-1]).logits[0].float(), dim=-1)[-len(cont_ids):]
    target = torch.tensor(cont_ids)
    return logp.gather(-1, target[:, None]).sum().item(), bool((logp.argmax(-1) == target).all())


@pytest.mark.parametrize("fixture, tp", [("tiny_llama_dir", 1), ("tiny_llama_dir", 3), ("tiny_opt_dir", 3)])
def test_loglikelihood_matches_transformers(fixture, tp, request) -> None:
    model_dir = request.getfixturevalue(fixture)
    lm = _lm(model_dir, tp, batch_size=4)
    got = lm.loglikelihood(_requests("loglikelihood", PAIRS), disable_tqdm=True)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(model_dir)
    for (ctx, cont), (ll, greedy) in zip(PAIRS, got, strict=True):
        ref_ll, ref_greedy = reference_loglikelihood(hf, tok, ctx, cont)
        assert math.isclose(ll, ref_ll, rel_tol=1e-5, abs_tol=1e-4), (ctx, cont, ll, ref_ll)
        assert greedy == ref_greedy


def test_batched_equals_unbatched_and_tp3_equals_tp1(tiny_llama_dir) -> None:
    reqs = _requests("loglikelihood", PAIRS)
    one = _lm(tiny_llama_dir, 1, batch_size=1)
    base = one.loglikelihood(reqs, disable_tqdm=True)
    a, b = (one.tok_encode(PAIRS[3][0] + x) for x in (" A", " B"))
    assert a[:-1] == b[:-1] and a != b
    assert one.forwards == len(PAIRS) - 1  # the " A" / " B" requests share a forward row
    one.logits_cache = False
    runs = [one.loglikelihood(reqs, disable_tqdm=True)]
    lm = _lm(tiny_llama_dir, 3, batch_size=8)
    runs += [_lm(tiny_llama_dir, 1, batch_size=3).loglikelihood(reqs, disable_tqdm=True),
             lm.loglikelihood(reqs, disable_tqdm=True)]
    for got in runs:
        assert [g for _, g in got] == [g for _, g in base]
        assert [ll for ll, _ in got] == pytest.approx([ll for ll, _ in base], abs=1e-4)
    assert lm.forwards == 1


def _hf(model_dir: Path):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def hf_score(hf, seq: list[int], n: int) -> tuple[float, bool]:
    """transformers: sum of log p(seq[-n:]) given what precedes each token in ``seq`` (one forward
    over ``seq[:-1]``), and whether each of those tokens is the argmax."""
    ids = torch.tensor([seq])
    with torch.no_grad():
        logp = F.log_softmax(hf(ids[:, :-1]).logits[0].float(), dim=-1)[-n:]
    target = ids[0, -n:]
    return logp.gather(-1, target[:, None]).sum().item(), bool((logp.argmax(-1) == target).all())


def hf_greedy(hf, ids: list[int], max_new: int, eos: int) -> list[int]:
    """transformers' greedy continuation of ``ids``: at most ``max_new`` tokens, up to EOS (excluded)."""
    out = hf.generate(torch.tensor([ids]), max_new_tokens=max_new, do_sample=False, eos_token_id=eos,
                      pad_token_id=eos)[0, len(ids):].tolist()
    return out[: out.index(eos)] if eos in out else out


def test_loglikelihood_rolling_matches_transformers(tiny_llama_dir) -> None:
    """Rolling log-likelihood with max_length M over s = [BOS] + ids (n tokens), scored by transformers:
    window j is the slice of s ending at e_j = min(jM, n) + 1 and starting M + 1 before it (or at 0),
    scoring its last e_j - e_{j-1} tokens (lm-eval's rolling windows, context 1). n = 2M + 5: two full
    windows and a last one that scores 5 tokens after an overlapping context."""
    M = 16
    lm = _lm(tiny_llama_dir, 3, batch_size=2, max_length=M)
    hf, tok = _hf(tiny_llama_dir), AutoTokenizer.from_pretrained(tiny_llama_dir)
    ids = tok.encode("The quick brown fox jumps over the lazy dog. " * 6)
    n = 2 * M + 5
    text, short = tok.decode(ids[:n]), tok.decode(ids[:10])
    assert tok.encode(text) == ids[:n] and tok.encode(short) == ids[:10]
    got = lm.loglikelihood_rolling(_requests("loglikelihood_rolling", [(text,), (short,)]), disable_tqdm=True)

    def by_hand(toks: list[int]) -> float:
        s = [tok.bos_token_id] + toks
        ends = [min(j * M, len(toks)) + 1 for j in range(1, -(-len(toks) // M) + 1)]
        total, prev = 0.0, 1
        for e in ends:
            total += hf_score(hf, s[max(0, e - M - 1) : e], e - prev)[0]
            prev = e
        return total

    assert got[0] == pytest.approx(by_hand(ids[:n]), rel=1e-5)
    assert got[1] == pytest.approx(by_hand(ids[:10]), rel=1e-5)
    # not the log-likelihood of one long window (the context really is cut every M predictions)
    assert got[0] != pytest.approx(hf_score(hf, [tok.bos_token_id] + ids[:n], n)[0], rel=1e-3)


def test_generate_until_matches_transformers_greedy_and_stops(tiny_llama_dir) -> None:
    """Greedy generation = transformers' ``generate(do_sample=False)`` decoded; a stop string cuts
    the text before it (and stops generating)."""
    lm = _lm(tiny_llama_dir, 3)
    hf, tok = _hf(tiny_llama_dir), AutoTokenizer.from_pretrained(tiny_llama_dir)
    prompt = "The quick brown"
    ref = tok.decode(hf_greedy(hf, tok.encode(prompt), 12, tok.eos_token_id), skip_special_tokens=True)
    got = lm.generate_until(_requests("generate_until", [(prompt, {"until": ["\x00"], "max_gen_toks": 12})]),
                            disable_tqdm=True)
    assert got == [ref]
    assert len(ref) > 4  # a stop string taken from the middle of the greedy text cuts it there
    stop = ref[len(ref) // 2 : len(ref) // 2 + 2]
    got = lm.generate_until(_requests("generate_until", [(prompt, {"until": [stop], "max_gen_toks": 12})]),
                            disable_tqdm=True)
    assert got == [ref.split(stop)[0]] and len(got[0]) < len(ref)


LONG_CONTEXT = "Tensor parallelism splits each layer across devices. Sync points are all-reduce operations."


def test_long_context_is_cut_from_the_left(tiny_llama_dir) -> None:
    """max_length M: a (context, continuation) of more than M + 1 tokens is scored on its last
    M + 1 tokens, i.e. transformers on (ctx + cont)[-(M+1):]; a continuation of exactly M tokens
    keeps one context token. Generation keeps the last M - max_gen_toks context tokens."""
    M = 16
    lm = _lm(tiny_llama_dir, 3, batch_size=4, max_length=M, max_gen_toks=6)
    hf, tok = _hf(tiny_llama_dir), AutoTokenizer.from_pretrained(tiny_llama_dir)
    ctx, cont = LONG_CONTEXT, " after attention and the MLP."
    full = tok.encode(ctx + cont)
    n = len(full) - len(tok.encode(ctx))
    assert len(full) > 2 * M and 1 < n < M
    cont_m = tok.decode(full[-M:])  # a continuation of exactly M tokens
    ctx_m = tok.decode(full[:-M])
    assert tok.encode(ctx_m) + tok.encode(ctx_m + cont_m)[len(tok.encode(ctx_m)):] == full
    assert len(tok.encode(ctx_m + cont_m)) - len(tok.encode(ctx_m)) == M
    got = lm.loglikelihood(_requests("loglikelihood", [(ctx, cont), (ctx_m, cont_m)]), disable_tqdm=True)
    for (ll, greedy), k in zip(got, (n, M), strict=True):
        ref_ll, ref_greedy = hf_score(hf, full[-(M + 1):], k)
        assert ll == pytest.approx(ref_ll, rel=1e-5, abs=1e-4) and greedy == ref_greedy
    untruncated = hf_score(hf, full, n)[0]
    assert got[0][0] != pytest.approx(untruncated, rel=1e-3)  # the cut changes the number

    ids = tok.encode(LONG_CONTEXT)
    ref = hf_greedy(hf, ids[-(M - 6):], 6, tok.eos_token_id)
    assert ref != hf_greedy(hf, ids, 6, tok.eos_token_id)  # the cut changes the text
    got = lm.generate_until(_requests("generate_until", [(LONG_CONTEXT, {"until": ["\x00"]})]), disable_tqdm=True)
    assert got == [tok.decode(ref, skip_special_tokens=True)]


def test_over_long_continuation_is_refused(tiny_llama_dir) -> None:
    """A continuation of more than max_length tokens cannot be scored in one window: a clear error."""
    M = 16
    lm = _lm(tiny_llama_dir, 1, max_length=M)
    tok = lm.tokenizer
    ids = tok.encode(LONG_CONTEXT)
    ctx, cont = tok.decode(ids[:3]), tok.decode(ids[3 : 3 + M + 1])
    assert len(tok.encode(ctx + cont)) - len(tok.encode(ctx)) == M + 1
    with pytest.raises(SyncdropError, match=f"continuation of {M + 1} tokens exceeds max_length {M}"):
        lm.loglikelihood(_requests("loglikelihood", [(ctx, cont)]), disable_tqdm=True)
    with pytest.raises(SyncdropError, match=f"max_gen_toks {M} must be below max_length {M}"):
        lm.generate_until(_requests("generate_until", [("The", {"until": ["\x00"], "max_gen_toks": M})]),
                          disable_tqdm=True)


@pytest.mark.parametrize("chunk", [1, 3, 7])
def test_chunked_scoring_equals_one_by_one(tiny_llama_dir, chunk, monkeypatch) -> None:
    """log_softmax over chunks of ``chunk`` positions, several rows per forward (continuations of 1
    to ~10 tokens straddle the chunk boundaries) = one request per forward in one chunk = transformers."""
    import syncdrop.eval.harness as harness

    pairs = [*PAIRS, (LONG_CONTEXT[:40], LONG_CONTEXT[40:])]
    reqs = _requests("loglikelihood", pairs)
    one = _lm(tiny_llama_dir, 1, batch_size=1)
    one.logits_cache = False
    base = one.loglikelihood(reqs, disable_tqdm=True)
    monkeypatch.setattr(harness, "SCORE_CHUNK", chunk)
    lm = _lm(tiny_llama_dir, 1, batch_size=5)
    got = lm.loglikelihood(reqs, disable_tqdm=True)
    assert lm.forwards == 2  # 8 requests, the " A" / " B" pair on one row: 7 rows in batches of 5
    assert [g for _, g in got] == [g for _, g in base]
    assert [ll for ll, _ in got] == pytest.approx([ll for ll, _ in base], rel=1e-5, abs=1e-5)
    hf, tok = _hf(tiny_llama_dir), AutoTokenizer.from_pretrained(tiny_llama_dir)
    for (ctx, cont), (ll, greedy) in zip(pairs, got, strict=True):
        ref_ll, ref_greedy = reference_loglikelihood(hf, tok, ctx, cont)
        assert ll == pytest.approx(ref_ll, rel=1e-5, abs=1e-4) and greedy == ref_greedy


def test_registered_and_built_from_model_args(tiny_llama_dir) -> None:
    from lm_eval.api.registry import get_model

    cls = get_model("syncdrop")
    assert cls is SyncdropLM
    lm = cls.create_from_arg_string(f"model={tiny_llama_dir},tp=3,plan=blocks:0;1,executor=simulated,progress=false",
                                    {"batch_size": 2, "device": None})
    assert lm.built.plan.dropped == [0, 1] and lm.lm.layout.tp == 3 and lm.batch_size == 2
    assert (lm.rank, lm.world_size) == (0, 1)  # tensor-parallel ranks are not lm-eval's data-parallel ranks


# ---------------------------------------------------------------- local tasks

def _official(rel: str) -> dict:
    import lm_eval
    from lm_eval.tasks._yaml_loader import load_yaml

    return load_yaml(Path(lm_eval.__file__).parent / "tasks" / rel, resolve_func=True)


OFFICIAL = {"arc_easy.yaml": "arc/arc_easy.yaml", "arc_challenge.yaml": "arc/arc_challenge.yaml",
            "hellaswag.yaml": "hellaswag/hellaswag.yaml", "lambada_openai.yaml": "lambada/lambada_openai.yaml",
            "piqa.yaml": "piqa/piqa.yaml", "sciq.yaml": "sciq/sciq.yaml", "winogrande.yaml": "winogrande/default.yaml"}
PROMPT_KEYS = ("task", "task_alias", "group", "output_type", "doc_to_text", "doc_to_target", "doc_to_choice",
               "process_docs", "description", "target_delimiter", "fewshot_delimiter", "metric_list",
               "aggregate_metric_list", "metadata", "num_fewshot", "fewshot_config")


def _comparable(value):
    if callable(value):
        return (value.__module__, value.__qualname__, inspect.getsource(value))
    return value


def _eval_split(cfg: dict) -> str | None:
    return cfg.get("test_split") or cfg.get("validation_split")


def test_configs_equal_official_yamls() -> None:
    from lm_eval.tasks._yaml_loader import load_yaml

    mine = {p.name: p for p in CONFIG_DIR.glob("*.yaml")}
    assert set(mine) == set(OFFICIAL)
    pairs = [(mine[n], OFFICIAL[n]) for n in sorted(mine)]
    pairs += [(p, f"mmlu/default/{p.name}") for p in sorted((CONFIG_DIR / "mmlu").glob("*.yaml"))]
    assert len(pairs) == 7 + 5 + 57
    for path, rel in pairs:
        ours, theirs = load_yaml(path, resolve_func=True), _official(rel)
        for key in PROMPT_KEYS:
            assert _comparable(ours.get(key)) == _comparable(theirs.get(key)), (path.name, key)
        assert _eval_split(ours) == _eval_split(theirs), path.name
        tags = theirs.get("tag")
        assert ours.get("tag") == (None if tags == ["multiple_choice"] else tags), path.name
        if "group" in ours:
            assert ours == theirs, path.name
        else:
            assert callable(ours["custom_dataset"]) and "dataset_path" not in ours, path.name


# first document of each task: the request lm-eval sends (context, continuation), from the official prompts
FIRST = {
    "arc_easy": ("Question: Which statement best explains why photosynthesis is the foundation of most food webs?"
                 "\nAnswer:", " Sunlight is the source of energy for nearly all ecosystems.", 4, 2376),
    "arc_challenge": ("Question: An astronomer observes that a planet rotates faster after a meteorite impact. "
                      "Which is the most likely effect of this increase in rotation?\nAnswer:",
                      " Planetary density will decrease.", 4, 1172),
    "hellaswag": ("Roof shingle removal: A man is sitting on a roof. He", " is using wrap to wrap a pair of skis.",
                  4, 10042),
    "piqa": ("Question: How do I ready a guinea pig cage for it's new occupants?\nAnswer:",
             " Provide the guinea pig with a cage full of a few inches of bedding made of ripped paper strips, you "
             "will also need to supply it with a water bottle and a food dish.", 2, 1838),
    "winogrande": ("Sarah was a much better surgeon than Maria so Sarah", " always got the easier cases.", 2, 1267),
    "mmlu_abstract_algebra": (
        "The following are multiple choice questions (with answers) about abstract algebra.\n\n"
        "Find the degree for the given field extension Q(sqrt(2), sqrt(3), sqrt(18)) over Q.\n"
        "A. 0\nB. 4\nC. 2\nD. 6\nAnswer:", " A", 4, 100),
}


@pytest.mark.needs_data("tasks")
@pytest.mark.parametrize("name", [*FIRST, "sciq", "lambada_openai"])
def test_local_task_first_request_is_the_official_prompt(name) -> None:
    task = task_manager().load([name])["tasks"][name]
    task.build_all_requests(limit=1, rank=0, world_size=1)
    args = [inst.arguments for inst in task.instances]
    docs = task.eval_docs
    if name == "sciq":
        doc = docs[0]
        assert doc["question"].startswith("Compounds that are capable of accepting electrons")
        assert args[0][0] == doc["support"].lstrip() + "\nQuestion: " + doc["question"] + "\nAnswer:"
        assert [a[1] for a in args] == [" antioxidants", " Oxygen", " residues", " oxidants"]
        assert task.doc_to_target(doc) == 3 and len(docs) == 1000
        return
    if name == "lambada_openai":
        ctx, cont = args[0]
        assert ctx.startswith("In my palm is a clear stone") and ctx.endswith("I don't care about")
        assert cont == " signs" and task.OUTPUT_TYPE == "loglikelihood" and len(docs) == 5153
        return
    ctx, cont, n_choices, n_docs = FIRST[name]
    assert args[0] == (ctx, cont) and len(args) == n_choices and len(docs) == n_docs
    if name == "winogrande":  # partial evaluation: one continuation after each filled-in context
        assert args[1] == ("Sarah was a much better surgeon than Maria so Maria", cont)
        assert task.doc_to_target(docs[0]) == "always got the easier cases." and docs[0]["answer"] == "2"


def test_hellaswag_ctx_split() -> None:
    from syncdrop.eval.tasks.local_data import split_hellaswag_ctx

    assert split_hellaswag_ctx("A man is sitting on a roof. he") == ("A man is sitting on a roof.", "he")
    assert split_hellaswag_ctx("How to x. Do y. Then z.") == ("How to x. Do y. Then z.", "")
    assert split_hellaswag_ctx("the boy") == ("", "the boy")


def test_missing_data_is_a_clear_error(tmp_path) -> None:
    with pytest.raises(SyncdropError, match="not found"):
        check_data(["arc_easy"], tmp_path / "nowhere")
    (tmp_path / "piqa").mkdir()
    with pytest.raises(SyncdropError, match=f"task piqa: data folder {tmp_path / 'piqa'} lacks valid.jsonl"):
        check_data(["piqa"], tmp_path)
    with pytest.raises(SyncdropError, match="mmlu"):
        check_data(["mmlu_stem"], tmp_path)
    assert len(mmlu_subjects()) == 57


# ---------------------------------------------------------------- syncdrop eval

@pytest.mark.needs_data("tasks")
def test_eval_cli_json(tiny_llama_dir, tmp_path, capsys, monkeypatch) -> None:
    monkeypatch.setenv("DISABLE_MULTIPROC", "1")  # lm-eval's bootstrap without a process pool
    out = tmp_path / "eval.json"
    rc = main(["eval", "--model", str(tiny_llama_dir), "--tp", "3", "--plan", "none", "--tasks",
               "arc_easy,lambada_openai,mmlu_anatomy", "--limit", "3", "--batch-size", "4",
               "--bootstrap-iters", "10", "--json", str(out), "-q"])
    assert rc == 0
    res = json.loads(out.read_text())
    r = res["results"]
    assert set(r) == {"arc_easy", "lambada_openai", "mmlu_anatomy"}
    for key in ("acc", "acc_stderr", "acc_norm", "acc_norm_stderr"):
        assert 0 <= r["arc_easy"][key] <= 1
    assert r["arc_easy"]["n"] == 3 and r["mmlu_anatomy"]["n"] == 3
    assert r["lambada_openai"]["perplexity"] > 1 and 0 <= r["lambada_openai"]["acc"] <= 1
    s = res["settings"]
    assert (s["tp"], s["limit"], s["plan_summary"], s["executor"], s["num_fewshot"]) == (3, 3, "none", "simulated", 0)
    assert s["max_length"] == 128 and s["lm_eval"].startswith("0.4")
    assert "commit" in res["provenance"] and res["versions"]["arc_easy"] == 1.0
    assert "arc_easy" in capsys.readouterr().out


@pytest.mark.parametrize("args, message", [
    (["--tasks", "arc_easy,nosuchtask"], "unknown task(s) nosuchtask"),
    (["--data-dir", "/no/such/folder"], "data folder /no/such/folder not found"),
    (["--limit", "0"], "--limit must be at least 1"),
    (["--batch-size", "0"], "--batch-size must be at least 1"),
])
def test_eval_bad_input_exits_2_with_one_line(tiny_llama_dir, args, message, capsys) -> None:
    argv = ["eval", "--model", str(tiny_llama_dir), "--tasks", "arc_easy", "-q", *args]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err and "Traceback" not in err


@pytest.mark.needs_data("tasks")
@pytest.mark.slow
def test_eval_distributed_equals_simulated(tiny_llama_dir, tmp_path) -> None:
    """--launch: 3 ranks run the same requests (each forward has collectives); rank 0 writes."""
    outs = {}
    for mode in ("simulated", "launch"):
        outs[mode] = tmp_path / f"{mode}.json"
        extra = ["--launch"] if mode == "launch" else ["--executor", "simulated"]
        cmd = [sys.executable, "-m", "syncdrop", "eval", "--model", str(tiny_llama_dir), "--tp", "3", "--tasks",
               "arc_easy,winogrande", "--limit", "4", "--bootstrap-iters", "10", "--exact-reduce", "-q",
               "--json", str(outs[mode]), *extra]
        subprocess.run(cmd, check=True, timeout=600, env={**__import__("os").environ, "DISABLE_MULTIPROC": "1"})
    sim, dist = (json.loads(outs[m].read_text()) for m in ("simulated", "launch"))
    assert dist["settings"]["executor"] == "distributed"
    for task in ("arc_easy", "winogrande"):
        for key in ("acc", "acc_norm"):
            assert sim["results"][task].get(key) == dist["results"][task].get(key)


@pytest.mark.needs_data("tasks")
@pytest.mark.slow
def test_syncdrop_lm_eval_console_script(tiny_llama_dir, tmp_path) -> None:
    """lm-eval's own CLI with the model registered and the local tasks on its include path."""
    code = "from syncdrop.eval.cli import lm_eval_main; lm_eval_main()"
    cmd = [sys.executable, "-c", code, "--model", "syncdrop", "--model_args",
           f"model={tiny_llama_dir},tp=3,plan=all,executor=simulated", "--tasks", "arc_easy", "--limit", "2",
           "--local-tasks", "--output_path", str(tmp_path / "out")]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "arc_easy" in res.stdout and "acc_norm" in res.stdout
