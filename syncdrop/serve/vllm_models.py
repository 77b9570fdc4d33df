"""syncdrop's variants of vLLM's Llama, Mistral, Qwen2, Qwen3, Phi-3 and OPT models (imported by vLLM, through the
plugin).

A ``Syncdrop<arch>`` model is vLLM's own ``<arch>`` with every block its plan (``syncdrop_plan`` in
``config.json``, written by ``syncdrop export``) does not leave dense converted after construction to run
that block's sync modes (:class:`~syncdrop.plan.BlockSync`); dense blocks (``full``, ``full``), the
embeddings, the LM head, the weight loading and the attention backend stay stock. A served block's
attention sync point is ``full``, compressed or ``drop``, its MLP sync point ``full`` or compressed
(docs/methods.md), on this rank's partials ``P_r`` = o_proj output of the rank's heads and ``Z_r`` = down
output of its MLP channels, both bias-free and not reduced::

    attention kept:  H = X + Sync_attn(P_r) + b_o,  Z_r = MLP_r(norm(H)),  X_out = H + Sync_mlp(Z_r) + b_down
    SPD block:       H_r = X + P_r + b_o (rank-local),  X_out = X + Sync_mlp(P_r + Z_r) + b_o + b_down
                     (arXiv:2502.20727; the sum is Drop.fused, the one definition syncdrop's executors use)

Each ``Sync`` is the sum over the tensor-parallel ranks that the point's mode asks for (:func:`tp_sum`):
vLLM's own all-reduce for ``full``, the two-step low-bit all-reduce of a compressed point's wire format
(:mod:`syncdrop.serve.vllm_wire`, a custom op) otherwise. In a converted block the row-parallel o_proj and
down layers are vLLM's ``RowParallelLinear`` with ``reduce_results`` and the bias switched off
(``skip_bias_add``; :func:`set_sync`), so only the sync points above communicate and each bias is added
once, after its sum. Llama-family layers carry the residual beside the hidden state (``(hidden,
residual)``, summed by the next fused add-norm): a converted block returns ``(Sync_mlp(.) + biases, X)``
(SPD) or ``(Sync_mlp(Z_r) + b_down, H)``. OPT layers return the sum. Nothing here is device-specific: the
same classes run on vLLM's CPU and CUDA backends.

**A plan is fixed for an engine's lifetime.** vLLM compiles the model at its first forward (inside
``LLM(...)``: Dynamo traces it once, ``fullgraph``, guards dropped) and may capture CUDA graphs; what a
block runs is read while tracing, so a later :func:`set_dropped` would be silently ignored. It is refused
instead (:data:`SWITCH_REFUSAL`) in an engine that compiles or captures graphs, and in one whose plan
compresses sync points; an eager engine (``enforce_eager=True``) serving a plan that only drops attention
sync points may switch its SPD blocks. To serve or time another plan, start another engine (the bench does,
one per plan, overriding ``syncdrop_plan`` with ``hf_overrides``).

Imports that older vLLM releases lack are guarded (vLLM before its own ``mistral`` module served Mistral
with its Llama class; one without ``qwen3`` or ``phi3`` gets no ``Syncdrop`` class for it); the supported
range is checked when the plugin loads (:mod:`syncdrop.serve.vllm_plugin`).
"""

from __future__ import annotations

import torch
from torch import nn
from vllm.distributed import tensor_model_parallel_all_reduce
from vllm.model_executor.models.llama import LlamaForCausalLM
from vllm.model_executor.models.opt import OPTForCausalLM
from vllm.model_executor.models.qwen2 import Qwen2ForCausalLM

from syncdrop.errors import SyncdropError
from syncdrop.plan import DROP, BlockSync, SyncPlan, resolve_plan
from syncdrop.plan.modes import add_bias
from syncdrop.plan.wire import WireFormat
from syncdrop.serve.vllm_wire import compressed_all_reduce

try:
    from vllm.model_executor.models.mistral import MistralForCausalLM
except ImportError:  # older vLLM: Mistral is served by the Llama class
    MistralForCausalLM = LlamaForCausalLM
