"""SPD variants of vLLM's Llama, Mistral, Qwen2, Qwen3, Phi-3 and OPT models (imported by vLLM, through the
plugin).

A ``Syncdrop<arch>`` model is vLLM's own ``<arch>`` with the blocks its plan drops (``syncdrop_plan``
in ``config.json``, written by ``syncdrop export``) turned into SPD blocks after construction; every
other block, the embeddings, the LM head, the weight loading and the attention backend stay stock.

The SPD block (docs/methods.md; arXiv:2502.20727), on this rank's partials: ``P_r`` = o_proj output of
the rank's heads and ``Z_r`` = down output of its MLP channels, both bias-free and not reduced::

    H_r   = X + P_r + b_o                          rank-local MLP input
    Z_r   = MLP_r(norm(H_r))
    X_out = X + AllReduce(P_r + Z_r) + b_o + b_down   one sync point; biases added once, after it

The row-parallel o_proj and down layers are vLLM's ``RowParallelLinear`` with ``reduce_results`` and
the bias switched off (``skip_bias_add``; :func:`set_spd`), so only the one all-reduce above communicates. Llama-family
layers carry the residual beside the hidden state (``(hidden, residual)``, summed by the next fused
add-norm): an SPD block returns ``(AllReduce(P_r + Z_r) + biases, X)``. OPT layers return the sum.
Nothing here is device-specific: the same classes run on vLLM's CPU and CUDA backends.

**A plan is fixed for an engine's lifetime.** vLLM compiles the model at its first forward (inside
``LLM(...)``: Dynamo traces it once, ``fullgraph``, guards dropped) and may capture CUDA graphs; whether a
block runs SPD is read while tracing, so a later :func:`set_dropped` would be silently ignored. It is
refused instead (:data:`SWITCH_REFUSAL`) in an engine that compiles or captures graphs, and allowed in an
eager one (``enforce_eager=True``). To serve or time another plan, start another engine (the bench does,
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
from syncdrop.plan import DROP, SyncPlan, resolve_plan
from syncdrop.plan.modes import add_bias

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


class SPDLlamaDecoderLayer(nn.Module):
    """Forward of an SPD block for vLLM's Llama-family decoder layers (Llama, Mistral, Qwen2, Qwen3, Phi-3: vLLM
    serves Phi-3 with its Llama layers): the same modules (``input_layernorm``, ``self_attn``,
    ``post_attention_layernorm``, ``mlp``), one sync point. Qwen3's q/k norms are inside ``self_attn``, before
    the partial ``P_r`` is formed."""

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: torch.Tensor | None,
                **kw: object) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.spd_active:
            return self.stock_forward(positions, hidden_states, residual, **kw)
        if residual is None:
            residual = hidden_states  # X
            xn = self.input_layernorm(hidden_states)
        else:
            xn, residual = self.input_layernorm(hidden_states, residual)  # X = hidden + residual
        p = self.self_attn(positions=positions, hidden_states=xn)  # (T, h): this rank's partial P_r
        b_o, b_down = self.self_attn.o_proj.bias, self.mlp.down_proj.bias
        z = self.mlp(self.post_attention_layernorm(add_bias(residual + p, b_o)))  # (T, h): Z_r
        y, biases = DROP.fused(p, z, b_o, b_down)  # the SPD block's one sync point (syncdrop.plan.modes.Drop)
        return add_bias(tensor_model_parallel_all_reduce(y), *biases), residual


class SPDOPTDecoderLayer(nn.Module):
    """Forward of an SPD block for vLLM's OPT decoder layer (pre-norm only)."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if not self.spd_active:
            return self.stock_forward(hidden_states)
        x = hidden_states
        p = self.self_attn(hidden_states=self.self_attn_layer_norm(x))  # (T, h): P_r
        b_o, b_down = self.self_attn.out_proj.bias, self.fc2.bias
        u, _ = self.fc1(self.final_layer_norm(add_bias(x + p, b_o)))
        z, _ = self.fc2(self.activation_fn(u))  # Z_r
        y, biases = DROP.fused(p, z, b_o, b_down)  # the SPD block's one sync point (syncdrop.plan.modes.Drop)
        return add_bias(x + tensor_model_parallel_all_reduce(y), *biases)


_SPD_CLASSES: dict[type, type] = {}


def _spd_class(stock: type, spd_forward: type) -> type:
    """``stock`` with ``spd_forward``'s forward, the stock one kept as ``stock_forward`` (one class per stock
    layer class)."""
    if stock not in _SPD_CLASSES:
        _SPD_CLASSES[stock] = type(f"SPD{stock.__name__}", (stock,),
                                   {"forward": spd_forward.forward, "stock_forward": stock.forward})
    return _SPD_CLASSES[stock]


