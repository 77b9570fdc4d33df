"""syncdrop.progress: a tqdm bar on a terminal, plain rate-limited log lines anywhere else (issue 27 point 6).

No test waits on the wall clock: the clock is injected, or the interval is 0 (every update logs) or huge
(only closing lines can appear)."""

from __future__ import annotations

import io
import logging
import os
import subprocess
import sys

import pytest

from syncdrop.progress import DEFAULT_INTERVAL_S, INTERVAL_ENV, LogProgress, interval_from_env, progress_bar

LOGGER = "syncdrop.progress"


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER]


def test_a_terminal_gets_tqdm_anything_else_plain_lines() -> None:
    from tqdm import tqdm

    bar = progress_bar(total=3, desc="x", file=Terminal())
    assert isinstance(bar, tqdm)
    bar.close()
    assert isinstance(progress_bar(total=3, file=io.StringIO()), LogProgress)  # a file or a pipe
    assert isinstance(progress_bar(total=3, file=Terminal(), disable=True), LogProgress)  # silent either way


def test_lines_are_rate_limited_plus_one_at_the_end(caplog) -> None:
    """100 updates one (fake) second apart with a 10 s interval: a line at 10, 20, ..., 100 s and the closing one."""
    clock = FakeClock()
    with caplog.at_level(logging.INFO, logger=LOGGER):
        with progress_bar(total=100, desc="work", unit="step", file=io.StringIO(), interval=10, clock=clock) as bar:
            for i in range(100):
                clock.t += 1
                bar.update()
                bar.set_postfix(loss=0.5 / (i + 1), step=i)
            bar.set_description("work (last)")
    lines = _lines(caplog)
    assert len(lines) == 11, lines
    assert lines[0] == "work: 10/100 step (10%), 1 step/s, 10.0 s elapsed, ~1:30 min left, loss=0.05556, step=8"
    assert lines[-1] == "work (last): 100/100 step (100%), 1 step/s, done in 1:40 min, loss=0.005, step=99"
    assert not any("\r" in ln or "\n" in ln for ln in lines)


def test_updates_within_the_interval_log_nothing_until_it_has_passed(caplog) -> None:
    clock = FakeClock()
    with caplog.at_level(logging.INFO, logger=LOGGER):
        bar = LogProgress(total=None, desc="bench", unit="run", interval=10, clock=clock)
        for t in (3, 6, 9.5):
            clock.t = t
            bar.update(2)
        assert _lines(caplog) == []
        clock.t = 13
        bar.update(2)  # 13 s since the start: a line; the next one is due at 23 s
        clock.t = 22
        bar.update(2)
        assert _lines(caplog) == ["bench: 8 run, 1.62 s/run, 13.0 s elapsed"]  # under 1/s: s per unit
        bar.close()
        bar.close()  # idempotent
    assert len(_lines(caplog)) == 2 and _lines(caplog)[-1] == "bench: 10 run, 2.2 s/run, done in 22.0 s"


def test_transient_bars_close_silently_unless_they_logged(caplog) -> None:
    """leave=False (tqdm erases such a bar): a closing line only if the bar had already logged one."""
    clock = FakeClock()
    with caplog.at_level(logging.INFO, logger=LOGGER):
        with progress_bar(total=4, desc="quick", file=io.StringIO(), leave=False, interval=10, clock=clock) as bar:
            bar.update(4)
        assert _lines(caplog) == []
        items = list(progress_bar(range(3), desc="slow", unit="win", file=io.StringIO(), leave=False, interval=0))
    assert items == [0, 1, 2]
    assert [ln.split(",")[0] for ln in _lines(caplog)] == ["slow: 1/3 win (33%)", "slow: 2/3 win (67%)",
                                                           "slow: 3/3 win (100%)", "slow: 3/3 win (100%)"]
    assert "done in" in _lines(caplog)[-1]


def test_a_disabled_bar_is_silent_and_passes_items_through(caplog) -> None:
    with caplog.at_level(logging.INFO, logger=LOGGER):
        bar = progress_bar(["a", "b"], file=io.StringIO(), disable=True, interval=0)
        assert list(bar) == ["a", "b"] and len(bar) == 2
        bar.update(5)
        bar.close()
    assert _lines(caplog) == []


def test_resumed_bar_counts_its_rate_from_initial(caplog) -> None:
    clock = FakeClock()
    with caplog.at_level(logging.INFO, logger=LOGGER):
        with progress_bar(total=100, initial=90, desc="train", unit="step", file=io.StringIO(), clock=clock) as bar:
            clock.t = 5
            bar.update(10)
    assert _lines(caplog) == ["train: 100/100 step (100%), 2 step/s, done in 5.0 s"]


@pytest.mark.parametrize("raw,expected", [("", DEFAULT_INTERVAL_S), ("0", 0.0), (" 2.5 ", 2.5), ("abc", None),
                                          ("-1", None), ("nan", None), ("inf", None)])
def test_interval_from_the_environment(monkeypatch, caplog, raw: str, expected: float | None) -> None:
    monkeypatch.setenv(INTERVAL_ENV, raw)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        got = interval_from_env()
    if expected is None:  # malformed: a warning, and the default (a long run must not die on it)
        assert got == DEFAULT_INTERVAL_S
        assert f"{INTERVAL_ENV}={raw!r} is not a number of seconds >= 0" in caplog.text
    else:
        assert got == expected and not caplog.records


def _ppl(model_dir, text_file, interval: str) -> subprocess.CompletedProcess:
    env = {**os.environ, INTERVAL_ENV: interval}
    return subprocess.run([sys.executable, "-m", "syncdrop.cli", "ppl", "--model", str(model_dir), "--tp", "2",
                           "--dataset", str(text_file), "--seq-len", "32", "--max-windows", "4"],
                          capture_output=True, text=True, timeout=300, env=env)


def test_syncdrop_ppl_with_stderr_not_a_terminal(tiny_llama_dir, text_file) -> None:
    """The real command, its stderr a pipe: plain lines (no carriage return), one per update at interval 0, none
    at an interval no run reaches (both bars there are transient, so not even a closing line)."""
    every = _ppl(tiny_llama_dir, text_file, "0")
    assert every.returncode == 0, every.stderr
    assert "\r" not in every.stderr and "\x1b" not in every.stderr
    ppl_lines = [ln for ln in every.stderr.splitlines() if ln.startswith(f"INFO {LOGGER}: perplexity: ")]
    # 4 windows, batch 1: a line per window and the closing one
    assert [ln.split(",")[0].split(": ", 1)[1] for ln in ppl_lines] == \
        [f"perplexity: {i}/4 win ({25 * i}%)" for i in (1, 2, 3, 4, 4)], every.stderr
    assert "done in" in ppl_lines[-1] and "ppl=" in ppl_lines[-1]
    assert any(ln.startswith(f"INFO {LOGGER}: sharding blocks: ") for ln in every.stderr.splitlines())

    rare = _ppl(tiny_llama_dir, text_file, "1e9")
    assert rare.returncode == 0, rare.stderr
    assert LOGGER not in rare.stderr and "\r" not in rare.stderr, rare.stderr
    assert "ppl " in rare.stdout
