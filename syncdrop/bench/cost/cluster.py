"""Latency of SPD plans on a GPU cluster: a named hardware profile, links by bandwidth class, the paper.

Per link, prompt length ``S`` and SPD fraction ``f`` (the ``frac:F`` plan, ``n_ar = 2 L - round(f L)``
sync points; :mod:`.forward`), with the roofline of :mod:`.compute` and no per-sync cost::

    F_eff   = peak_flops * mfu,   HBM_eff = hbm_bw                (:data:`HARDWARE_PROFILES`)
    TTFT    = T_compute(prefill of S) + n_ar * T_ring(B S h bytes, N)
    decode  = T_compute(decode at c)  + n_ar * T_ring(B h bytes, N),   c = S + gen_tokens // 2
    e2e     = TTFT + (gen_tokens - 1) * decode

Reductions are relative to SPD 0%. The LM head is vocab-parallel (Megatron): its FLOPs and weights
are divided by ``N``, its small logits gather is ignored. A link without an explicit ``alpha`` takes
its bandwidth class's (:data:`ALPHA_BY_CLASS`).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from syncdrop.bench.cost.comm import CommModel
from syncdrop.bench.cost.compute import ComputeModel, decode_work, prefill_work
from syncdrop.bench.cost.forward import predict_decode, predict_ttft
from syncdrop.errors import SyncdropError
from syncdrop.models.config import ModelConfig

if TYPE_CHECKING:
    from syncdrop.plan import SyncPlan


@dataclass(frozen=True)
class HardwareProfile:
    """What one GPU of the cluster delivers, and the precision it runs at (:data:`HARDWARE_PROFILES`)."""

    peak_flops: float  # dense tensor-core peak at the payload precision, FLOP/s
    mfu: float  # fraction of peak the GEMMs reach when compute-bound
    hbm_bw: float  # effective (achievable streaming) HBM bandwidth, bytes/s
    layer_overhead_s: float = 0.0  # fixed time per block (kernel launches, norms, ...)
    dtype_bytes: int = 2  # bytes per weight, activation and all-reduce payload element

    def compute(self) -> ComputeModel:
        return ComputeModel(self.peak_flops * self.mfu, self.layer_overhead_s, self.hbm_bw)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


HARDWARE_PROFILES: dict[str, HardwareProfile] = {
    # NVIDIA A100-80GB, bf16: 312 TFLOP/s dense bf16 tensor-core peak, half of it reached by the GEMMs;
    # 2.04 TB/s HBM2e peak x ~75% achievable streaming = 1.5 TB/s; no per-block overhead.
    "a100-80gb-bf16": HardwareProfile(peak_flops=312e12, mfu=0.5, hbm_bw=1.5e12, layer_overhead_s=0.0, dtype_bytes=2),
}
DEFAULT_PROFILE = "a100-80gb-bf16"


@dataclass(frozen=True)
class ClusterLink:
    """A TP interconnect: bandwidth ``beta`` (bytes/s) and per-step latency ``alpha`` (s)."""

    label: str
    beta: float
    alpha: float


# Per-step latency by bandwidth class (the fastest class whose bandwidth the link reaches). A ring
# over 8 ranks pays 14 alpha, so these give 14-28 us (NVLink, ~NCCL's small-message all-reduce on
# an 8x A100 box), ~70 us (InfiniBand between nodes) and ~140 us (PCIe without peer-to-peer:
# every step bounces through host memory).
ALPHA_BY_CLASS: tuple[tuple[float, float, str], ...] = (
    (100e9, 1.5e-6, "NVLink-class"),
    (25e9, 5e-6, "inter-node InfiniBand-class"),
    (0.0, 10e-6, "PCIe without P2P-class"),
)


def default_alpha(beta: float) -> tuple[float, str]:
    """``(alpha, class name)`` of the fastest class of :data:`ALPHA_BY_CLASS` that ``beta`` reaches."""
    for bw, alpha, name in ALPHA_BY_CLASS:
        if beta >= bw:
            return alpha, name
    return ALPHA_BY_CLASS[-1][1], ALPHA_BY_CLASS[-1][2]


def spd_plan(num_layers: int, spd_fraction: float) -> SyncPlan:
    """The ``frac:F`` plan for ``F = spd_fraction``: the last ``round(F L)`` blocks drop their
    attention sync, ``collectives_per_forward = 2 L - round(F L)`` (what the cluster prediction evaluates)."""
    from syncdrop.plan import resolve_plan

    if not 0 <= spd_fraction <= 1:
        raise SyncdropError(f"SPD fraction must be between 0 and 1, got {spd_fraction}")
    return resolve_plan(f"frac:{spd_fraction!r}", num_layers)


def cluster_predict(cfg: ModelConfig, gpus: int, links: list[ClusterLink], prompt_lens: list[int],
                    fractions: list[float], spec: HardwareProfile = HARDWARE_PROFILES[DEFAULT_PROFILE],
                    batch: int = 1, gen_tokens: int = 128) -> list[dict[str, Any]]:
    """TTFT, decode step and end-to-end latency (TTFT + (gen_tokens - 1) decode steps at the mean
    context) for every link x prompt length x SPD fraction; reductions are relative to SPD 0%.
    The LM head is vocab-parallel (Megatron), its small logits gather is ignored."""
    compute = spec.compute()
    rows = []
    for link in links:
        comm = CommModel(link.alpha, link.beta)
        for S in prompt_lens:
            ctx = S + max(gen_tokens, 1) // 2
            base = None
            pre_w = prefill_work(cfg, gpus, S, batch, spec.dtype_bytes, lm_head_parallel=True)
            dec_w = decode_work(cfg, gpus, ctx, batch, spec.dtype_bytes, lm_head_parallel=True)
            for f in fractions:
                n = spd_plan(cfg.num_layers, f).collectives_per_forward
                ttft = predict_ttft(cfg, gpus, S, n, compute, comm, batch, spec.dtype_bytes, True)
                dec = predict_decode(cfg, gpus, ctx, n, compute, comm, batch, spec.dtype_bytes, True)
                e2e = ttft + max(gen_tokens - 1, 0) * dec
                ar_pre = comm.allreduce(batch * S * cfg.hidden_size * spec.dtype_bytes, gpus)
                if base is None:
                    base = (ttft, dec, e2e)
                rows.append({
                    "link": link.label, "beta_Bps": link.beta, "alpha_s": link.alpha, "prompt_len": S,
                    "spd_fraction": f, "allreduces_per_forward": n,
                    "ttft_ms": ttft * 1e3, "ttft_reduction": 1 - ttft / base[0],
                    "ttft_comm_share": n * ar_pre / ttft,
                    "decode_ms": dec * 1e3, "decode_reduction": 1 - dec / base[1],
                    "e2e_ms": e2e * 1e3, "e2e_reduction": 1 - e2e / base[2],
                    "prefill_mfu": pre_w.flops / (compute.time(pre_w) * spec.peak_flops),
                    "decode_mfu": dec_w.flops / (compute.time(dec_w) * spec.peak_flops),
                })
    return rows


PAPER_POINT = {"model": "llama2-70b", "gpus": 8, "link_Bps": 10e9, "spd_fraction": 0.7,
               "latency_reduction": 0.197,
               "source": "SPD paper, Kim et al., ICML 2025, arXiv:2502.20727 "
                         "(section 6: LLaMA2-70B, 8x A100, 10 GB/s, 70% SPD)"}


def paper_comparison(rows: list[dict[str, Any]], num_layers: int = 80) -> list[dict[str, Any]]:
    """Our 70%-SPD reductions on the link closest to the paper's 10 GB/s, per prompt length.

    Dropping a fraction ``k / 2L`` of the sync points removes that fraction of the communication
    time, so ``reduction = k / 2L * comm_share(SPD 0%)``; the paper's figure therefore implies a
    communication share of ``0.197 / (56 / 160) = 56%`` of its measured latency, which is set beside
    the model's share (``implied_comm_share``)."""
    if not rows:
        return []
    best = min({r["beta_Bps"] for r in rows}, key=lambda b: abs(math.log(b / PAPER_POINT["link_Bps"])))
    f = PAPER_POINT["spd_fraction"]
    dense, spd = (spd_plan(num_layers, x).collectives_per_forward for x in (0.0, f))
    removed = (dense - spd) / dense  # fraction of the sync points the plan drops: 56 / 160 for 70B
    out = []
    for r in rows:
        if r["beta_Bps"] == best and abs(r["spd_fraction"] - f) < 1e-9:
            r0 = next(x for x in rows if x["link"] == r["link"] and x["prompt_len"] == r["prompt_len"]
                      and x["spd_fraction"] == 0)
            out.append({"link": r["link"], "prompt_len": r["prompt_len"], "ttft_reduction": r["ttft_reduction"],
                        "decode_reduction": r["decode_reduction"], "e2e_reduction": r["e2e_reduction"],
                        "ttft_comm_share": r0["ttft_comm_share"],
                        "paper_latency_reduction": PAPER_POINT["latency_reduction"],
                        "paper_implied_comm_share": PAPER_POINT["latency_reduction"] / removed})
    return out