def _row_parallel(layer: nn.Module) -> tuple[nn.Module, nn.Module]:
    """The two row-parallel layers of a decoder layer: (o_proj, down) / OPT's (out_proj, fc2)."""
    if hasattr(layer, "fc2"):
        return layer.self_attn.out_proj, layer.fc2
    return layer.self_attn.o_proj, layer.mlp.down_proj


def set_spd(layer: nn.Module, active: bool) -> None:
    """Run a converted layer as the SPD block (``active``) or as the stock block: the row-parallel layers
    reduce and add their bias themselves exactly when the block is stock."""
    for linear in _row_parallel(layer):
        linear.reduce_results = not active
        linear.skip_bias_add = active
    layer.spd_active = active


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


def set_dropped(model: nn.Module, dropped: list[int]) -> list[int]:
    """Switch a ``Syncdrop<arch>`` model to another plan of SPD blocks without reloading, in an eager engine
    (``LLM.collective_rpc("syncdrop_set_dropped")``, :mod:`syncdrop.serve.vllm_link`): converted layers in
    ``dropped`` run SPD, the others stock. Only layers the model's own plan drops are converted; asking for
    another raises ValueError. In an engine that compiles the model or captures CUDA graphs any change
    raises RuntimeError (:data:`SWITCH_REFUSAL`); asking for the blocks already active is a no-op."""
    layers = decoder_layers(model)
    want = set(dropped)
    convertible = {i for i, layer in enumerate(layers) if hasattr(layer, "spd_active")}
    held = {i for i, layer in enumerate(layers) if hasattr(layer, "fc2") or hasattr(layer, "mlp")}
    if want & held - convertible:
        raise ValueError(f"blocks {sorted(want & held - convertible)} were not exported as SPD blocks")
    have = sorted(i for i in convertible if layers[i].spd_active)
    why = getattr(model, "syncdrop_frozen", None)
    if why and have != sorted(want & convertible):
        raise RuntimeError(SWITCH_REFUSAL.format(have=have, want=sorted(want & convertible), why=why))
    for i in convertible:
        set_spd(layers[i], i in want)
    return sorted(want & convertible)


def plan_of(hf_config) -> SyncPlan:
    """The plan ``syncdrop export`` recorded in ``config.json`` (``syncdrop_plan``), checked for serving."""
    raw = getattr(hf_config, "syncdrop_plan", None)
    if raw is None:
        raise ValueError("config.json has no syncdrop_plan: export the model with `syncdrop export`")
    try:
        return resolve_plan(raw, hf_config.num_hidden_layers, serving=True, what="config.json syncdrop_plan")
    except SyncdropError as e:  # vLLM reports a model's ValueError as a configuration error
        raise ValueError(f"syncdrop plugin: {e}") from None


def convert_dropped(layers: nn.ModuleList, plan: SyncPlan, opt: bool = False) -> list[int]:
    """Turn the layers ``plan`` drops into SPD blocks, in place; return their indices. Layers this
    pipeline stage does not hold (vLLM's ``PPMissingLayer``) are skipped."""
    done = []
    for i in plan.dropped:
        layer = layers[i]
        if opt:
            if not hasattr(layer, "fc2"):
                continue
            if not layer.do_layer_norm_before:
                raise ValueError("syncdrop plugin: the SPD block needs a pre-norm OPT (do_layer_norm_before)")
            layer.__class__ = _spd_class(type(layer), SPDOPTDecoderLayer)
        else:
            if not hasattr(layer, "mlp"):
                continue
            if getattr(layer, "ada_rms_norm_t_cond", None) is not None:
                raise ValueError("syncdrop plugin: time-conditioned Mistral layers are not supported")
            layer.__class__ = _spd_class(type(layer), SPDLlamaDecoderLayer)
        set_spd(layer, True)
        done.append(i)
    return done


def _syncdrop_class(stock: type) -> type:
    """``Syncdrop<stock>``: vLLM's ``stock`` model with the plan's dropped layers converted after construction."""

    def __init__(self, *, vllm_config, prefix: str = "", **kw) -> None:
        stock.__init__(self, vllm_config=vllm_config, prefix=prefix, **kw)
        self.syncdrop_frozen = frozen_by(vllm_config)
        convert_dropped(decoder_layers(self), plan_of(vllm_config.model_config.hf_config),
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
