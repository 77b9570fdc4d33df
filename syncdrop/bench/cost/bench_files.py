"""Reading ``syncdrop bench`` result files into what the cost model fits and checks (:class:`BenchRun`).

Per file: the settings (model, ``tp``, prompt length ``S``, batch ``B``, timed decode steps ``D``,
dtype, emulated link), the median all-reduce time of each payload timed, and per plan its sync
counts and median TTFT and decode step. Bench times decode steps ``i = 1..D``, step ``i`` attending
to ``S + i`` keys, so the mean context of a decode step is::

    c = S + (D + 1) / 2

Older formats are read as they were written:

* no ``comm_units`` in a plan row: no partial plans then, ``u = n_ar`` (every collective a full payload);
* no ``codec_units``: no compressed sync points then (``0``);
* ``partial`` instead of ``vocab_gather``: the plan had the vocab-parallel LM head;
* ``settings.link`` without ``formula``: the emulation waited ``latency + n / bandwidth`` per
  all-reduce whatever ``N`` (``flat``, :class:`syncdrop.bench.ring.Link`);
* no ``allreduce_sizes`` (before the payload sweep): the prefill and decode payloads alone;
* ``allreduce_sizes`` without ``samples_ms``: their medians (else the fastest sample, :func:`_fastest_ms`);
* no ``settings.model_config``: the architecture of the named model (:mod:`.arch`), or resolved like
  ``--model`` and checked against the recorded ``hidden_size`` and ``num_layers``;
* no ``dtype``: float32.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from syncdrop.bench.cost.arch import bench_model_config
from syncdrop.bench.ring import Link
from syncdrop.errors import SyncdropError
from syncdrop.models.config import ModelConfig

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class BenchRun:
    """The parts of a ``syncdrop bench`` JSON file the model uses (times in seconds)."""

    path: str
    model: str
    cfg: ModelConfig
    tp: int
    prompt_len: int
    batch: int
    decode_tokens: int
    dtype_bytes: int
    emu_bandwidth: float | None
    emu_latency: float
    threads_per_rank: int | None
    allreduce: dict[str, tuple[int, float]]  # phase -> (bytes, median seconds)
    # per plan: plan, spd_fraction, allreduces_per_forward, comm_units, codec_units, vocab_gather, ttft_s, decode_s
    plans: list[dict[str, Any]]
    emu_formula: str = "ring"  # "flat": written before the ring emulation (syncdrop.bench.link.Link)
    allreduce_sizes: tuple[tuple[int, float], ...] = ()  # (bytes, median seconds) of every payload timed

    def __post_init__(self) -> None:
        if not self.allreduce_sizes:  # files from before the payload sweep: the prefill and decode payloads
            object.__setattr__(self, "allreduce_sizes", tuple(self.allreduce.values()))

    @property
    def emulated(self) -> bool:
        return self.emu_bandwidth is not None or self.emu_latency > 0

    @property
    def link_label(self) -> str:
        if not self.emulated:
            return "none"
        bw = f"{self.emu_bandwidth / 1e6:g}MB/s" if self.emu_bandwidth else "inf"
        return f"{bw}+{self.emu_latency * 1e6:g}us"

    @property
    def decode_context(self) -> float:
        """Mean keys per timed decode step: bench times steps i = 1..decode_tokens, step i sees S + i keys."""
        return self.prompt_len + (self.decode_tokens + 1) / 2


def load_bench(path: str | Path, arg: str = "--check") -> BenchRun:
    """Read and validate a bench result file; errors name ``arg`` and the file."""
    p = Path(path)
    where = f"{arg} {str(path)!r}"
    if not p.is_file():
        raise SyncdropError(f"{where}: no such file")
    try:
        d = json.loads(p.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError, OSError) as e:
        raise SyncdropError(f"{where}: malformed JSON ({e})") from None
    return bench_result(d, where, str(path))


def _fastest_ms(timing: dict[str, Any]) -> float:
    """The isolated all-reduce time the link model fits: the fastest sample (the median where the file has no
    samples). On a loaded CPU the samples are bimodal, the link's cost or that plus a scheduler tick (about
    4 ms) when the peer rank was not running, and the median lands in either mode; the wait of ranks that
    drift apart inside a forward is the fitted per-sync-point term instead (:mod:`.fit`)."""
    samples = [float(x) for x in timing.get("samples_ms") or []]
    return min(samples) if samples else float(timing["median_ms"])


def bench_result(d: Any, where: str, path: str = "") -> BenchRun:
    """Validate a bench result already in memory (what ``syncdrop bench --json`` writes, or
    :func:`syncdrop.bench.run.run_bench` returns); ``where`` names it in errors, ``path`` is recorded."""
    try:
        s = d["settings"]
        ar = {ph: (int(d["allreduce"][ph]["bytes"]), float(d["allreduce"][ph]["median_ms"]) / 1e3)
              for ph in ("prefill", "decode")}
        plans = [{"plan": str(r["plan"]), "spd_fraction": float(r["spd_fraction"]),
                  "allreduces_per_forward": int(r["allreduces_per_forward"]),
                  "comm_units": float(r.get("comm_units", r["allreduces_per_forward"])),
                  "codec_units": float(r.get("codec_units", 0.0)),
                  "vocab_gather": bool(r.get("vocab_gather", r.get("partial", False))),
                  "ttft_s": float(r["ttft_ms"]) / 1e3, "decode_s": float(r["decode_ms"]) / 1e3}
                 for r in d["plans"]]
        link = Link.from_dict(s.get("link"))
        run = BenchRun(
            path=path, model=str(s["model"]), cfg=None, tp=int(s["tp"]),  # type: ignore[arg-type]
            prompt_len=int(s["prompt_len"]), batch=int(s["batch"]), decode_tokens=int(s["decode_tokens"]),
            dtype_bytes=_DTYPE_BYTES[s.get("dtype", "float32")],
            emu_bandwidth=link.bandwidth, emu_latency=link.latency,
            threads_per_rank=s.get("threads_per_rank"), allreduce=ar, plans=plans, emu_formula=link.formula,
            allreduce_sizes=tuple((int(x["bytes"]), _fastest_ms(x) / 1e3) for x in d.get("allreduce_sizes", [])))
        hidden, layers = int(s["hidden_size"]), int(s["num_layers"])
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise SyncdropError(f"{where}: not a syncdrop bench result (bad or missing {e})") from None
    if not plans or run.tp < 1 or run.prompt_len < 1 or run.batch < 1:
        raise SyncdropError(f"{where}: not a syncdrop bench result (no plans, or tp/prompt_len/batch < 1)")
    times = [t for _, t in ar.values()] + [p[k] for p in plans for k in ("ttft_s", "decode_s")]
    if not all(math.isfinite(t) and t > 0 for t in times):
        raise SyncdropError(f"{where}: not a usable bench result (a time is zero, negative or not finite)")
    if isinstance(s.get("model_config"), dict):  # written by bench since it records the architecture
        try:
            cfg = ModelConfig.from_dict(s["model_config"])
        except (TypeError, ValueError) as e:
            raise SyncdropError(f"{where}: bad model_config ({e})") from None
    else:
        cfg = bench_model_config(run.model, hidden, layers, where)
    return dataclasses.replace(run, cfg=cfg)
