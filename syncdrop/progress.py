"""Progress reporting that reads well on a terminal and in a log file.

:func:`progress_bar` is the one way syncdrop shows progress. On a terminal (the bar's stream,
``sys.stderr`` by default, is a TTY) it returns a :class:`tqdm.tqdm`. Anywhere else (``make demo > log
2>&1``, a CI job, a worker whose stderr is a pipe) it returns a :class:`LogProgress`: the same interface
as far as syncdrop uses it (``update``, ``set_postfix``, ``set_description``, ``close``, a context
manager, iteration over a wrapped iterable), but instead of redrawing a bar with carriage returns it
logs a plain line through :mod:`logging` (logger ``syncdrop.progress``, level INFO)

* at most once every ``interval`` seconds while it runs (``$SYNCDROP_PROGRESS_INTERVAL``, default
  :data:`DEFAULT_INTERVAL_S`; 0 logs every update), and
* once when it closes, for ``leave=True`` bars. A ``leave=False`` bar is transient (tqdm erases it):
  it gets a closing line only if it already logged one, so a stage that ends within ``interval``
  seconds (building the shards of a small model, a short evaluation inside a sweep) stays silent.

A line reads ``perplexity: 12/64 win (19%), 2.1 win/s, 5.7 s elapsed, ~24.8 s left, ppl=12.345``.

The ``syncdrop.progress`` logger is set to INFO when it is imported unconfigured, so the lines show
under the CLI's default WARNING level as long as some handler is installed (the CLI installs one);
``logging.getLogger("syncdrop.progress").setLevel(logging.WARNING)`` silences them, as does ``-q``.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TextIO

log = logging.getLogger(__name__)
if log.level == logging.NOTSET:
    log.setLevel(logging.INFO)

DEFAULT_INTERVAL_S = 10.0
INTERVAL_ENV = "SYNCDROP_PROGRESS_INTERVAL"


def interval_from_env() -> float:
    """Seconds between two progress lines: ``$SYNCDROP_PROGRESS_INTERVAL`` (a number >= 0), else
    :data:`DEFAULT_INTERVAL_S`. A malformed value logs a warning and gives the default (a long run
    must not die on it when its first progress bar starts)."""
    raw = os.environ.get(INTERVAL_ENV, "").strip()
    if not raw:
        return DEFAULT_INTERVAL_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not (value >= 0 and math.isfinite(value)):
        log.warning("%s=%r is not a number of seconds >= 0; using %g", INTERVAL_ENV, raw, DEFAULT_INTERVAL_S)
        return DEFAULT_INTERVAL_S
    return value


def is_terminal(stream: Any) -> bool:
    """True when ``stream`` is an open terminal (False for pipes, files, None, closed streams)."""
    try:
        return bool(stream is not None and stream.isatty())
    except (AttributeError, ValueError, OSError):
        return False


def _num(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def _seconds(s: float) -> str:
    if s < 60:
        return f"{s:.1f} s"
    m, s = divmod(int(round(s)), 60)
    return f"{m}:{s:02d} min" if m < 60 else f"{m // 60}:{m % 60:02d}:{s:02d} h"


class LogProgress:
    """A progress bar that logs plain, rate-limited lines (see the module docstring). ``clock``
    (default :func:`time.monotonic`) and ``interval`` (default :func:`interval_from_env`) can be
    injected; ``logger`` defaults to ``syncdrop.progress``."""

    def __init__(self, iterable: Iterable[Any] | None = None, *, total: float | None = None,
                 desc: str | None = None, unit: str = "it", disable: bool = False, leave: bool = True,
                 initial: float = 0, interval: float | None = None, clock: Callable[[], float] | None = None,
                 logger: logging.Logger | None = None) -> None:
        if total is None and iterable is not None:
            try:
                total = len(iterable)  # type: ignore[arg-type]
            except (TypeError, AttributeError):
                total = None
        self.iterable = iterable
        self.total = total
        self.desc = desc or ""
        self.unit = unit
        self.disable = disable
        self.leave = leave
        self.n = initial
        self.initial = initial
        self.postfix = ""
        self.interval = interval if interval is not None else 0.0 if disable else interval_from_env()
        self._clock = clock or time.monotonic
        self._log = logger or log
        self.start_t = self._clock()
        self._last_t = self.start_t
        self.lines = 0  # lines logged so far
        self._closed = disable

    # ------------------------------------------------------------------ tqdm's interface

    def update(self, n: float = 1) -> None:
        if self.disable:
            return
        self.n += n
        now = self._clock()
        if now - self._last_t >= self.interval:
            self._emit(now)

    def set_postfix(self, ordered_dict: dict[str, Any] | None = None, refresh: bool = True, **kwargs: Any) -> None:
        items = {**(ordered_dict or {}), **kwargs}
        self.postfix = ", ".join(f"{k}={_num(v)}" for k, v in items.items())

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None:
        self.postfix = str(s)

    def set_description(self, desc: str | None = None, refresh: bool = True) -> None:
        self.desc = desc or ""

    set_description_str = set_description

    def refresh(self) -> None:
        """Nothing to redraw: lines are logged by :meth:`update` and :meth:`close`."""

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.leave or self.lines:
            self._emit(self._clock(), done=True)

    def __enter__(self) -> LogProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __iter__(self) -> Iterator[Any]:
        if self.iterable is None:
            raise TypeError("this progress bar wraps no iterable")
        try:
            for item in self.iterable:
                yield item
                self.update(1)
        finally:
            self.close()

    def __len__(self) -> int:
        if self.total is not None:
            return int(self.total)
        return len(self.iterable)  # type: ignore[arg-type]

    # ------------------------------------------------------------------ the line

    def format_line(self, now: float, done: bool = False) -> str:
        """``desc: n/total unit (pct%), rate, elapsed[, ~left][, postfix]`` (no carriage return)."""
        elapsed = max(now - self.start_t, 0.0)
        n = _num(self.n)
        count = f"{n}/{_num(self.total)} {self.unit} ({100 * self.n / self.total:.0f}%)" if self.total else \
            f"{n} {self.unit}"
        parts = [count]
        rate = (self.n - self.initial) / elapsed if elapsed > 0 else None
        if rate:
            parts.append(f"{rate:.3g} {self.unit}/s" if rate >= 1 else f"{1 / rate:.3g} s/{self.unit}")
        parts.append(f"{_seconds(elapsed)} elapsed" if not done else f"done in {_seconds(elapsed)}")
        if not done and rate and self.total and self.total > self.n:
            parts.append(f"~{_seconds((self.total - self.n) / rate)} left")
        if self.postfix:
            parts.append(self.postfix)
        head = f"{self.desc}: " if self.desc else ""
        return (head + ", ".join(parts)).replace("\r", " ").replace("\n", " ")

    def _emit(self, now: float, done: bool = False) -> None:
        self._last_t = now
        self.lines += 1
        self._log.info("%s", self.format_line(now, done))


def progress_bar(iterable: Iterable[Any] | None = None, *, total: float | None = None, desc: str | None = None,
                 unit: str = "it", disable: bool = False, leave: bool = True, initial: float = 0,
                 file: TextIO | None = None, interval: float | None = None,
                 clock: Callable[[], float] | None = None) -> Any:
    """A :class:`tqdm.tqdm` when ``file`` (default ``sys.stderr``) is a terminal, else a
    :class:`LogProgress` (``interval``/``clock``: see there). The arguments are tqdm's."""
    stream = sys.stderr if file is None else file
    if disable or not is_terminal(stream):
        return LogProgress(iterable, total=total, desc=desc, unit=unit, disable=disable, leave=leave,
                           initial=initial, interval=interval, clock=clock)
    from tqdm import tqdm

    return tqdm(iterable, total=total, desc=desc, unit=unit, leave=leave, initial=initial, file=file)
