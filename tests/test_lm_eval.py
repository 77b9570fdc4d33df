"""lm-evaluation-harness: the ``syncdrop`` model against transformers, the local tasks against
lm-eval's official task configs, and ``syncdrop eval``.

References: transformers' own model on the tiny checkpoints with lm-eval's tokenization convention
written out here; :func:`syncdrop.eval.perplexity.window_nll` for rolling log-likelihoods;
:func:`syncdrop.generate.generate` for generation; lm-eval's installed task YAMLs and literal
first-document prompts for the local tasks.
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


def test_loglikelihood_rolling_equals_window_nll(tiny_llama_dir) -> None:
    """lm-eval's rolling windows with max_length M over [BOS] + ids: s[0:M+1], s[M:2M+1], ... each
    scoring its last M tokens = our perplexity code's window NLL on those windows."""
    from syncdrop.eval.perplexity import window_nll

    M = 16
    lm = _lm(tiny_llama_dir, 3, batch_size=2, max_length=M)
    tok = lm.tokenizer
    ids = tok.encode("The quick brown fox jumps over the lazy dog. " * 6)
    text = tok.decode(ids[: 2 * M])
    assert tok.encode(text) == ids[: 2 * M]
    short = tok.decode(ids[:10])
    got = lm.loglikelihood_rolling(_requests("loglikelihood_rolling", [(text,), (short,)]), disable_tqdm=True)
    s = torch.tensor([tok.bos_token_id] + ids[: 2 * M])
    ref = window_nll(lm.lm, torch.stack([s[: M + 1], s[M:]])).sum().item()
    assert got[0] == pytest.approx(-ref, rel=1e-5)
    assert got[1] == pytest.approx(-window_nll(lm.lm, s[None, :11]).item(), rel=1e-5)


def test_generate_until_matches_generate_and_stops(tiny_llama_dir) -> None:
    from syncdrop.generate import generate

    lm = _lm(tiny_llama_dir, 3)
    tok = lm.tokenizer
    prompt = "The quick brown"
    ids = tok.encode(prompt)
    ref_ids = generate(lm.lm, torch.tensor([ids]), 12, eos_id=tok.eos_token_id).tokens[0, len(ids):].tolist()
    if tok.eos_token_id in ref_ids:
        ref_ids = ref_ids[: ref_ids.index(tok.eos_token_id)]
    ref = tok.decode(ref_ids, skip_special_tokens=True)
    got = lm.generate_until(_requests("generate_until", [(prompt, {"until": ["\x00"], "max_gen_toks": 12})]),
                            disable_tqdm=True)
    assert got == [ref]
    assert len(ref) > 4  # a stop string taken from the middle of the greedy text cuts it there
    stop = ref[len(ref) // 2 : len(ref) // 2 + 2]
    got = lm.generate_until(_requests("generate_until", [(prompt, {"until": [stop], "max_gen_toks": 12})]),
                            disable_tqdm=True)
    assert got == [ref.split(stop)[0]] and len(got[0]) < len(ref)


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
