"""The compressed sync mode: low-bit wire formats and the two-step all-reduce (syncdrop.plan.wire,
syncdrop.plan.compressed), against hand computations and an independent formulation; plans, errors,
the emulated link's charge, and the straight-through gradient."""

from __future__ import annotations

import pytest
import torch

from syncdrop.bench.link import EmulatedLinkComm, Link
from syncdrop.cli import main
from syncdrop.errors import SyncdropError
from syncdrop.parallel.comm import SimulatedComm
from syncdrop.plan import BlockSync, SyncPlan, parse_plan, resolve_plan
from syncdrop.plan.compressed import Compressed
from syncdrop.plan.wire import WIRE_FORMATS, WireFormat, hadamard, parse_wire

QMAX = {"fp8": 448.0, "int8": 127.0, "int4": 7.0, "int8h": 127.0, "int4h": 7.0}


def test_two_step_int8_by_hand() -> None:
    """Two ranks, two groups of two; scales chosen to be exact in bfloat16 (127 / 2^k), so every step is
    computed here by hand:

    rank 0 group 0 [15.875, 1.03]: s = 0.125, q = [127, round(8.24) = 8] -> [15.875, 1.0]
    rank 1 group 0 [-7.9375, 3.0]: s = 1/16, q = [-127, 48]         -> exact
    sum [7.9375, 4.0]: s = 1/16, q = [127, 64]                     -> [7.9375, 4.0]
    rank 0 group 1 [0.9921875, 0.25] and rank 1 [0.9921875, 0.1328125]: s = 1/128, exact
    sum [1.984375, 0.3828125]: s = 1/64, q = [127, round(24.5) = 24 (half to even)] -> [1.984375, 0.375]
    """
    y = torch.tensor([[[15.875, 1.03, 0.9921875, 0.25]], [[-7.9375, 3.0, 0.9921875, 0.1328125]]])
    out = WireFormat("int8", 2).two_step(SimulatedComm(2), y)
    assert out.tolist() == [[[7.9375, 4.0, 1.984375, 0.375]]]


def test_codecs_by_hand() -> None:
    """int4 packs two values per byte (low nibble first, offset 8); fp8 e4m3 and bf16 keep representable values."""
    w4 = WireFormat("int4", 4)
    g = torch.tensor([[3.5, -1.0, 0.6, 2.0]])  # s = 0.5: q = [7, -2, round(1.2) = 1, 4]
    b = w4.encode(g)
    assert b.shape == (1, 4) and b[0, :2].tolist() == [(7 + 8) | ((-2 + 8) << 4), (1 + 8) | ((4 + 8) << 4)]
    assert w4.decode(b).tolist() == [[3.5, -1.0, 0.5, 2.0]]
    w8 = WireFormat("fp8", 2)
    assert w8.decode(w8.encode(torch.tensor([[448.0, -3.0]]))).tolist() == [[448.0, -3.0]]  # s = 1
    wb = WireFormat("bf16", 2)
    assert wb.decode(wb.encode(torch.tensor([[1.0, 1.0 + 2**-10]]))).tolist() == [[1.0, 1.0]]
    assert WireFormat("int8").decode(WireFormat("int8").encode(torch.zeros(1, 64))).abs().sum() == 0  # scale 1


def test_hadamard_by_hand() -> None:
    """The butterflies give Sylvester's matrix (H_1 = [1], H_2k = [[H_k, H_k], [H_k, -H_k]]) over sqrt(G),
    which is its own inverse; a rotated group with one outlier loses far less to int4 than the plain one."""
    H = torch.ones(1, 1)
    while H.shape[0] < 16:
        H = torch.cat([torch.cat([H, H], 1), torch.cat([H, -H], 1)], 0)
    x = torch.randn(3, 16, generator=torch.Generator().manual_seed(0))
    assert torch.allclose(hadamard(x), x @ H / 4.0, atol=1e-6)
    assert torch.allclose(hadamard(torch.eye(16)), H / 4.0, atol=0) and torch.allclose(hadamard(hadamard(x)), x,
                                                                                          atol=1e-6)
    g = torch.full((1, 32), 0.1)
    g[0, 5] = 20.0  # plain int4: step 20 / 7 rounds every 0.1 to 0; rotated: the outlier spreads
    err = {f: (WireFormat(f, 32).round_trip(g) - g).norm().item() for f in ("int4", "int4h")}
    assert err["int4h"] < 0.5 * err["int4"]
    with pytest.raises(SyncdropError, match="power of two, got 48"):
        WireFormat("int4h", 48)
    assert WireFormat("int4h", 32).group_bytes == WireFormat("int4", 32).group_bytes == 18


