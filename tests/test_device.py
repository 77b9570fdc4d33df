"""Every device-dependent path of syncdrop runs on an accelerator and there gives the CPU's result.

Paths: the simulated TP forward and logits (plans none, drop and partial with a random mask, so the
vocab-parallel head and the random channel draw run), the partial reduce, the weights' transfer, the
perplexity loss, lm-eval scoring and generation through the runtime, KV-cache generation (greedy,
sampled, EOS), B2B distillation with head grouping, head grouping alone, sensitivity profiling, a
CAAT-Net training step and export, and a whole ``syncdrop train`` run.

The accelerator is emulated: no GPU on the development and CI machines, and torch's FakeTensorMode
cannot stand in for one on the CPU build of torch 2.13 (slicing, indexing, ``.to("cuda")``,
cross-entropy and autograd of a fake ``cuda`` tensor raise "PyTorch is not linked with support for
cuda devices"; ``.item()`` raises DataDependentOutputException). The emulation is torch's Python
PrivateUse1 backend named ``fakecuda``: a tensor on it is a wrapper holding a real CPU tensor; every
op unwraps, computes on the CPU and wraps what belongs on the device, after CUDA's rule: all tensor
operands on one device, except 0-dim CPU tensors (scalars), CPU index tensors of an indexing op, and
copies. A random generator must be on the device of the op drawing from it (``torch.Generator`` is
patched: ``fakecuda`` generators are CPU ones recorded as on the device). Data crossing to the device
is recorded, so a case can check that weights travel in the model dtype. A CPU tensor meeting a
device one therefore raises as on CUDA, and the values are the CPU's: each case compares with the
same call on the CPU, bit for bit for forwards (the kernel choices that depend on the device, SDPA's
backend and the gradient norm's foreach path, are pinned to the same ones for both runs) and to
rounding for training (:data:`GRAD_RTOL`, :data:`PARAM_ATOL`).

Registering the backend is global to a process and cannot be undone (torch's accelerator becomes
``fakecuda``), so the cases (``case_*``) run in one child pytest process (``-o python_functions=case_*``),
and ``test_on_emulated_device[case]`` reports each of them here.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import torch

CHILD = os.environ.get("SYNCDROP_EMULATED_DEVICE") == "1"
DEVICE_TYPE = "fakecuda"  # the emulated device (a torch.device of this type exists only in the child)
DEVICE: torch.device = None  # type: ignore[assignment]  # set by _install

# ---------------------------------------------------------------- the emulated device (child only)

aten = torch.ops.aten
INDEX_OPS = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default}
COPY_OPS = {aten._to_copy.default, aten.copy_.default, aten._copy_from.default}
TRANSFERS: list[tuple[torch.dtype, tuple[int, ...]]] = []  # (dtype, shape) of data copied host -> device
_DEVICE_GENERATORS: list[torch.Generator] = []
_REAL_GENERATOR = torch.Generator


class DeviceMismatch(RuntimeError):
    """What CUDA raises when a kernel gets tensors on two devices."""


class DeviceTensor(torch.Tensor):
    """A tensor on the emulated device: a wrapper around a real CPU tensor ``elem``."""

    elem: torch.Tensor
    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, elem: torch.Tensor) -> DeviceTensor:
        r = torch.Tensor._make_wrapper_subclass(cls, elem.size(), strides=elem.stride(),
                                                storage_offset=elem.storage_offset(), dtype=elem.dtype,
                                                device=DEVICE, requires_grad=elem.requires_grad)
        r.elem = elem
        return r

    def __repr__(self) -> str:
        return f"DeviceTensor({self.elem!r})"

    def tolist(self):  # as on CUDA: a copy to the host
        return self.elem.tolist()

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return _run(func, args, kwargs or {})


def _on_device(t: object) -> bool:
    return isinstance(t, DeviceTensor)


def _where(t: torch.Tensor) -> str:
    return str(DEVICE) if _on_device(t) else str(t.device)


def _check_devices(func, args, kwargs, tensors: list[torch.Tensor]) -> None:
    """CUDA's rule (see the module docstring); raises :class:`DeviceMismatch`."""
    if func in COPY_OPS:
        return
    check = tensors
    if func in INDEX_OPS:  # indices may be on the CPU, or on the indexed tensor's device
        idx = [i for i in args[1] if i is not None]
        if not _on_device(args[0]) and any(_on_device(i) for i in idx):
            raise DeviceMismatch(f"{func}: indices on {DEVICE} index a tensor on the CPU")
        check = [t for t in tensors if not any(t is i for i in idx)]
    found = {_where(t) for t in check if _on_device(t) or t.dim() > 0}
    if len(found) > 1:
        raise DeviceMismatch(f"{func}: Expected all tensors to be on the same device, but found {sorted(found)}")
    gen = kwargs.get("generator")
    if gen is not None and any(_on_device(t) for t in tensors):
        if not any(torch.equal(gen.get_state(), d.get_state()) for d in _DEVICE_GENERATORS):
            raise DeviceMismatch(f"{func}: Expected a '{DEVICE.type}' device type for generator but found 'cpu'")