try:
    from vllm.model_executor.models.qwen3 import Qwen3ForCausalLM
except ImportError:  # older vLLM: no Qwen3
    Qwen3ForCausalLM = None
try:
    from vllm.model_executor.models.phi3 import Phi3ForCausalLM
except ImportError:  # older vLLM: no Phi-3
    Phi3ForCausalLM = None

SWITCH_REFUSAL = ("syncdrop plugin: cannot switch SPD blocks from {have} to {want}: {why}, so the switch would be "
                  "silently ignored; a plan is fixed for a compiled engine's lifetime: start one engine per plan "
                  "(or run this one with enforce_eager=True)")
PLAN_SWITCH_REFUSAL = ("syncdrop plugin: cannot switch SPD blocks from {have} to {want}: the model's plan does more "
                       "than drop attention sync points ({other}), and such a plan is fixed "
                       "for an engine's lifetime: start one engine per plan")


def tp_sum(y: torch.Tensor, wire: WireFormat | None) -> torch.Tensor:
    """One sync point's collective on vLLM's tensor-parallel group: the sum of the ranks' partials ``y``, by
    vLLM's all-reduce (``wire`` None) or by the two-step all-reduce in ``wire``'s format
    (:mod:`syncdrop.serve.vllm_wire`)."""
    return tensor_model_parallel_all_reduce(y) if wire is None else compressed_all_reduce(y, wire)


class SyncLlamaDecoderLayer(nn.Module):
    """Forward of a converted block for vLLM's Llama-family decoder layers (Llama, Mistral, Qwen2, Qwen3, Phi-3:
    vLLM serves Phi-3 with its Llama layers): the same modules (``input_layernorm``, ``self_attn``,
    ``post_attention_layernorm``, ``mlp``), the sync points of the block's plan. Qwen3's q/k norms are inside
    ``self_attn``, before the partial ``P_r`` is formed."""

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: torch.Tensor | None,
                **kw: object) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.syncdrop_active:
            return self.stock_forward(positions, hidden_states, residual, **kw)
        if residual is None:
            residual = hidden_states  # X
            xn = self.input_layernorm(hidden_states)
        else:
            xn, residual = self.input_layernorm(hidden_states, residual)  # X = hidden + residual
        p = self.self_attn(positions=positions, hidden_states=xn)  # (T, h): this rank's partial P_r
        b_o, b_down = self.self_attn.o_proj.bias, self.mlp.down_proj.bias
        attn_wire, mlp_wire = self.syncdrop_wires
        if self.syncdrop_drops:  # SPD: H_r = X + P_r + b_o, X_out = X + Sync(P_r + Z_r) + b_o + b_down
            z = self.mlp(self.post_attention_layernorm(add_bias(residual + p, b_o)))  # (T, h): Z_r
            y, biases = DROP.fused(p, z, b_o, b_down)  # the SPD block's one sync point (syncdrop.plan.modes.Drop)
            return add_bias(tp_sum(y, mlp_wire), *biases), residual
        # H = X + Sync(P_r) + b_o (the fused add-norm sums it), X_out = H + Sync(Z_r) + b_down
        hn, residual = self.post_attention_layernorm(add_bias(tp_sum(p, attn_wire), b_o), residual)
        return add_bias(tp_sum(self.mlp(hn), mlp_wire), b_down), residual