def test_hadamard_bits_do_not_depend_on_batching() -> None:
    """Each group's bits are the same whether it is rotated alone or among many (what lets the simulated and
    the distributed executors agree), and the caller's tensor is never written, a single group included."""
    x = torch.randn(257, 32, generator=torch.Generator().manual_seed(1)) * 30.0
    whole = hadamard(x)
    for i in (0, 1, 128, 256):
        one = x[i : i + 1].clone()
        assert torch.equal(hadamard(one), whole[i : i + 1]) and torch.equal(one, x[i : i + 1])
    assert torch.equal(hadamard(x.t().contiguous().t()), whole)  # a non-contiguous view of the same values
    assert torch.equal(hadamard(x[:7].reshape(7, 2, 16).transpose(1, 2).reshape(7, 32)), hadamard(
        x[:7].reshape(7, 2, 16).transpose(1, 2).contiguous().reshape(7, 32)))


@pytest.mark.parametrize("fmt", WIRE_FORMATS)
@pytest.mark.parametrize("tp,tokens", [(2, 1), (3, 5), (4, 3)])
def test_two_step_equals_quantise_sum_quantise(fmt: str, tp: int, tokens: int) -> None:
    """Independent of the chunking (padding included: 9 groups per token over 2 or 4 ranks): the result is
    D(E(sum_r D(E(y_r)))) with the sum in rank order, bit for bit; and within one quantisation step of each
    rank's partial and of the sum of the exact sum."""
    wire = WireFormat(fmt, 64)
    y = torch.randn(tp, tokens, 576, generator=torch.Generator().manual_seed(tp)) * torch.linspace(0.1, 10, 576)
    out = SimulatedComm(tp).compressed_all_reduce(y, wire)
    s = wire.round_trip(y[0])
    for r in range(1, tp):
        s = s + wire.round_trip(y[r])
    assert torch.equal(out[0], wire.round_trip(s))
    if fmt != "bf16":
        # the rotated formats quantise H x per group: their errors are bounded there (H is orthonormal)
        rot = (lambda t: hadamard(t.reshape(tokens, -1, 64)).reshape(tokens, 576)) if wire.rotated else (lambda t: t)

        def step(t: torch.Tensor) -> torch.Tensor:  # (tokens, 576) -> each element's group scale amax / qmax
            return rot(t).reshape(tokens, -1, 64).abs().amax(-1, keepdim=True).expand(-1, -1, 64) \
                .reshape(tokens, 576) / QMAX[fmt]
        # per quantisation: integers round by half a step and clamp by at most amax 2^-8 (the scale's
        # bfloat16 rounding), under one step; fp8 e4m3 rounds by 2^-4 of the value, at most 28 steps
        factor = 30.0 if fmt == "fp8" else 1.0
        bound = factor * (sum(step(y[r]) for r in range(tp)) + step(s))
        assert ((rot(out[0]) - rot(y.sum(0))).abs() <= bound + 1e-5).all()


def test_simulated_model_compressed_plans(tmp_path) -> None:
    """SmolLM2-shaped sums through the simulated executor: a bf16 wire barely moves the logits of a fp32
    model, int8 more, int4 most; SPD + int8 compresses only the SPD blocks' one sync point."""
    from syncdrop.models.loading import resolve_model
    from syncdrop.parallel.executor import simulated_model

    src = resolve_model("smollm2")
    ids = torch.randint(0, src.config.vocab_size, (1, 24), generator=torch.Generator().manual_seed(0))
    sim = simulated_model(src.config, src.reader, 3)
    L = src.config.num_layers
    logits = {}
    for spec in ("none", "bf16", "int8", "int4", "frac:0.5", "frac:0.5+int8"):
        sim.plan = parse_plan(spec, L)
        sim.comm.calls = 0
        logits[spec] = sim(ids)
        assert sim.comm.calls == sim.plan.collectives_per_forward
    err = {k: (v - logits["none"]).abs().max().item() for k, v in logits.items()}
    assert 0 < err["bf16"] < err["int8"] < err["int4"]
    assert (logits["frac:0.5+int8"] - logits["frac:0.5"]).abs().max() > 0


@pytest.mark.parametrize("fmt", ["int4", "int4h"])
def test_straight_through_gradient(fmt: str) -> None:
    """The compressed sum's gradient is the plain sum's; its value is the compressed one, bit for bit."""
    y = torch.randn(3, 2, 128, requires_grad=True)
    wire = WireFormat(fmt, 32)
    out = SimulatedComm(3).compressed_all_reduce(y, wire)
    with torch.no_grad():
        assert torch.equal(out, SimulatedComm(3).compressed_all_reduce(y, wire))
    w = torch.randn(1, 2, 128)
    (out * w).sum().backward()
    assert torch.equal(y.grad, w.expand(3, -1, -1))