def _run(func, args, kwargs):
    from torch.utils._python_dispatch import return_and_correct_aliasing
    from torch.utils._pytree import tree_flatten, tree_map

    tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
    _check_devices(func, args, kwargs, tensors)
    on_device = any(_on_device(t) for t in tensors)
    if kwargs.get("device") is not None:
        on_device = torch.device(kwargs["device"]).type == DEVICE_TYPE
        kwargs = {**kwargs, "device": torch.device("cpu")}
    if func in (aten.copy_.default, aten._copy_from.default):
        dst, src = (args[0], args[1]) if func is aten.copy_.default else (args[1], args[0])
        on_device = _on_device(dst)
        if on_device and not _on_device(src):
            TRANSFERS.append((src.dtype, tuple(src.shape)))
    elif func is aten._to_copy.default and on_device and not _on_device(args[0]):
        TRANSFERS.append((args[0].dtype, tuple(args[0].shape)))
    uargs, ukwargs = tree_map(lambda t: t.elem if _on_device(t) else t, (args, kwargs))
    if func is aten._copy_from.default:  # (src, dst): a cross-device copy, which has no CPU kernel
        uargs[1].copy_(uargs[0])
        return args[1]
    out = func(*uargs, **ukwargs)
    aliasing = func._schema.is_mutable or any(r.alias_info for r in func._schema.returns)
    if on_device:
        # a view of a normal tensor taken in inference mode is a normal tensor (as on every device)
        view = aliasing and not func._schema.is_mutable and not args[0].is_inference()
        normal = torch.inference_mode(False) if view and torch.is_inference_mode_enabled() else contextlib.nullcontext()
        with normal:
            out = tree_map(lambda t: DeviceTensor(t) if isinstance(t, torch.Tensor) else t, out)
    # outputs on the device alias their inputs' storage as the op says; a CPU output is the CPU op's own
    return return_and_correct_aliasing(func, args, kwargs, out) if aliasing and on_device else out


class _Generator(_REAL_GENERATOR):
    """What ``torch.Generator(device=...)`` makes in the child: a CPU generator, recorded as on the device
    when asked for one (a class, so annotations such as ``torch.Generator | None`` still evaluate)."""

    def __new__(cls, device: torch.device | str | None = None) -> torch.Generator:
        g = _REAL_GENERATOR()
        if device is not None and torch.device(device).type == DEVICE_TYPE:
            _DEVICE_GENERATORS.append(g)
        return g


