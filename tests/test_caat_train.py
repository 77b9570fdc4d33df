"""Training from scratch with partial sync (CAAT-Net): exact gradients in both executors, the
exported model against transformers, a resumable run."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from syncdrop.caat.model import export_hf, init_params, llama_config, lm_loss, tp_forward
from syncdrop.cli import main
from syncdrop.models.hf_writer import hf_tensor_name
from syncdrop.parallel.comm import SimulatedComm
from syncdrop.parallel.launch import launch
from syncdrop.parallel.sharding import ShardLayout
from syncdrop.plan import BlockSync, Partial, SyncPlan

WORKER = str(Path(__file__).parent / "workers" / "caat_grads.py")
CFG = dict(vocab=64, hidden=32, layers=2, heads=4, kv_heads=2, ffn=64, seq=16)


def _cfg():
    c = CFG
    return llama_config(c["vocab"], c["hidden"], c["layers"], c["heads"], c["kv_heads"], c["ffn"], c["seq"])


def _batch() -> torch.Tensor:
    return torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(1))


def simulated_grads(tp: int, plan: SyncPlan) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    cfg = _cfg()
    params = {k: v.requires_grad_(True) for k, v in init_params(cfg, 0).items()}
    b = _batch()
    loss = lm_loss(tp_forward(params, cfg, ShardLayout.build(cfg, tp), plan, SimulatedComm(tp), list(range(tp)),
                              b[:, :-1]), b[:, 1:])
    loss.backward()
    return loss.detach(), {k: p.grad for k, p in params.items()}


def test_tp1_gradients_equal_transformers(tmp_path) -> None:
    """Loss and every gradient at TP=1 (p irrelevant) equal transformers' LlamaForCausalLM built from
    the exported directory; ordinary TP (p = 1) at N = 3 (uneven heads) gives the same gradients."""
    from transformers import AutoModelForCausalLM

    cfg = _cfg()
    export_hf(init_params(cfg, 0), cfg, tmp_path / "m")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "m", dtype=torch.float32)
    b = _batch()
    out = hf(input_ids=b[:, :-1], labels=b[:, :-1])  # transformers shifts labels itself
    out_loss = torch.nn.functional.cross_entropy(out.logits.reshape(-1, 64), b[:, 1:].reshape(-1))
    out_loss.backward()
    hf_grads = dict(hf.named_parameters())
    loss, grads = simulated_grads(1, SyncPlan.partial(2, 0.5))
    torch.testing.assert_close(loss, out_loss.detach(), atol=1e-5, rtol=0)
    for k, g in grads.items():
        torch.testing.assert_close(g, hf_grads[hf_tensor_name(k, cfg)].grad, atol=1e-6, rtol=1e-4, msg=k)
    loss3, grads3 = simulated_grads(3, SyncPlan.partial(2, 1.0))
    torch.testing.assert_close(loss3, loss, atol=1e-5, rtol=0)
    for k, g in grads3.items():
        torch.testing.assert_close(g, grads[k], atol=1e-6, rtol=1e-4, msg=k)


@pytest.mark.parametrize("tp", [2, 3])
def test_distributed_gradients_equal_simulated(tmp_path, tp) -> None:
    """gloo: the differentiable partial reduce (shared-channel gradient all-reduced), the gathered
    vocab-parallel logits and the gradient all-reduce reproduce the simulated gradients."""
    plans = {"p05": SyncPlan.partial(2, 0.5), "mixed": SyncPlan([BlockSync(Partial(0.0), Partial(0.25)),
                                                                 BlockSync("full", Partial(0.75))])}
    for name, plan in plans.items():
        plan.save(tmp_path / f"{name}.json")
        out = tmp_path / f"{name}.safetensors"
        assert launch([str(tmp_path / f"{name}.json"), str(out)], tp, program=[WORKER]) == 0
        got = load_file(str(out))
        loss, grads = simulated_grads(tp, plan)
        torch.testing.assert_close(got["loss"][0], loss, atol=1e-5, rtol=0)
        for k, g in grads.items():
            torch.testing.assert_close(got[k], g, atol=1e-6, rtol=1e-4, msg=f"{name} {k}")


def _train_args(out: Path, corpus: Path, steps: int = 6) -> list[str]:
    return ["train", "--tp", "2", "--sync-fraction", "0.5", "--corpus", str(corpus), "--val-books", "1",
            "--steps", str(steps), "--batch", "2", "--seq-len", "32", "--hidden", "32", "--layers", "2",
            "--heads", "4", "--kv-heads", "2", "--ffn", "64", "--vocab-size", "320", "--val-every", "3",
            "--val-windows", "2", "--ckpt-every", "3", "--warmup", "2", "--lr", "3e-3", "--out", str(out), "-q"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("corpus")
    words = "the of and to in a is that it was for on are as with his they at be this from".split()
    g = torch.Generator().manual_seed(0)
    for name in ("a", "b", "c"):
        idx = torch.randint(0, len(words), (3000,), generator=g).tolist()
        (d / f"{name}.txt").write_text(" ".join(words[i] for i in idx))
    return d


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, corpus) -> tuple[Path, dict]:
    """A 6-step simulated run at tp=2, p=0.5, never interrupted: the reference of the resumed and
    the distributed runs. Returns its run directory and its result JSON."""
    a = tmp_path_factory.mktemp("uninterrupted") / "a"
    assert main([*_train_args(a, corpus), "--json", str(a.parent / "a.json")]) == 0
    return a, json.loads((a.parent / "a.json").read_text())


def _exported(run: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run / "model" / "model.safetensors"))


def test_train_resumes_exactly_and_exports(tmp_path, corpus, uninterrupted, monkeypatch, capsys) -> None:
    """An interrupted run (killed while fetching step 4's batch, checkpoint at step 3) continues
    from its checkpoint: the resumed process trains only steps 3, 4, 5 (not a restart from 0, which
    seeded batches would make give the same losses), and ends with the losses, validation losses
    and exported weights (bit for bit) of the uninterrupted run. The loss falls; the exported model
    runs under `syncdrop ppl` with its plan; other settings in the same directory are refused."""
    import syncdrop.caat.train as tr

    a, ra = uninterrupted
    assert ra["train_loss"][-1] < ra["train_loss"][0] and len(ra["val_loss"]) == 3
    assert len(ra["train_loss"]) == 6
    b = tmp_path / "b"
    real = tr.train_batch
    fetched: list[int] = []  # the step of every batch the training loop asks for

    def dying(stream, batch, seq, seed, step):
        fetched.append(step)
        if step == 4:
            raise KeyboardInterrupt
        return real(stream, batch, seq, seed, step)

    monkeypatch.setattr(tr, "train_batch", dying)
    assert main(_train_args(b, corpus)) == 130
    assert fetched == [0, 1, 2, 3, 4]
    assert json.loads((b / "checkpoint" / "state.json").read_text())["step"] == 3

    def counting(stream, batch, seq, seed, step):
        fetched.append(step)
        return real(stream, batch, seq, seed, step)

    fetched.clear()
    monkeypatch.setattr(tr, "train_batch", counting)
    assert main([*_train_args(b, corpus), "--json", str(tmp_path / "b.json")]) == 0
    assert fetched == [3, 4, 5]  # only the remaining steps were trained
    rb = json.loads((tmp_path / "b.json").read_text())
    assert rb["train_loss"] == pytest.approx(ra["train_loss"], abs=1e-5)
    assert [s for s, _ in rb["val_loss"]] == [s for s, _ in ra["val_loss"]] == [0, 3, 6]
    assert [v for _, v in rb["val_loss"]] == pytest.approx([v for _, v in ra["val_loss"]], abs=1e-5)
    assert len(rb["tokens_per_s"]) == 6
    assert json.loads((b / "checkpoint" / "state.json").read_text())["step"] == 6
    wa, wb = _exported(a), _exported(b)
    assert sorted(wa) == sorted(wb)
    for k in wa:
        torch.testing.assert_close(wb[k], wa[k], atol=0, rtol=0, msg=k)
    capsys.readouterr()
    ppl = {}
    for plan in ([], ["--plan", str(a / "model" / "plan.json")], ["--plan", "none"]):  # default = its own plan
        j = tmp_path / f"ppl{len(ppl)}.json"
        assert main(["ppl", "--model", str(a / "model"), "--tp", "2", *plan, "--dataset", str(corpus / "a.txt"),
                     "--seq-len", "32", "--max-windows", "2", "-q", "--json", str(j)]) == 0
        ppl[" ".join(plan[1:]) or "default"] = json.loads(j.read_text())["ppl"]
    assert "ppl" in capsys.readouterr().out
    assert ppl["default"] == ppl[str(a / "model" / "plan.json")] != ppl["none"]
    # other settings in the same directory: refused
    assert main(_train_args(b, corpus, steps=7)) == 2
    assert "other settings" in capsys.readouterr().err


def test_train_launch_matches_simulated(tmp_path, corpus, uninterrupted) -> None:
    """`syncdrop train --launch` (2 gloo ranks, one process each, gradient all-reduce) gives the
    simulated run's losses and exported weights (float tolerance: the ranks sum their gradients
    in another order), and the same plan."""
    a, ra = uninterrupted
    c = tmp_path / "c"
    assert main([*_train_args(c, corpus), "--launch", "--json", str(tmp_path / "c.json")]) == 0
    rc = json.loads((tmp_path / "c.json").read_text())
    assert rc["settings"]["tp"] == 2 and len(rc["train_loss"]) == 6
    assert rc["train_loss"] == pytest.approx(ra["train_loss"], abs=1e-5)
    assert [s for s, _ in rc["val_loss"]] == [s for s, _ in ra["val_loss"]]
    assert [v for _, v in rc["val_loss"]] == pytest.approx([v for _, v in ra["val_loss"]], abs=1e-5)
    wa, wc = _exported(a), _exported(c)
    assert sorted(wa) == sorted(wc)
    for k in wa:
        torch.testing.assert_close(wc[k], wa[k], atol=1e-6, rtol=1e-5, msg=k)
    assert json.loads((c / "model" / "plan.json").read_text()) == json.loads((a / "model" / "plan.json").read_text())


@pytest.mark.parametrize("extra,msg", [(["--sync-fraction", "1.5"], "--sync-fraction"),
                                       (["--corpus", "/nonexistent"], "no such file"),
                                       (["--hidden", "30"], "--hidden")])
def test_train_bad_input(tmp_path, corpus, extra, msg, capsys) -> None:
    args = _train_args(tmp_path / "x", corpus)
    for i in range(0, len(extra), 2):
        j = args.index(extra[i]) if extra[i] in args else None
        if j is None:
            args += extra[i : i + 2]
        else:
            args[j + 1] = extra[i + 1]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert msg in err and "Traceback" not in err


def test_train_records_data_folder_paths_relative(tmp_path, corpus, monkeypatch) -> None:
    """A run on the data folder's books records them relative to it (``gutenberg/a.txt``), so train.json
    and the checkpoint's settings hold no path of this machine; a file outside the folder keeps its path."""
    from syncdrop.eval.data import in_data_dir

    data = tmp_path / "data"
    shutil.copytree(corpus, data / "gutenberg")
    monkeypatch.setenv("SYNCDROP_DATA", str(data))
    out = tmp_path / "run"
    args = _train_args(out, corpus, steps=2)
    i = args.index("--corpus")
    del args[i:i + 2]  # the default corpus: the data folder's gutenberg/
    assert main(args) == 0
    text = (out / "train.json").read_text()
    result = json.loads(text)
    assert result["settings"]["corpus"] == "gutenberg"
    assert sorted(result["train_books"] + result["val_books"]) == ["gutenberg/a.txt", "gutenberg/b.txt",
                                                                    "gutenberg/c.txt"]
    assert str(tmp_path) not in text
    assert str(tmp_path) not in (out / "checkpoint" / "state.json").read_text()
    assert in_data_dir(corpus / "a.txt") == str(corpus / "a.txt")
