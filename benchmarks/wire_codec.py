"""What a compressed sync point's encoding and decoding cost one rank, against the link time its bytes save.

For each wire format, payload (``tokens`` x ``hidden``) and TP degree N, one rank's share of the two-step
all-reduce's local work (:meth:`syncdrop.plan.wire.WireFormat.two_step`: encode the partial, decode the N
chunks it receives, sum them, encode the sum, decode the N gathered sums) is timed with a loopback
exchange: the all-to-all hands the rank its own chunks back and the all-gather repeats its own sum N
times, so every byte the real collectives would deliver is written and read, and no time is spent on a
link. That is the time a compressed sync point adds over a plain all-reduce, whose sums happen inside
the collective (the plain ring's own adds are not subtracted: this is an upper bound on the added work).

Beside it: the bytes one rank hands to the exchange (plain: the dtype's; compressed: the encoded,
padded partial), the link time they save on a ring (:func:`syncdrop.bench.ring.ring_all_reduce_s`,
bandwidth term only: the two-step takes the ring's ``2 (N - 1)`` steps), and the **break-even
bandwidth**: the link speed above which encoding costs more than the bytes it saves,
``2 (N-1)/N * saved_bytes / codec_s``.

Formats are timed interleaved (one rep of each, then the next rep), on ``--threads`` threads (default 1:
one core per rank, as in the latency bench). Writes ``OUT.json`` (command, provenance, settings, raw
samples, medians with bootstrap intervals) and ``OUT.md``. Example::

    python benchmarks/wire_codec.py --hidden 576,4096 --tokens 1,128,1024 --tp 2,3 --out results/wire_codec/cpu
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time

import torch

from syncdrop.bench.ring import ring_all_reduce_s
from syncdrop.bench.stats import median_ci
from syncdrop.errors import SyncdropError
from syncdrop.io_utils import atomic_write_json, atomic_write_text, provenance
from syncdrop.plan.wire import WireFormat, parse_wire
from syncdrop.runtime import parse_dtype

log = logging.getLogger("wire_codec")
LINKS = {"100MB/s": 1e8, "1GB/s": 1e9}  # bytes per second


class Loopback:
    """The two exchanges of :class:`syncdrop.plan.wire.Exchanges` for one rank of ``tp``, without a link:
    the all-to-all returns the rank's own chunks, the all-gather its own sum ``tp`` times (a real copy)."""

    def __init__(self, tp: int) -> None:
        self.tp = tp

    def all_to_all(self, x: torch.Tensor) -> torch.Tensor:
        return x.clone()  # (1, N, X): the chunks the rank would receive (same bytes)

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        return x.unsqueeze(1).expand(x.shape[0], self.tp, x.shape[1]).contiguous()  # (1, X) -> (1, N, X)


def time_once(wire: WireFormat, x: torch.Tensor, tp: int) -> float:
    """Seconds of one rank's two-step local work on partial ``x`` ``(1, M, h)``."""
    t0 = time.perf_counter()
    wire.two_step(Loopback(tp), x)
    return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--formats", default="bf16,fp8,int8,int4,int4:g32,int8h,int4h:g32",
                    help="comma-separated wire formats")
    ap.add_argument("--hidden", default="576,4096", help="comma-separated hidden sizes (SmolLM2-135M, Llama-8B)")
    ap.add_argument("--tokens", default="1,128,1024", help="comma-separated token counts (decode ... prefill)")
    ap.add_argument("--tp", default="2,3", help="comma-separated TP degrees")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="the partials' dtype")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default="results/wire_codec/cpu")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        wires = [parse_wire(f, "--formats") for f in args.formats.split(",")]
        hiddens = [int(v) for v in args.hidden.split(",")]
        tokens = [int(v) for v in args.tokens.split(",")]
        tps = [int(v) for v in args.tp.split(",")]
        for w in wires:
            for h in hiddens:
                w.check(h)
    except (ValueError, SyncdropError) as e:  # one line, exit 2
        print(f"error: {getattr(e, 'message', e)}", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    dtype = parse_dtype(args.dtype)
    elem = torch.empty((), dtype=dtype).element_size()
    gen = torch.Generator().manual_seed(0)
    rows = []
    for h in hiddens:
        for T in tokens:
            x = torch.randn(1, T, h, generator=gen).to(dtype)  # (1, M, h): one rank's partial
            for tp in tps:
                samples: dict[str, list[float]] = {str(w): [] for w in wires}
                for rep in range(args.warmup + args.reps):
                    for w in wires:  # interleaved: machine noise hits every format alike
                        s = time_once(w, x, tp)
                        if rep >= args.warmup:
                            samples[str(w)].append(s)
                plain = T * h * elem
                for w in wires:
                    xs = samples[str(w)]
                    med = statistics.median(xs)
                    enc = w.two_step_bytes(T * h, tp)
                    saved = plain - enc
                    link_saved = {name: ring_all_reduce_s(saved, tp, 0.0, bw) * 1e3 for name, bw in LINKS.items()}
                    rows.append({"hidden": h, "tokens": T, "tp": tp, "wire": str(w), "plain_bytes": plain,
                                 "wire_bytes": enc, "codec_ms": med * 1e3,
                                 "codec_ms_ci": [c * 1e3 for c in median_ci(xs) or (med, med)],
                                 "link_ms_saved": link_saved,
                                 "break_even_GBps": (2 * (tp - 1) / tp * saved / med / 1e9) if saved > 0 else None,
                                 "samples_ms": [s * 1e3 for s in xs]})
                    log.info("h=%d T=%d N=%d %-8s codec %.3f ms, %d -> %d bytes", h, T, tp, w, med * 1e3, plain, enc)
    res = {"command": " ".join(sys.argv), **provenance(),
           "settings": {k: getattr(args, k) for k in ("formats", "hidden", "tokens", "tp", "dtype", "reps", "warmup",
                                                       "threads")},
           "rows": rows}
    atomic_write_json(f"{args.out}.json", res)
    lines = [f"# Two-step codec time per sync point, one rank ({args.dtype} partials, {args.threads} thread(s))", "",
             f"`{res['command']}` (commit {res.get('commit')}). Median of {args.reps} interleaved reps, 95% bootstrap "
             "interval. *saved*: link time the smaller payload saves on a ring (bandwidth term); *break-even*: the "
             "link speed above which the codec costs more than it saves.", "",
             "| hidden | tokens | N | wire | bytes / plain | codec ms [95% CI] | saved ms @100 MB/s | saved ms @1 GB/s "
             "| break-even GB/s |", "|---:|---:|---:|---|---:|---|---:|---:|---:|"]
    for r in rows:
        be = "—" if r["break_even_GBps"] is None else f"{r['break_even_GBps']:.2f}"
        lo, hi = r["codec_ms_ci"]
        ratio = r["wire_bytes"] / r["plain_bytes"]
        lines.append(f"| {r['hidden']} | {r['tokens']} | {r['tp']} | {r['wire']} | {ratio:.3f} "
                     f"| {r['codec_ms']:.3f} [{lo:.3f}, {hi:.3f}] | {r['link_ms_saved']['100MB/s']:.3f} "
                     f"| {r['link_ms_saved']['1GB/s']:.3f} | {be} |")
    atomic_write_text(f"{args.out}.md", "\n".join(lines) + "\n")
    log.info("wrote %s.json and %s.md", args.out, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