def test_link_charges_the_encoded_bytes() -> None:
    """The emulated link waits the ring all-reduce's time for the encoded partial: int8 in groups of 64
    is 66 bytes per 64 values, padded to whole chunks (9 groups per token over 2 ranks: 10)."""
    link = Link(bandwidth=1e6, latency=0.0)
    comm = EmulatedLinkComm(SimulatedComm(2), link)
    wire = WireFormat("int8", 64)
    comm.compressed_all_reduce(torch.randn(2, 1, 576), wire)
    assert wire.two_step_bytes(576, 2) == 10 * 66
    assert comm.waited_s == pytest.approx(link.all_reduce_s(10 * 66, 2))
    full = EmulatedLinkComm(SimulatedComm(2), link)
    full.all_reduce(torch.randn(2, 1, 576, dtype=torch.bfloat16))
    assert comm.waited_s / full.waited_s == pytest.approx(660 / 1152)


def test_vllm_link_charges_a_compressed_point_its_encoded_bytes(monkeypatch) -> None:
    """Inside vLLM, the emulated link's wait after a collective is the ring time of the bytes it is told
    (the compressed op passes its encoded, padded partial), else of the input tensor's own bytes."""
    from syncdrop.bench.ring import ring_all_reduce_s
    from syncdrop.serve import vllm_link

    waits: list[float] = []
    monkeypatch.setattr(vllm_link, "wait", lambda s, spin: waits.append(s))
    monkeypatch.setattr(vllm_link, "_link", (50e-6, 1e8))
    x = torch.randn(7, 576)
    wire = WireFormat("int4", 32)
    vllm_link.end("all_reduce", x, 3, vllm_link.begin(x), nbytes=wire.two_step_bytes(x.numel(), 3))
    vllm_link.end("all_reduce", x, 3, vllm_link.begin(x))
    assert waits == [ring_all_reduce_s(wire.two_step_bytes(7 * 576, 3), 3, 50e-6, 1e8),
                     ring_all_reduce_s(7 * 576 * 4, 3, 50e-6, 1e8)]
    assert wire.two_step_bytes(7 * 576, 3) == 126 * 18  # 126 groups of 32 (42 per rank), 16 + 2 bytes each


def test_plan_forms_and_facts() -> None:
    p = parse_plan("frac:0.5+int4:g32", 4)
    assert p.dropped == [2, 3]
    assert p.blocks[0] == BlockSync(Compressed("int4", 32), Compressed("int4", 32))
    assert p.blocks[3] == BlockSync("drop", Compressed("int4", 32))  # the SPD block's one all-reduce
    assert SyncPlan.from_dict(p.to_dict(), 4) == p
    assert p.to_dict()["blocks"][3] == {"attn": "drop", "mlp": {"wire": "int4", "group": 32}}
    assert parse_plan("int8", 4) == parse_plan("none+int8", 4) == SyncPlan.uniform(4).compressed("int8")
    assert p.collectives_per_forward == 6 and not p.ranks_diverge
    # bytes per rank and forward, 10 tokens of hidden 64: int4 g32 is 18 bytes per 32 values
    assert p.wire_bytes(10, 64, 2) == 6 * 10 * 2 * 18
    assert parse_plan("all+int8", 4, variant="naive").blocks[0].mlp.name == "full"  # the ablations keep theirs
    assert "compressed (int4:g32)" in p.summary()


