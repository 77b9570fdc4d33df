"""The distributed runtime: one tensor-parallel rank per process on ``torch.distributed``.

Started by ``torchrun`` (or ``--launch``, see :mod:`syncdrop.parallel.launch`), which sets
``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT``. The backend and
device are chosen once, by :func:`syncdrop.runtime.choose_runtime`. Every collective has a
timeout, so a rank that dies or hangs makes the others fail with a clear message instead of
waiting forever.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import resource
import sys
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from syncdrop.errors import SyncdropError
from syncdrop.parallel.comm import Communicator

# torch >= 2.13 deprecates all_gather_into_tensor in favour of all_gather_single (same semantics)
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 60.0


class RankFailure(RuntimeError):
    """A collective failed: a peer rank died, hung past the timeout, or the network broke."""


@dataclass(frozen=True)
class DistContext:
    rank: int
    world: int
    local_rank: int
    backend: str
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def launched_by_torchrun() -> bool:
    """True inside a process started by torchrun or ``--launch`` (the rendezvous env is set)."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


_CTX: DistContext | None = None
_TIMEOUT = timedelta(seconds=DEFAULT_TIMEOUT_S)  # the collective timeout of the joined group


def context() -> DistContext | None:
    """The initialised distributed context of this process, or None in single-process mode."""
    return _CTX


def local_rank() -> int:
    """This process's rank on its node (``LOCAL_RANK``, which torchrun and ``--launch`` set); the
    global rank is not a substitute on multiple nodes, so without it this is an error."""
    value = os.environ.get("LOCAL_RANK")
    if value is None:
        raise SyncdropError("LOCAL_RANK is not set: start the job with torchrun or --launch (they set it); "
                            "the global RANK is not this process's rank on its node")
    return int(value)