def _install() -> None:
    """Register ``fakecuda`` (once per process): the Python backend and the kernels that C++ calls
    directly on it (allocation and host-to-device copies)."""
    import torch.utils.backend_registration as br

    global DEVICE
    br._setup_privateuseone_for_python_backend(rename=DEVICE_TYPE)
    DEVICE = torch.device(DEVICE_TYPE, 0)
    lib = torch.library.Library("aten", "IMPL")

    def empty_strided(size, stride, dtype=None, layout=None, device=None, pin_memory=None):
        return DeviceTensor(torch.empty_strided(size, stride, dtype=dtype))

    def empty(size, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
        return DeviceTensor(torch.empty(size, dtype=dtype, memory_format=memory_format))

    def copy_from(src, dst, non_blocking=False):
        return _run(aten._copy_from.default, (src, dst), {})

    lib.impl("empty_strided", empty_strided, "PrivateUse1")
    lib.impl("empty.memory_format", empty, "PrivateUse1")
    lib.impl("_copy_from", copy_from, "PrivateUse1")
    globals()["_LIB"] = lib  # the registrations live as long as the library object


if CHILD:
    _install()


@pytest.fixture(autouse=True)
def _emulated(monkeypatch):
    """Device generators, and the kernel choices that depend on the device pinned to the ones the
    emulated device takes (SDPA's math backend, the per-tensor gradient norm), so that a case's device
    and CPU runs execute the same kernels and can be compared bit for bit."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if not CHILD:
        yield
        return
    monkeypatch.setattr(torch, "Generator", _Generator)
    monkeypatch.setattr(torch.nn.utils.clip_grad, "_has_foreach_support", lambda tensors, device: False)
    TRANSFERS.clear()
    _DEVICE_GENERATORS.clear()
    with sdpa_kernel(SDPBackend.MATH):
        yield


# ---------------------------------------------------------------- the parent: one child run, one report per case


@pytest.fixture(scope="module")
def child_report(tmp_path_factory) -> dict[str, str | None]:
    """Run every case in a child pytest; ``{case: None if it passed, else its failure text}``."""
    xml = tmp_path_factory.mktemp("device") / "cases.xml"
    env = {**os.environ, "SYNCDROP_EMULATED_DEVICE": "1"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "python_functions=case_*",
           f"--junitxml={xml}", __file__]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=Path(__file__).parent.parent)
    if not xml.exists():
        pytest.fail(f"the child pytest wrote no report (rc {proc.returncode}):\n"
                    f"{proc.stdout[-4000:]}{proc.stderr[-4000:]}")
    report: dict[str, str | None] = {}
    for tc in ET.parse(xml).getroot().iter("testcase"):
        bad = [e for e in tc if e.tag in ("failure", "error", "skipped")]
        report[tc.get("name").split("[")[0]] = (f"{bad[0].tag}: {bad[0].get('message')}\n{bad[0].text or ''}"[-6000:]
                                                if bad else None)
    return report


def _cases() -> list[str]:
    return sorted(n for n in globals() if n.startswith("case_"))


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "case" in metafunc.fixturenames:
        metafunc.parametrize("case", _cases())


@pytest.mark.skipif(CHILD, reason="the parent of the child run")
def test_on_emulated_device(case: str, child_report) -> None:
    assert case in child_report, f"{case} did not run in the child: {sorted(child_report)}"
    if child_report[case] is not None:
        pytest.fail(child_report[case], pytrace=False)


# ---------------------------------------------------------------- the cases (run in the child)


def _ids(vocab: int, batch: int, seq: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, vocab, (batch, seq), generator=_REAL_GENERATOR().manual_seed(seed))


def _on(t: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """``t`` is on the emulated device with ``shape``; returns it on the CPU (for comparisons)."""
    assert t.device == DEVICE, f"on {t.device}, expected {DEVICE}"
    assert tuple(t.shape) == shape, f"shape {tuple(t.shape)}, expected {shape}"
    return t.cpu()


def _source(path: Path):
    from syncdrop.models.loading import resolve_model

    return resolve_model(str(path))


# Training agrees with the CPU to rounding, not bit for bit: a few backward kernels round differently in
# the last bit on the device (SwiGLU's gate gradient does; up, down and LM-head gradients are equal), and
# Adam turns a last-bit difference of a gradient near its eps into up to ~lr of parameter.
GRAD_RTOL = 1e-5  # gradients, relative to the largest entry of their tensor
PARAM_ATOL = 1e-4  # parameters after a few steps at lr <= 1e-2


def _close(a: list[float], b: list[float]) -> None:
    """Losses during training agree to rounding."""
    assert len(a) == len(b) and all(abs(x - y) <= 1e-5 * abs(y) + 1e-7 for x, y in zip(a, b, strict=True)), (a, b)


def _close_files(a: Path, b: Path) -> None:
    """Two safetensors files of trained weights hold the same tensors to :data:`PARAM_ATOL`."""
    from safetensors.torch import load_file

    ta, tb = load_file(str(a)), load_file(str(b))
    assert ta.keys() == tb.keys()
    for k in ta:
        torch.testing.assert_close(ta[k], tb[k], rtol=0, atol=PARAM_ATOL, msg=lambda m, k=k: f"{k}: {m}")


def case_simulated_forward_and_logits(tiny_llama_dir) -> None:
    """TPModel at TP=3 on the device: hidden states and logits under plans none, drop-all, partial with
    a random mask (vocab-parallel head, the random channel draw) and compressed sync points (int8 on every
    point; SPD with an int4 sum: the two-step's codec, padding and exchanges) equal the CPU's, bit for bit."""
    from syncdrop.parallel.executor import simulated_model
    from syncdrop.plan import SyncPlan, parse_plan

    src = _source(tiny_llama_dir)
    cfg = src.config
    L, V, h = cfg.num_layers, cfg.vocab_size, cfg.hidden_size
    ids = _ids(V, 2, 11)
    plans = (parse_plan("none", L), parse_plan("all", L), SyncPlan.partial(L, 0.5, mask="random"),
             parse_plan("int8:g8", L), parse_plan("all+int4:g8", L))
    for plan in plans:
        dev = simulated_model(cfg, src.reader, 3, plan, device=DEVICE)
        cpu = simulated_model(cfg, src.reader, 3, plan)
        hidden, ref = dev.hidden_states(ids), cpu.hidden_states(ids)  # one forward each: the random draws match
        width = 3 * h if plan.has_partial else h
        assert torch.equal(_on(hidden, (2, 11, width)), ref), plan.summary()
        assert torch.equal(_on(dev.logits(hidden), (2, 11, V)), cpu.logits(ref)), plan.summary()


def case_weights_cross_in_the_model_dtype(tiny_llama_dir) -> None:
    """A bfloat16 model's weights travel to the device already cast: no float32 copy crosses."""
    from syncdrop.parallel.executor import simulated_model

    src = _source(tiny_llama_dir)
    model = simulated_model(src.config, src.reader, 2, dtype=torch.bfloat16, device=DEVICE)
    floats = [(d, s) for d, s in TRANSFERS if d.is_floating_point]
    assert sum(d == torch.bfloat16 for d, _ in floats) > 3 * src.config.num_layers  # every block's weights crossed
    fp32 = sorted({(str(d), s) for d, s in floats if d != torch.bfloat16})
    assert fp32 == [(str(torch.float32), (src.config.head_dim // 2,))], fp32  # only RoPE's inverse frequencies
    _on(model(_ids(src.config.vocab_size, 1, 5)), (1, 5, src.config.vocab_size))


def case_partial_reduce_random_mask() -> None:
    """The partial channel reduce with a random mask draws its channels on the partials' device."""
    from syncdrop.parallel.comm import SimulatedComm
    from syncdrop.plan.modes import partial_channel_reduce

    g = _REAL_GENERATOR().manual_seed(0)
    y, b = torch.randn(3, 7, 16, generator=g), torch.randn(16, generator=g)
    out = partial_channel_reduce(SimulatedComm(3), y.to(DEVICE), 5, b.to(DEVICE), mask="random")
    assert torch.equal(_on(out, (3, 7, 16)), partial_channel_reduce(SimulatedComm(3), y, 5, b, mask="random"))


def case_perplexity(tiny_llama_dir) -> None:
    """window_nll and perplexity of a model on the device (CPU windows in) equal the CPU's."""
    from syncdrop.eval.perplexity import perplexity, window_nll
    from syncdrop.parallel.executor import simulated_model

    src = _source(tiny_llama_dir)
    windows = _ids(src.config.vocab_size, 3, 12)
    dev, cpu = (simulated_model(src.config, src.reader, 2, device=d) for d in (DEVICE, "cpu"))
    with torch.inference_mode():
        assert torch.equal(_on(window_nll(dev, windows), (3,)), window_nll(cpu, windows))
    got, ref = perplexity(dev, windows, 2, progress=False), perplexity(cpu, windows, 2, progress=False)
    assert got.window_nll == ref.window_nll and got.ppl == ref.ppl


def _lm_eval(model_dir: Path, device: str, monkeypatch):
    import syncdrop.runtime as rt
    from syncdrop.eval.harness import SyncdropLM

    real = rt.resolve_device  # "cuda" resolves to the emulated device (there is no CUDA to find)
    monkeypatch.setattr(rt, "resolve_device", lambda spec, dist: DEVICE if spec == "cuda" else real(spec, dist))
    return SyncdropLM(model=str(model_dir), tp="2", plan="blocks:1", executor="simulated", device=device,
                      backend="auto", batch_size="2", progress=False)


def case_lm_eval_scoring_and_generation(tiny_llama_dir, monkeypatch) -> None:
    """The lm-eval adapter built with ``device=cuda`` runs on the device (through the runtime); its
    log-likelihoods (batched rows, shared rows) and greedy generation equal the CPU adapter's."""
    from lm_eval.api.instance import Instance

    dev, cpu = _lm_eval(tiny_llama_dir, "cuda", monkeypatch), _lm_eval(tiny_llama_dir, "cpu", monkeypatch)
    assert dev.built.model.device == DEVICE and dev.built.runtime.device == DEVICE
    assert cpu.built.model.device == torch.device("cpu")
    pairs = [("The quick brown fox", " jumps over the lazy dog."), ("Tensor parallelism splits", " each layer"),
             ("Answer:", " A"), ("Answer:", " B"), ("A", " b")]
    reqs = [Instance(request_type="loglikelihood", doc={}, arguments=p, idx=i) for i, p in enumerate(pairs)]
    assert dev.loglikelihood(reqs, disable_tqdm=True) == cpu.loglikelihood(reqs, disable_tqdm=True)
    gen = [Instance(request_type="generate_until", doc={}, arguments=("The quick brown", {"until": ["\n\n"],
                    "max_gen_toks": 6}), idx=0)]
    assert dev.generate_until(gen, disable_tqdm=True) == cpu.generate_until(gen, disable_tqdm=True)


def _generate_both(src, prompt: torch.Tensor, new: int, **kw):
    from syncdrop.generate import generate
    from syncdrop.parallel.executor import simulated_model

    dev, cpu = (simulated_model(src.config, src.reader, 2, device=d) for d in (DEVICE, "cpu"))
    return generate(dev, prompt, new, **kw), generate(cpu, prompt, new, **kw)


def case_generate_greedy(tiny_llama_dir) -> None:
    """Greedy KV-cache generation from a CPU prompt: tokens on the device, equal to the CPU's."""
    src = _source(tiny_llama_dir)
    prompt = _ids(src.config.vocab_size, 2, 5)
    got, ref = _generate_both(src, prompt, 6)
    assert torch.equal(_on(got.tokens, (2, 11)), ref.tokens) and got.new_tokens == 6


def case_generate_sampled_with_eos(tiny_llama_dir) -> None:
    """Top-k/top-p sampling (the generator on the device) and EOS stopping (done flags on the device)."""
    from syncdrop.generate import SamplingParams

    src = _source(tiny_llama_dir)
    prompt = _ids(src.config.vocab_size, 2, 5, seed=1)
    params = SamplingParams(temperature=1.5, top_k=40, top_p=0.9, seed=3)
    free, _ = _generate_both(src, prompt, 8, params=params)
    eos = int(free.tokens[0, 7])  # a token the first sequence samples: it stops there and repeats it
    got, ref = _generate_both(src, prompt, 8, params=params, eos_id=eos)
    assert torch.equal(_on(got.tokens, tuple(ref.tokens.shape)), ref.tokens)
    assert (ref.tokens[0, 7:] == eos).all()


def case_head_grouping(tiny_llama_dir) -> None:
    """group_heads from residuals on the device (unit head, channel matching) finds the CPU's layout."""
    from syncdrop.models.config import layer_names
    from syncdrop.parallel.executor import simulated_model
    from syncdrop.spd.distill import _batches
    from syncdrop.spd.head_grouping import group_heads

    src = _source(tiny_llama_dir)
    cfg = src.config
    windows = _ids(cfg.vocab_size, 2, 12)
    out = {}
    for d in (DEVICE, torch.device("cpu")):
        model = simulated_model(cfg, src.reader, 3, device=d)
        with torch.no_grad():
            batches = _batches(model, windows, 1)
        assert batches[0][0].device == d
        params = {n: src.reader.get(n).to(d) for n in layer_names(0, cfg)}
        out[d.type] = group_heads(params, 0, cfg, 3, batches, "head", "channel")
    got, ref = out[DEVICE.type], out["cpu"]
    assert (got.head_order, got.ffn_order) == (ref.head_order, ref.ffn_order)
    assert got.report == ref.report


def case_distill(tiny_llama_dir, tmp_path) -> None:
    """distill(..., device=cuda): teacher, student and batches on the device (HG by single heads, so with
    replicated KV heads, + B2B on block 0; B2B on block 1); the layouts and zero-shot losses equal the
    CPU run's, the trained blocks agree with it."""
    from syncdrop.plan import SyncPlan
    from syncdrop.spd.distill import DistillSettings, distill

    src = _source(tiny_llama_dir)
    w = _ids(src.config.vocab_size, 5, 16)
    plan = SyncPlan.dropping(src.config.num_layers, [0, 1])
    tiers = {0: "hg+b2b", 1: "b2b"}
    s = DistillSettings(lr=5e-4, epochs=2, hg_samples=2, hg_unit="head", hg_mlp="channel")  # an irregular q->KV map
    runs = {}
    for name, d in (("dev", DEVICE), ("cpu", "cpu")):
        runs[name] = distill(src, 2, plan, tiers, w[:4], w[4:], tmp_path / name, s, {"dataset": "random ids"},
                             progress=False, device=d)
        if name == "dev":  # the teacher's embedding (and everything after it) went to the device
            assert ((src.config.vocab_size, src.config.hidden_size) in [shape for _, shape in TRANSFERS])
    for i in ("0", "1"):
        a, b = runs["dev"]["blocks"][i], runs["cpu"]["blocks"][i]
        assert (a["head_order"], a["ffn_order"]) == (b["head_order"], b["ffn_order"])
        assert a["stats"]["heldout_loss_zs"] == b["stats"]["heldout_loss_zs"]  # forward only: bit for bit
        _close(a["stats"]["heldout_curve"], b["stats"]["heldout_curve"])
        _close_files(tmp_path / "dev" / a["file"], tmp_path / "cpu" / b["file"])


def case_profile(tiny_llama_dir) -> None:
    """Sensitivity profiling of a model on the device equals the CPU's."""
    from syncdrop.parallel.executor import simulated_model
    from syncdrop.spd.profile import profile_sensitivity

    src = _source(tiny_llama_dir)
    windows = _ids(src.config.vocab_size, 2, 10)
    got, ref = (profile_sensitivity(simulated_model(src.config, src.reader, 2, device=d), windows, progress=False)
                for d in (DEVICE, "cpu"))
    assert got.baseline_ppl == ref.baseline_ppl
    assert [b.to_dict() for b in got.blocks] == [b.to_dict() for b in ref.blocks]


def case_caat_step_and_export(tmp_path) -> None:
    """One CAAT-Net step at TP=2, p=0.5 (random mask) with parameters on the device: logits, loss and
    gradients on the device; the loss equals the CPU's, the gradients, the parameters after an AdamW
    step and the files export_hf writes from them agree with the CPU's."""
    from syncdrop.caat.model import export_hf, init_params, llama_config, lm_loss, tp_forward
    from syncdrop.parallel.comm import SimulatedComm
    from syncdrop.parallel.sharding import ShardLayout
    from syncdrop.plan import SyncPlan

    cfg = llama_config(64, 32, 2, 4, 2, 64, 16)
    layout, plan = ShardLayout.build(cfg, 2), SyncPlan.partial(2, 0.5, mask="random")
    batch = _ids(64, 2, 17)
    out = {}
    for d in (DEVICE, torch.device("cpu")):
        params = {k: v.to(d).requires_grad_(True) for k, v in init_params(cfg, 0).items()}
        opt = torch.optim.AdamW(params.values(), lr=1e-2)
        b = batch.to(d)
        logits = tp_forward(params, cfg, layout, plan, SimulatedComm(2), [0, 1], b[:, :-1])
        loss = lm_loss(logits, b[:, 1:])
        loss.backward()
        grads = {k: _on(p.grad, tuple(p.shape)) if d == DEVICE else p.grad.clone() for k, p in params.items()}
        opt.step()
        if d == DEVICE:
            _on(logits, (2, 16, 64))
            _on(params["embed"], (64, 32))
        export_hf(params, cfg, tmp_path / d.type)
        out[d.type] = loss.item(), grads, {k: v.detach().cpu() for k, v in params.items()}
    (loss_d, grads_d, params_d), (loss_c, grads_c, params_c) = out[DEVICE.type], out["cpu"]
    assert loss_d == loss_c  # the forward: bit for bit
    for k, g in grads_d.items():
        torch.testing.assert_close(g, grads_c[k], rtol=0, atol=GRAD_RTOL * grads_c[k].abs().max().item(), msg=k)
        torch.testing.assert_close(params_d[k], params_c[k], rtol=0, atol=PARAM_ATOL, msg=k)
    _close_files(tmp_path / DEVICE.type / "model.safetensors", tmp_path / "cpu" / "model.safetensors")


def case_caat_train_run(tmp_path) -> None:
    """``train`` on a runtime whose device is the accelerator: the losses and exported weights of the CPU
    run (batches, checkpoint, validation and export all cross the device boundary)."""
    from syncdrop.caat.settings import TrainSettings
    from syncdrop.caat.train import train
    from syncdrop.runtime import Runtime

    words = "the of and to in a is that it was for on are as with his they at be this from".split()
    g = _REAL_GENERATOR().manual_seed(0)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for name in ("a", "b"):
        idx = torch.randint(0, len(words), (1500,), generator=g).tolist()
        (corpus / f"{name}.txt").write_text(" ".join(words[i] for i in idx))
    s = TrainSettings(tp=2, sync_fraction=0.5, steps=3, batch=2, seq_len=16, hidden=32, layers=2, heads=4,
                      kv_heads=2, ffn=64, vocab_size=300, val_books=1, val_every=2, val_windows=2, ckpt_every=2,
                      warmup=1, lr=3e-3, mask="random")
    got = train(s, str(corpus), tmp_path / "dev", progress=False, runtime=Runtime("simulated", DEVICE))
    ref = train(s, str(corpus), tmp_path / "cpu", progress=False, runtime=Runtime("simulated", torch.device("cpu")))
    assert got["train_loss"][0] == ref["train_loss"][0]  # before the first update: bit for bit
    _close(got["train_loss"], ref["train_loss"])
    _close([v for _, v in got["val_loss"]], [v for _, v in ref["val_loss"]])
    _close_files(tmp_path / "dev" / "model" / "model.safetensors", tmp_path / "cpu" / "model" / "model.safetensors")