class SyncOPTDecoderLayer(nn.Module):
    """Forward of a converted block for vLLM's OPT decoder layer (pre-norm only)."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if not self.syncdrop_active:
            return self.stock_forward(hidden_states)
        x = hidden_states
        p = self.self_attn(hidden_states=self.self_attn_layer_norm(x))  # (T, h): P_r
        b_o, b_down = self.self_attn.out_proj.bias, self.fc2.bias
        attn_wire, mlp_wire = self.syncdrop_wires
        h = add_bias(x + p, b_o) if self.syncdrop_drops else add_bias(x + tp_sum(p, attn_wire), b_o)
        u, _ = self.fc1(self.final_layer_norm(h))
        z, _ = self.fc2(self.activation_fn(u))  # Z_r
        if self.syncdrop_drops:
            y, biases = DROP.fused(p, z, b_o, b_down)  # the SPD block's one sync point (syncdrop.plan.modes.Drop)
            return add_bias(x + tp_sum(y, mlp_wire), *biases)
        return add_bias(h + tp_sum(z, mlp_wire), b_down)


_SYNC_CLASSES: dict[type, type] = {}


def _sync_class(stock: type, sync_forward: type) -> type:
    """``stock`` with ``sync_forward``'s forward, the stock one kept as ``stock_forward`` (one class per stock
    layer class)."""
    if stock not in _SYNC_CLASSES:
        _SYNC_CLASSES[stock] = type(f"Syncdrop{stock.__name__}", (stock,),
                                    {"forward": sync_forward.forward, "stock_forward": stock.forward})
    return _SYNC_CLASSES[stock]


def _row_parallel(layer: nn.Module) -> tuple[nn.Module, nn.Module]:
    """The two row-parallel layers of a decoder layer: (o_proj, down) / OPT's (out_proj, fc2)."""
    if hasattr(layer, "fc2"):
        return layer.self_attn.out_proj, layer.fc2
    return layer.self_attn.o_proj, layer.mlp.down_proj


def set_sync(layer: nn.Module, block: BlockSync) -> None:
    """Run a converted layer with ``block``'s sync points: a dense block (``full``, ``full``) is the stock
    block, whose row-parallel layers reduce and add their bias themselves; in any other the row-parallel
    layers give bias-free partials and the layer issues its sync points, each bias added once after its sum.
    The facts the forward reads (plain values, constants to Dynamo) are set here from the block's modes."""
    active = not block.is_dense
    for linear in _row_parallel(layer):
        linear.reduce_results = not active
        linear.skip_bias_add = active
    layer.syncdrop_block = block
    layer.syncdrop_active = active
    layer.syncdrop_drops = block.attn.drops
    layer.syncdrop_wires = (block.attn.codec, block.mlp.codec)
    layer.spd_active = active and block.attn.drops  # the block runs SPD (read by benchmarks/gpu_check)


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    inner = model.model
    return inner.decoder.layers if hasattr(inner, "decoder") else inner.layers


def frozen_by(vllm_config) -> str | None:
    """Why a module switch would not reach the running model: vLLM compiles it (one trace, no guards) or
    captures CUDA graphs; None for an eager engine."""
    if vllm_config.model_config.enforce_eager:
        return None
    cc = vllm_config.compilation_config
    mode = cc.mode if hasattr(cc, "mode") else getattr(cc, "level", 0)  # `level` in older vLLM
    if mode:
        return f"this engine compiled the model (compilation mode {getattr(mode, 'name', mode)})"
    graphs = getattr(cc, "cudagraph_mode", None)
    if graphs is not None and graphs.name != "NONE" and getattr(cc, "cudagraph_capture_sizes", None):
        return f"this engine captured CUDA graphs (cudagraph_mode {graphs.name})"
    return None


SPD_BLOCK = BlockSync(attn=DROP)  # the plain SPD block, the only one set_dropped switches


def set_dropped(model: nn.Module, dropped: list[int]) -> list[int]:
    """Switch a ``Syncdrop<arch>`` model to another plan of SPD blocks without reloading, in an eager engine
    (``LLM.collective_rpc("syncdrop_set_dropped")``, :mod:`syncdrop.serve.vllm_link`): converted layers in
    ``dropped`` run SPD, the others stock. Only layers the model's own plan drops are converted; asking for
    another raises ValueError. In an engine that compiles the model or captures CUDA graphs any change
    raises RuntimeError (:data:`SWITCH_REFUSAL`), and so it does in a model whose plan does more than drop
    attention sync points (:data:`PLAN_SWITCH_REFUSAL`: a compressed sync point); asking for the blocks already
    active is a no-op."""
    layers = decoder_layers(model)
    want = set(dropped)
    planned = {i: layer.syncdrop_plan_block for i, layer in enumerate(layers) if hasattr(layer, "syncdrop_plan_block")}
    convertible = {i for i, b in planned.items() if b.attn.drops}
    held = {i for i, layer in enumerate(layers) if hasattr(layer, "fc2") or hasattr(layer, "mlp")}
    if want & held - convertible:
        raise ValueError(f"blocks {sorted(want & held - convertible)} were not exported as SPD blocks")
    have = sorted(i for i in convertible if layers[i].spd_active)
    if have == sorted(want & convertible):
        return have
    why = getattr(model, "syncdrop_frozen", None)
    if why:
        raise RuntimeError(SWITCH_REFUSAL.format(have=have, want=sorted(want & convertible), why=why))
    other = {i: f"attn {b.attn}, mlp {b.mlp}" for i, b in planned.items() if b != SPD_BLOCK}
    if other:
        raise RuntimeError(PLAN_SWITCH_REFUSAL.format(have=have, want=sorted(want & convertible), other=other))
    for i in convertible:
        set_sync(layers[i], planned[i] if i in want else BlockSync())
    return sorted(want & convertible)


