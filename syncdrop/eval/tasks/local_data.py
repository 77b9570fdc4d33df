"""Read the local evaluation files (``../shared/data``) into the schema of the Hugging Face datasets
that lm-evaluation-harness's official task YAMLs were written for.

Each public function is a task's ``custom_dataset`` (lm-eval calls it with the task metadata and
``dataset_kwargs`` as keyword arguments; ``data_dir`` among them overrides the folder, see
:func:`syncdrop.eval.data.data_dir`) and returns a :class:`datasets.DatasetDict` whose split names
and fields match the hub dataset, so the official ``doc_to_text`` / ``doc_to_choice`` /
``doc_to_target`` / ``process_docs`` apply unchanged:

=================  ===============================  ======================================================
task               hub dataset (split)              local file -> fields
=================  ===============================  ======================================================
arc_easy/challenge allenai/ai2_arc (test)           ``query`` minus "Question: " -> question; choices ->
                                                    ``{text, label: A..D}``; gold -> answerKey
hellaswag          Rowan/hellaswag (validation)     6-line text records -> activity_label, ctx_a, ctx_b,
                                                    endings, label (see :func:`split_hellaswag_ctx`)
lambada_openai     EleutherAI/lambada_openai (test) ``context + " " + continuation`` -> text
piqa               baber/piqa (validation)          valid.jsonl + valid-labels.lst -> goal, sol1, sol2, label
sciq               allenai/sciq (test, validation)  the original JSON (already this schema)
winogrande         allenai/winogrande (validation)  context_options + continuation -> sentence (with "_"),
                                                    option1, option2, answer ("1"/"2")
mmlu_<subject>     cais/mmlu (test, dev)            CSV -> question, subject, choices[4], answer (0-3)
=================  ===============================  ======================================================

A missing file raises :class:`~syncdrop.errors.SyncdropError` naming the folder.
"""

from __future__ import annotations

import bz2
import csv
import json
import os
import re
from pathlib import Path
from typing import Any

from syncdrop.errors import SyncdropError

# task (or "mmlu") -> files it reads, relative to the data folder
FILES: dict[str, tuple[str, ...]] = {
    "arc_easy": ("arc_easy/arc_easy.jsonl",),
    "arc_challenge": ("arc_challenge/arc_challenge.jsonl",),
    "hellaswag": ("hellaswag/hellaswag_val_full.txt.bz2",),
    "lambada_openai": ("lambada/lambada_openai.jsonl",),
    "piqa": ("piqa/valid.jsonl", "piqa/valid-labels.lst"),
    "sciq": ("sciq/test.json", "sciq/valid.json"),
    "winogrande": ("winogrande/winogrande.jsonl",),
}


def mmlu_files(subject: str) -> tuple[str, str]:
    return (f"mmlu/test/{subject}_test.csv", f"mmlu/dev/{subject}_dev.csv")


def root_dir(data_dir: str | os.PathLike | None = None) -> Path:
    from syncdrop.eval.data import data_dir as resolve

    return resolve(str(data_dir) if data_dir else None)


def require(task: str, rel_paths: tuple[str, ...], data_dir: str | os.PathLike | None = None) -> list[Path]:
    """Absolute paths of ``rel_paths`` under the data folder; SyncdropError if any is missing."""
    root = root_dir(data_dir)
    paths = [root / p for p in rel_paths]
    missing = [p for p in paths if not p.is_file()]
    if missing:
        folder = missing[0].parent
        raise SyncdropError(f"task {task}: data folder {folder} lacks {missing[0].name} (data dir {root}; "
                            "pass --data-dir or set SYNCDROP_DATA to the folder holding the evaluation data)")
    return paths


def _jsonl(path: Path) -> list[dict[str, Any]]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _dataset(**splits: list[dict[str, Any]]):
    import datasets

    return datasets.DatasetDict({name: datasets.Dataset.from_list(rows) for name, rows in splits.items()})


def _arc(task: str, data_dir: str | None) -> Any:
    (path,) = require(task, FILES[task], data_dir)
    rows = []
    for i, d in enumerate(_jsonl(path)):
        labels = [chr(ord("A") + j) for j in range(len(d["choices"]))]
        rows.append({"id": f"{task}-test-{i}", "question": d["query"].removeprefix("Question: "),
                     "choices": {"text": list(d["choices"]), "label": labels}, "answerKey": labels[d["gold"]]})
    return _dataset(test=rows)


def arc_easy(data_dir: str | None = None, **_: Any) -> Any:
    return _arc("arc_easy", data_dir)


def arc_challenge(data_dir: str | None = None, **_: Any) -> Any:
    return _arc("arc_challenge", data_dir)


_ENDS_SENTENCE = re.compile(r"[.!?][\"')\]]*$")
_LAST_BOUNDARY = re.compile(r"^(.*[.!?][\"')\]]*) (\S.*)$", re.S)


