"""Zero-shot tasks on the local data folder, as lm-evaluation-harness task configs.

``configs/`` holds lm-eval 0.4.13's official task YAMLs for ``arc_easy``, ``arc_challenge``,
``hellaswag``, ``lambada_openai``, ``piqa``, ``sciq``, ``winogrande`` and ``mmlu`` (the group, its
four category groups and 57 ``mmlu_<subject>`` tasks) with one change each: the hub dataset is
replaced by a ``custom_dataset`` from :mod:`syncdrop.eval.tasks.local_data`, which reads the local
files into the hub dataset's schema. Prompts (``doc_to_text`` / ``doc_to_choice`` /
``doc_to_target``, descriptions, ``process_docs``), metrics and group aggregation are lm-eval's own
(``!function`` entries point at the installed lm-eval's modules). Task names are the official ones.

Use :func:`task_manager` for a :class:`lm_eval.tasks.TaskManager` over these configs only (no
indexing of lm-eval's ~15k built-in configs), or pass ``--include_path CONFIG_DIR`` to lm-eval's
CLI (``syncdrop-lm-eval --local-tasks``), where they take precedence over the hub-backed built-ins.
The data folder: the ``data_dir`` task metadata, else ``$SYNCDROP_DATA``, else ``../shared/data``.

Where the task data comes from (:func:`resolve_task_data`): the data folder when it holds every file
the tasks read; else, when no ``--data-dir`` was given and the Hugging Face hub can be reached (see
:func:`syncdrop.eval.data.hub_unavailable`), lm-eval's own hub-backed configs of the same names
(``datasets`` downloads them); else a :class:`~syncdrop.errors.SyncdropError` saying what was tried.
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from syncdrop.errors import SyncdropError
from syncdrop.eval.tasks.local_data import FILES, mmlu_files, require, root_dir

log = logging.getLogger(__name__)

CONFIG_DIR = Path(__file__).resolve().parent / "configs"
SIMPLE_TASKS = ("arc_easy", "arc_challenge", "hellaswag", "lambada_openai", "piqa", "sciq", "winogrande")
DEFAULT_TASKS = (*SIMPLE_TASKS, "mmlu")


@functools.cache
def mmlu_subjects() -> tuple[str, ...]:
    return tuple(sorted(p.stem.removeprefix("mmlu_") for p in (CONFIG_DIR / "mmlu").glob("mmlu_*.yaml")))


@functools.cache
def _index() -> dict[str, Any]:
    from lm_eval.tasks._index import TaskIndex

    return TaskIndex.build([CONFIG_DIR])


def available_tasks() -> list[str]:
    """Every name ``--tasks`` accepts: tasks, groups (``mmlu``, ``mmlu_stem``...) and tags."""
    return sorted(_index())


def parse_tasks(text: str) -> list[str]:
    """Comma-separated task names -> list, validated (SyncdropError naming the unknown ones)."""
    names = [t.strip() for t in text.split(",") if t.strip()]
    if not names:
        raise SyncdropError("--tasks is empty")
    unknown = [t for t in names if t not in _index()]
    if unknown:
        raise SyncdropError(f"unknown task(s) {', '.join(unknown)}: choose from {', '.join(DEFAULT_TASKS)}, "
                            "mmlu_stem, mmlu_humanities, mmlu_social_sciences, mmlu_other or mmlu_<subject> "
                            f"({len(mmlu_subjects())} subjects, e.g. mmlu_anatomy)")
    return list(dict.fromkeys(names))


def leaf_tasks(name: str) -> list[str]:
    """The tasks a task, tag or group name stands for."""
    from lm_eval.tasks._index import Kind

    entry = _index()[name]
    if entry.kind == Kind.TAG:
        return sorted(entry.tags)
    if entry.kind == Kind.GROUP:
        members = entry.cfg.get("task", [])
        members = members if isinstance(members, list) else [members]
        return [leaf for m in members for leaf in leaf_tasks(m if isinstance(m, str) else m["task"])]
    return [name]


def required_files(task: str) -> tuple[str, ...]:
    """Files (relative to the data folder) that leaf task ``task`` reads."""
    if task in FILES:
        return FILES[task]
    subject = task.removeprefix("mmlu_")
    if task.startswith("mmlu_") and subject in mmlu_subjects():
        return mmlu_files(subject)
    raise SyncdropError(f"task {task} has no local data files")


def check_data(names: list[str], data_dir: str | os.PathLike | None = None) -> Path:
    """Fail fast (SyncdropError naming the folder) unless every file ``names`` need exists."""
    root = root_dir(data_dir)
    if not root.is_dir():
        raise SyncdropError(f"data folder {root} not found; pass --data-dir or set SYNCDROP_DATA")
    for name in names:
        for task in leaf_tasks(name):
            require(task, required_files(task), root)
    return root


def missing_task_files(root: str | os.PathLike) -> list[str]:
    """Files (relative to ``root``) that the default tasks read and ``root`` lacks, without importing
    lm-eval (for the test suite's ``needs_data`` marker)."""
    rel = [f for files in FILES.values() for f in files] + [f for s in mmlu_subjects() for f in mmlu_files(s)]
    return [f for f in rel if not (Path(root) / f).is_file()]


@dataclass(frozen=True)
class TaskData:
    """Where the zero-shot task documents come from: ``source`` ``"data-dir"`` (``root`` holds the
    files) or ``"datasets"`` (lm-eval's hub configs; ``root`` None)."""

    source: str
    root: Path | None = None


def resolve_task_data(names: list[str], data_dir: str | os.PathLike | None = None) -> TaskData:
    """The data folder if it has every file ``names`` need, else (no ``data_dir`` given, hub reachable)
    the hub; SyncdropError naming what was tried otherwise. Fails fast: no model is loaded yet."""
    from syncdrop.eval.data import hub_unavailable

    try:
        return TaskData("data-dir", check_data(names, data_dir))
    except SyncdropError as e:
        if data_dir:
            raise
        why = hub_unavailable()
        if why:
            raise SyncdropError(f"{e}; the Hugging Face hub cannot be used either ({why})") from None
        log.warning("zero-shot tasks: %s; using lm-eval's hub datasets", e)
        return TaskData("datasets")


def data_record(names: list[str], data: TaskData, configs: dict[str, Any] | None = None) -> dict[str, Any]:
    """What result JSON records about the task data: the source and, for the data folder, the files
    read relative to it; for the hub, each task's ``dataset_path`` from lm-eval's ``configs``."""
    if data.source == "data-dir":
        files = sorted({f for n in names for t in leaf_tasks(n) for f in required_files(t)})
        return {"source": "data-dir", "files": files}
    return {"source": "datasets",
            "hub": {t: c.get("dataset_path") for t, c in sorted((configs or {}).items()) if isinstance(c, dict)}}


def _not_custom_dataset_advice(record: logging.LogRecord) -> bool:
    """lm-eval warns, for every task with a ``custom_dataset``, how to pass it ``--metadata``:
    advice that does not apply here (57 times for mmlu)."""
    return "Custom kwargs can be passed to `--metadata`" not in record.getMessage()


def task_manager(data_dir: str | os.PathLike | TaskData | None = None):
    """A TaskManager over the local configs only, their ``custom_dataset`` reading ``data_dir``
    (resolved now, so that every process of a distributed job reads the same folder); for
    ``TaskData("datasets")``, lm-eval's own hub-backed configs."""
    from lm_eval.tasks import TaskManager

    if isinstance(data_dir, TaskData):
        if data_dir.source == "datasets":
            return TaskManager()
        data_dir = data_dir.root

    task_log = logging.getLogger("lm_eval.api.task")
    if _not_custom_dataset_advice not in task_log.filters:
        task_log.addFilter(_not_custom_dataset_advice)
    return TaskManager(include_path=str(CONFIG_DIR), include_defaults=False,
                       metadata={"data_dir": str(root_dir(data_dir).resolve())})