def plan_of(hf_config) -> SyncPlan:
    """The plan ``syncdrop export`` recorded in ``config.json`` (``syncdrop_plan``), checked for serving (and for
    the model's hidden size: a wire group size must divide it)."""
    raw = getattr(hf_config, "syncdrop_plan", None)
    if raw is None:
        raise ValueError("config.json has no syncdrop_plan: export the model with `syncdrop export`")
    try:
        return resolve_plan(raw, hf_config.num_hidden_layers, serving=True, what="config.json syncdrop_plan",
                            hidden=hf_config.hidden_size)
    except SyncdropError as e:  # vLLM reports a model's ValueError as a configuration error
        raise ValueError(f"syncdrop plugin: {e}") from None


def convert(layers: nn.ModuleList, plan: SyncPlan, opt: bool = False) -> list[int]:
    """Turn the layers whose block ``plan`` does not leave dense into converted blocks running its sync points,
    in place; return their indices. Layers this pipeline stage does not hold (vLLM's ``PPMissingLayer``) are
    skipped."""
    done = []
    for i, block in enumerate(plan.blocks):
        if block.is_dense:
            continue
        layer = layers[i]
        if opt:
            if not hasattr(layer, "fc2"):
                continue
            if not layer.do_layer_norm_before:
                raise ValueError("syncdrop plugin: syncdrop's OPT blocks need a pre-norm OPT (do_layer_norm_before)")
            layer.__class__ = _sync_class(type(layer), SyncOPTDecoderLayer)
        else:
            if not hasattr(layer, "mlp"):
                continue
            if getattr(layer, "ada_rms_norm_t_cond", None) is not None:
                raise ValueError("syncdrop plugin: time-conditioned Mistral layers are not supported")
            layer.__class__ = _sync_class(type(layer), SyncLlamaDecoderLayer)
        layer.syncdrop_plan_block = block
        set_sync(layer, block)
        done.append(i)
    return done


def _syncdrop_class(stock: type) -> type:
    """``Syncdrop<stock>``: vLLM's ``stock`` model with the plan's non-dense layers converted after construction."""

    def __init__(self, *, vllm_config, prefix: str = "", **kw) -> None:
        stock.__init__(self, vllm_config=vllm_config, prefix=prefix, **kw)
        self.syncdrop_frozen = frozen_by(vllm_config)
        convert(decoder_layers(self), plan_of(vllm_config.model_config.hf_config),
                opt=issubclass(stock, OPTForCausalLM))

    return type(f"Syncdrop{stock.__name__}", (stock,), {"__init__": __init__, "__module__": __name__})


SyncdropLlamaForCausalLM = _syncdrop_class(LlamaForCausalLM)
SyncdropMistralForCausalLM = _syncdrop_class(MistralForCausalLM)
SyncdropQwen2ForCausalLM = _syncdrop_class(Qwen2ForCausalLM)
SyncdropOPTForCausalLM = _syncdrop_class(OPTForCausalLM)
if Qwen3ForCausalLM is not None:
    SyncdropQwen3ForCausalLM = _syncdrop_class(Qwen3ForCausalLM)
if Phi3ForCausalLM is not None:
    SyncdropPhi3ForCausalLM = _syncdrop_class(Phi3ForCausalLM)
