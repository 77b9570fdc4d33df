"""Atomic file writes and provenance for result files."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    """Write ``data`` to ``path`` via a temp file in the same directory and ``os.replace`` (the file gets
    the usual permissions, 0666 less the umask, not the temp file's 0600)."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=p.parent, prefix=f".{p.name}.", suffix=".tmp")
    try:
        os.chmod(tmp, 0o666 & ~_umask())
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, p)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_png(path: str | Path, fig, dpi: int = 120) -> None:
    """A matplotlib figure as a PNG at ``path``, written atomically (:func:`atomic_write_bytes`)."""
    import io

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    atomic_write_bytes(path, buf.getvalue())


def atomic_write_text(path: str | Path, text: str) -> None:
    atomic_write_bytes(path, text.encode())


def atomic_write_json(path: str | Path, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=False) + "\n")


def git_commit(root: str | Path | None = None) -> str | None:
    """Commit of the syncdrop checkout (or of the git work tree at ``root``), suffixed ``-dirty`` when it has
    local changes, if any. Changes under ``results/`` do not count: a run that rewrites its own committed result
    files ran the committed code."""
    root = Path(__file__).resolve().parent.parent if root is None else Path(root)
    try:
        rev = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True,
                             timeout=5, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".", ":(exclude)results"],
                               cwd=root, capture_output=True, text=True, timeout=5).stdout.strip()
        return rev + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return None


def portable_path(path: str | Path) -> str:
    """``path`` as a result file should record it: relative to the working directory when it lies below it.

    A result or plan file is read on other machines and in other checkouts, where this machine's absolute
    paths mean nothing; a path outside the working directory is kept as given.
    """
    p = Path(path)
    if p.is_absolute():
        try:
            return str(p.resolve().relative_to(Path.cwd().resolve()))
        except ValueError:
            return str(p)
    return str(p)


def command_line() -> str:
    """This process's command (the script's name and its arguments), quoted where an argument needs it."""
    return shlex.join([Path(sys.argv[0]).name, *sys.argv[1:]])


def provenance() -> dict[str, Any]:
    """Command, commit and machine facts stored in every result file."""
    import torch

    return {
        "command": command_line(),
        "commit": git_commit(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "machine": f"{platform.machine()} {platform.system()} cpus={os.cpu_count()}",
        "threads": torch.get_num_threads(),
    }


@contextlib.contextmanager
def atomic_directory(path: str | Path, replace: bool = False) -> Iterator[Path]:
    """Build a directory in a hidden sibling and move it to ``path`` only when the block succeeds.

    ``path`` must not exist or be an empty directory, unless ``replace`` (then the old directory is
    removed after the new one is in place). On any error the sibling is removed: nothing half-written
    is ever at ``path``."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=p.parent, prefix=f".{p.name}.", suffix=".tmp"))
    try:
        os.chmod(tmp, 0o777 & ~_umask())
        yield tmp
        old = None
        if p.exists():
            if p.is_dir() and not any(p.iterdir()):
                p.rmdir()
            elif not replace:
                raise FileExistsError(f"{p} exists and is not an empty directory")
            else:
                old = p.parent / f".{p.name}.old-{os.getpid()}"
                os.replace(p, old)
        os.replace(tmp, p)
        if old is not None:
            shutil.rmtree(old) if old.is_dir() else old.unlink()
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