def local_world_size() -> int:
    """Ranks on this node (``LOCAL_WORLD_SIZE``, else ``WORLD_SIZE``: a single-node job)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))


def init(timeout_s: float = DEFAULT_TIMEOUT_S, backend: str = "gloo",
         device: torch.device | None = None) -> DistContext:
    """Join the process group (idempotent) with ``backend`` (``gloo`` or ``nccl``, chosen by
    :func:`syncdrop.runtime.choose_runtime`) and this rank's ``device``. ``timeout_s`` bounds every
    collective.

    NCCL reports failures asynchronously, so a dead peer would otherwise surface as a hang or an
    abort from a watchdog thread. Here every collective is issued with ``async_op=True`` and waited
    for with ``work.wait(timeout)`` under ``TORCH_NCCL_BLOCKING_WAIT=1`` (set unless the user set
    it), which makes the wait block this thread and raise when the peer is gone or the timeout
    passes; :func:`_guarded` turns that into :class:`RankFailure`. ``device_id`` binds the NCCL
    communicator to this rank's GPU at start-up (eager init: a missing peer fails here, not in the
    first collective)."""
    global _CTX, _TIMEOUT
    if _CTX is not None:
        return _CTX
    if backend not in ("gloo", "nccl"):
        raise SyncdropError(f"backend must be gloo or nccl, got {backend!r}")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = torch.device(device or "cpu")
    kwargs = {}
    if backend == "nccl":
        os.environ.setdefault("TORCH_NCCL_BLOCKING_WAIT", "1")
        # CleanUpOnly: on an error abort the communicators but keep the process, so that the failing
        # wait raises here and the rank exits with our one-line message and exit code
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
        torch.cuda.set_device(device)
        kwargs["device_id"] = device
    try:
        dist.init_process_group(backend, rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s), **kwargs)
    except Exception as e:  # rendezvous failed or timed out
        raise RankFailure(f"rank {rank}: could not join the process group of {world} ranks "
                          f"within {timeout_s:.0f}s ({_first_line(e)})") from e
    _TIMEOUT = timedelta(seconds=timeout_s)
    lr = int(os.environ.get("LOCAL_RANK", "0")) if device.type == "cpu" else local_rank()
    _CTX = DistContext(rank, world, lr, backend, device)
    log.info("rank %d/%d joined (%s on %s)", rank, world, backend, device)
    return _CTX


def shutdown(ok: bool = True) -> None:
    """Leave the process group: the one way out of the distributed runtime (success, error, interrupt).

    ``ok`` (this rank finished its work): first wait for every rank at a barrier bounded by the
    collective timeout (gloo: ``monitored_barrier``, which names the ranks that never arrived), so
    that no rank tears down its connections while a peer still has a collective in flight; a
    failure there raises :class:`RankFailure` after the group is destroyed. Not ``ok`` (an error or
    an interrupt on this rank): destroy at once, since the peers may be dead and a barrier would
    only wait for the timeout. Idempotent; a no-op outside the distributed runtime.
    """
    global _CTX
    ctx, _CTX = _CTX, None
    if ctx is None or not dist.is_initialized():
        return
    failure: RankFailure | None = None
    if ok and ctx.world > 1:
        try:
            if ctx.backend == "gloo":
                _guarded("shutdown barrier", dist.monitored_barrier, timeout=_TIMEOUT, wait_all_ranks=True,
                         async_op=False)
            else:
                _guarded("shutdown barrier", dist.barrier)
        except RankFailure as e:
            failure = e
    try:
        dist.destroy_process_group()
    except Exception as e:  # a broken group: nothing left to release that exiting does not release
        log.warning("rank %d: destroying the process group failed (%s)", ctx.rank, _first_line(e))
    if failure is not None:
        raise failure


def exit_worker(code: int) -> None:
    """End a distributed worker process with ``code``, skipping interpreter finalisation.

    Called after :func:`shutdown`. Finalisation would destroy whatever C++ state the backends still
    hold (communicator threads, the rendezvous store client) in an order the backends do not
    control; with a thread still joinable that ends in ``terminate called without an active
    exception`` and SIGABRT after the work is done. Everything this process owes has been flushed
    by then (result files are written atomically before), so ``os._exit`` is the clean way out.
    """
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:300] if text else type(e).__name__


def _guarded(what: str, fn, *args, async_op: bool = True, **kwargs):
    """Run a collective and wait for it, bounded by the collective timeout; turn any failure into a
    :class:`RankFailure` naming what happened. ``fn`` is issued with ``async_op=True`` and its work
    handle waited for with ``wait(timeout)``: under NCCL that is how an asynchronous error or a dead
    peer reaches this thread (see :func:`init`); under gloo it is the same bound. ``async_op=False``:
    a call that takes its own timeout (``monitored_barrier``)."""
    try:
        if not async_op:
            return fn(*args, **kwargs)
        work = fn(*args, async_op=True, **kwargs)
        if work is not None:
            work.wait(timeout=_TIMEOUT)
        return work
    except Exception as e:
        rank = _CTX.rank if _CTX else "?"
        raise RankFailure(f"rank {rank}: {what} failed: a peer rank died, hung past the timeout, "
                          f"or the link broke ({_first_line(e)})") from e


class DistComm(Communicator):
    """The :class:`~syncdrop.parallel.comm.Communicator` of the tensor-parallel process group (this
    process holds one rank). Every collective is bounded by the collective timeout (:func:`_guarded`).

    ``exact=False`` (default): ``torch.distributed.all_reduce`` (ring or tree, as the backend
    chooses). Its summation order differs per chunk, so results match the simulation only to
    float rounding. ``exact=True``: all-gather the partials and
    sum them in rank order, exactly as :class:`~syncdrop.parallel.comm.SimulatedComm` does, which
    reproduces the simulation bit for bit at N/2 times the traffic of a ring all-reduce.
    """

    def __init__(self, tp: int, group: dist.ProcessGroup | None = None, exact: bool = False) -> None:
        self.tp = tp
        self.group = group
        self.exact = exact
        self.calls = 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """``(1, M, h)`` local partial -> ``(1, M, h)`` sum over all ranks."""
        self.calls += 1
        x = x.contiguous()
        if self.tp == 1:
            return x
        if self.exact:
            parts = torch.empty((self.tp, *x.shape[1:]), dtype=x.dtype, device=x.device)  # (N, M, h)
            _guarded("all-gather", _ALL_GATHER, parts, x, group=self.group)
            return parts.sum(0, keepdim=True)
        _guarded("all-reduce", dist.all_reduce, x, group=self.group)
        return x


    def all_gather_last(self, x: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        """Concatenate every rank's ``x`` (``(..., sizes[rank])``) along the last axis, in rank order
        (the vocab-parallel LM head's logits). Slices are zero-padded to the largest for the gather."""
        n = max(sizes)
        pad = torch.nn.functional.pad(x, (0, n - x.shape[-1])).reshape(1, -1)  # (1, numel)
        parts = torch.empty((self.tp, pad.shape[1]), dtype=x.dtype, device=x.device)  # (N, numel)
        _guarded("all-gather", _ALL_GATHER, parts, pad, group=self.group)
        parts = parts.view(self.tp, *x.shape[:-1], n)  # (N, ..., n)
        return torch.cat([parts[r, ..., : sizes[r]] for r in range(self.tp)], dim=-1)

    def all_to_all(self, x: torch.Tensor) -> torch.Tensor:
        """``(1, N, X)`` -> ``(1, N, X)``: entry ``r`` of the result is entry ``rank`` of rank ``r``'s ``x``."""
        x = x.contiguous()
        out = torch.empty_like(x)
        if self.tp == 1:
            return x
        _guarded("all-to-all", dist.all_to_all_single, out.view(-1), x.view(-1), group=self.group)
        return out

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """``(1, X)`` -> ``(1, N, X)``: every rank's ``x`` in rank order."""
        x = x.contiguous().reshape(1, -1)
        parts = torch.empty((self.tp, x.shape[1]), dtype=x.dtype, device=x.device)  # (N, X)
        _guarded("all-gather", _ALL_GATHER, parts, x, group=self.group)
        return parts.unsqueeze(0)

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's ``x`` on every rank (a copy when ``x`` is not contiguous)."""
        x = x.contiguous()
        if self.tp > 1:
            _guarded("broadcast", dist.broadcast, x, src=0, group=self.group)
        return x

    def barrier(self) -> None:
        if self.tp > 1:
            barrier(self.group)

    def max_over_ranks(self, x: torch.Tensor) -> torch.Tensor:
        x = x.clone()
        if self.tp > 1:
            _guarded("all-reduce (max)", dist.all_reduce, x, op=dist.ReduceOp.MAX, group=self.group)
        return x


def barrier(group: dist.ProcessGroup | None = None) -> None:
    """Wait for every rank (under the collective timeout)."""
    _guarded("barrier", dist.barrier, group=group)


def fingerprint(obj: object) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


def check_agreement(what: dict, ctx: DistContext) -> None:
    """Refuse to start unless every rank has the same ``what`` (model, plan, TP, dtype...)."""
    digest = torch.tensor(list(bytes.fromhex(fingerprint(what))), dtype=torch.uint8, device=ctx.device)
    gathered = [torch.empty_like(digest) for _ in range(ctx.world)]
    _guarded("start-up agreement check", dist.all_gather, gathered, digest)
    bad = [r for r, g in enumerate(gathered) if not torch.equal(g, gathered[0])]
    if bad:
        raise SyncdropError(f"rank {ctx.rank}: ranks {bad} disagree with rank 0 on model/plan/TP/dtype; "
                            f"this rank has {json.dumps(what, sort_keys=True, default=str)[:300]}")


def gather_floats(values: list[float], ctx: DistContext) -> list[list[float]]:
    """All ranks' ``values`` (same length everywhere), on every rank."""
    t = torch.tensor(values, dtype=torch.float64, device=ctx.device)
    out = [torch.empty_like(t) for _ in range(ctx.world)]
    _guarded("gather", dist.all_gather, out, t)
    return [o.tolist() for o in out]


def peak_rss_mb() -> float:
    """Peak resident memory of this process so far (MB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