def split_hellaswag_ctx(ctx: str) -> tuple[str, str]:
    """``(ctx_a, ctx_b)`` recovered from the file's ``ctx`` (``ctx_a + " " + ctx_b``).

    lm-eval builds ``ctx_a + " " + ctx_b.capitalize()``, so the split matters. HellaSwag's ``ctx_b``
    is the unfinished start of the next sentence (ActivityNet: "he", "the lady"...), empty when the
    context ends a sentence (WikiHow). Heuristic: a context ending in sentence punctuation has an
    empty ``ctx_b``; otherwise ``ctx_b`` is the text after the last sentence end (``.!?`` then a
    space); with no sentence end at all, the whole context is ``ctx_b``.
    """
    if _ENDS_SENTENCE.search(ctx):
        return ctx, ""
    m = _LAST_BOUNDARY.match(ctx)
    return (m.group(1), m.group(2)) if m else ("", ctx)


def hellaswag(data_dir: str | None = None, **_: Any) -> Any:
    """The llama.cpp text layout (6 lines per item: ``activity_label: ctx``, gold, 4 endings), whose
    text was already run through bracket-artefact preprocessing close to lm-eval's own; the official
    ``process_docs`` (applied by the task config) repeats lm-eval's preprocessing on top."""
    (path,) = require("hellaswag", FILES["hellaswag"], data_dir)
    with bz2.open(path, "rt", encoding="utf-8") as f:
        lines = f.read().split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    if len(lines) % 6:
        raise SyncdropError(f"task hellaswag: {path} has {len(lines)} lines, not a multiple of 6")
    rows = []
    for i in range(0, len(lines), 6):
        label, ctx = lines[i].split(": ", 1)
        ctx_a, ctx_b = split_hellaswag_ctx(ctx)
        rows.append({"ind": i // 6, "activity_label": label, "ctx_a": ctx_a, "ctx_b": ctx_b, "ctx": ctx,
                     "endings": lines[i + 2 : i + 6], "source_id": "", "split": "val", "split_type": "",
                     "label": lines[i + 1].strip()})
    return _dataset(validation=rows)


def lambada_openai(data_dir: str | None = None, **_: Any) -> Any:
    (path,) = require("lambada_openai", FILES["lambada_openai"], data_dir)
    return _dataset(test=[{"text": d["context"] + " " + d["continuation"]} for d in _jsonl(path)])


def piqa(data_dir: str | None = None, **_: Any) -> Any:
    docs_path, labels_path = require("piqa", FILES["piqa"], data_dir)
    docs = _jsonl(docs_path)
    labels = [int(x) for x in labels_path.read_text(encoding="utf-8").split()]
    if len(docs) != len(labels):
        raise SyncdropError(f"task piqa: {docs_path.name} has {len(docs)} items but {labels_path.name} "
                            f"has {len(labels)} labels")
    return _dataset(validation=[{"goal": d["goal"], "sol1": d["sol1"], "sol2": d["sol2"], "label": y}
                                for d, y in zip(docs, labels, strict=True)])


def sciq(data_dir: str | None = None, **_: Any) -> Any:
    test, valid = require("sciq", FILES["sciq"], data_dir)
    keys = ("question", "distractor3", "distractor1", "distractor2", "correct_answer", "support")

    def load(p: Path) -> list[dict[str, Any]]:
        return [{k: d[k] for k in keys} for d in json.loads(p.read_text(encoding="utf-8"))]

    return _dataset(test=load(test), validation=load(valid))


def winogrande_doc(context_options: list[str], continuation: str, gold: int) -> dict[str, str]:
    """The ``allenai/winogrande`` record whose official ``doc_to_choice`` / ``doc_to_target`` give
    exactly ``context_options`` / ``continuation``: ``sentence = P + "_ " + continuation`` where P
    is the options' common prefix cut back to a word boundary."""
    a, b = context_options
    prefix = os.path.commonprefix([a, b])
    prefix = prefix[: prefix.rfind(" ") + 1]
    if "_" in prefix:
        raise SyncdropError(f"task winogrande: context {prefix!r} contains '_', the blank marker")
    return {"sentence": prefix + "_ " + continuation, "option1": a[len(prefix):], "option2": b[len(prefix):],
            "answer": str(gold + 1)}


def winogrande(data_dir: str | None = None, **_: Any) -> Any:
    (path,) = require("winogrande", FILES["winogrande"], data_dir)
    rows = [winogrande_doc(d["context_options"], d["continuation"], d["gold"]) for d in _jsonl(path)]
    return _dataset(validation=rows)


def _mmlu_csv(path: Path, subject: str) -> list[dict[str, Any]]:
    with open(path, encoding="utf-8", newline="") as f:
        return [{"question": r["question"], "subject": subject,
                 "choices": [r["choice0"], r["choice1"], r["choice2"], r["choice3"]], "answer": int(r["answer"])}
                for r in csv.DictReader(f)]


def mmlu(subject: str, data_dir: str | None = None, **_: Any) -> Any:
    test, dev = require(f"mmlu_{subject}", mmlu_files(subject), data_dir)
    return _dataset(test=_mmlu_csv(test, subject), dev=_mmlu_csv(dev, subject))