@pytest.mark.parametrize("spec,message", [
    ("int8:g40", "wire group size 40 does not divide the hidden size 576"),
    ("frac:0.5+int3", "malformed plan"),
    ("int4:x3", "expected FORMAT or FORMAT:gG"),
    ("int8:g7", "even integer"),
    ("int4h:g48", "the group size must be a power of two, got 48"),
    ("+int8", "expected PLAN+WIRE"),
])
def test_bad_wire_specs_exit_2(capsys, spec: str, message: str) -> None:
    assert main(["ppl", "--model", "smollm2", "--tp", "3", "--plan", spec, "--max-windows", "1"]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_bad_modes_in_plan_files() -> None:
    with pytest.raises(SyncdropError, match=r"blocks\[0\]\.mlp: wire format must be one of"):
        SyncPlan.from_dict({"blocks": [{"mlp": {"wire": "int3"}}]}, 1)
    with pytest.raises(SyncdropError, match="combines with attn"):
        BlockSync("naive", Compressed("int8"))
    with pytest.raises(SyncdropError, match="does not divide the hidden size 48"):
        resolve_plan("int8", 2, hidden=48)
    assert parse_wire("int4:g32") == WireFormat("int4", 32)


def test_cost_model_weighs_encoded_bytes() -> None:
    """comm_units in bytes: int8 in groups of 64 carries 66 of 128 bf16 bytes per 64 values; on a link
    with no latency the predicted sync time scales by exactly that (the forward's compute is the same)."""
    from syncdrop.bench.cost.comm import CommModel
    from syncdrop.bench.cost.compute import ComputeModel
    from syncdrop.bench.cost.forward import predict_ttft
    from syncdrop.models.loading import resolve_model

    cfg = resolve_model("smollm2").config
    L, h = cfg.num_layers, cfg.hidden_size
    dense, int8, mixed = parse_plan("none", L), parse_plan("int8", L), parse_plan("frac:0.5+int8", L)
    assert dense.comm_units(h, 2) == 2 * L and int8.comm_units(h, 2) == pytest.approx(2 * L * 66 / 128)
    assert mixed.comm_units(h, 2) == pytest.approx(1.5 * L * 66 / 128)
    comm, compute = CommModel(alpha=0.0, beta=1e8), ComputeModel(flops_per_s=1e11)
    t = {name: predict_ttft(cfg, 3, 128, p.collectives_per_forward, compute, comm, dtype_bytes=2,
                            comm_units=p.comm_units(h, 2)) for name, p in (("dense", dense), ("int8", int8))}
    t0 = predict_ttft(cfg, 3, 128, 0, compute, comm, dtype_bytes=2)
    assert (t["int8"] - t0) / (t["dense"] - t0) == pytest.approx(66 / 128)


def test_partial_sync_with_a_compressed_wire() -> None:
    """partial:P+WIRE: the k shared channels travel compressed (k must be a multiple of the group); the
    private ones stay as they were. The shared sum equals the compressed mode's on those channels."""
    from syncdrop.plan import Partial

    p = parse_plan("partial:0.5+int8:g32", 2)
    m = p.blocks[0].attn
    assert m == Partial(0.5, wire="int8", group=32) and m.to_json() == {"partial": 0.5, "wire": "int8", "group": 32}
    assert SyncPlan.from_dict(p.to_dict(), 2) == p and str(m) == "partial:0.5+int8:g32"
    assert m.wire_bytes(10, 128, 4) == 10 * 2 * 34  # 64 shared channels: two groups of 32 int8 + scale
    y, x = torch.randn(3, 4, 128), torch.zeros(1, 4, 128)
    out = m.reduce(SimulatedComm(3), y, x)
    plain = Partial(0.5).reduce(SimulatedComm(3), y, x)
    shared = SimulatedComm(3).compressed_all_reduce(y[..., :64].contiguous(), WireFormat("int8", 32))
    assert torch.equal(out[..., :64], shared.expand(3, -1, -1)) and torch.equal(out[..., 64:], plain[..., 64:])
    with pytest.raises(SyncdropError, match="does not divide the 48 shared channels"):
        parse_plan("partial:0.5+int8:g32", 2).check(96)


def test_ideal_saving_of_a_compressed_point_is_its_share_of_bytes() -> None:
    """The bench's ideal saving per baseline sync point: all of a dropped one, the unsent share of bytes
    of a compressed one (fp32 model: int8 in groups of 64 sends 66 of 256 bytes per 64 values)."""
    from syncdrop.bench.sync_timer import saving_weights

    base, plan = parse_plan("none", 2), parse_plan("blocks:1+int8", 2)
    w = saving_weights(base, plan, 576, element_size=4)
    assert w == pytest.approx([1 - 66 / 256, 1 - 66 / 256, 1.0, 1 - 66 / 256])
    assert saving_weights(base, plan, 576) == [0.0, 0.0, 1.0, 0.0]  # payload fractions: channels only


def test_bench_runs_compressed_plans(tiny_llama_dir, tmp_path) -> None:
    """syncdrop bench --launch over gloo with compressed plans on an emulated link: every plan timed, and
    each compressed plan's ideal saving is positive and below the dense plan's whole sync time."""
    import json
    import subprocess
    import sys

    out = tmp_path / "bench.json"
    r = subprocess.run([sys.executable, "-m", "syncdrop", "bench", "--launch", "--model", str(tiny_llama_dir),
                        "--tp", "2", "--plans", "none,int8:g16,all+int4:g16", "--prompt-len", "16",
                        "--decode-tokens", "2", "--reps", "2", "--warmup", "0", "--link-bandwidth", "10MB/s",
                        "--link-latency", "20us", "--json", str(out), "-q"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    res = json.loads(out.read_text())
    rows = {p["plan"]: p for p in res["plans"]}
    assert set(rows) == {"none", "int8:g16", "all+int4:g16"}
    dense_sync_ms = max(sum(rep) for rep in res["sync_points"]["prefill_samples_ms"])  # per rep: all sync points
    for spec in ("int8:g16", "all+int4:g16"):
        assert 0 < rows[spec]["ideal_saving_ms"] < dense_sync_ms
