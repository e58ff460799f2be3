"""One decoding core for every in-process sampler: sessions (plain or fast) plus the sampling step.

A *session* holds one batch of left-padded prompts in a model and turns the tokens picked at a
step into the next step's logits:

- :class:`PlainSession`: the transformers forward of the live (peft) model with a ``DynamicCache``
  (the reference path; any architecture, any adapter).
- :class:`FastSession` over a :class:`FastDecoder`: the adapter merged into a working copy of the
  adapted weights (``W' = W + sum_a s_a B_a A_a``, q/k/v and gate/up fused), a static KV cache,
  and on CUDA a graph-captured decode step at a fixed batch (finished rows are masked, not
  removed). No per-module LoRA work while decoding: each step is one graph replay. A composed LoRA-MoE
  (:class:`~tracekit.moe.model.LoRAMoEModel`) cannot be merged (each token routes by its block's gate): the
  decoder runs each adapted block's gate on the block input and adds the bank's delta to the fused projections
  inside the layer step (:class:`_LoRAMoEBlock`), bypassing the model's own gate hooks and no others. An Arrow-routed
  one (no gate) weighs each fused projection's parts by their prototypes on the projection's input.

Pickers sit on top: :func:`generate` samples all rows on the device in one kernel per step
(``torch.Generator``: same seed on CPU -> same tokens; log-probs of the sampled tokens from the very
logits that were sampled, no second forward); ``tracekit.llm.hf.HFChatClient`` picks per row on the
host (numpy RNG per request, grammar masks) over the same sessions.

Attention trick (both prefill and decode): with ``G = H_q / H_kv`` query heads per KV head, the
queries ``[B, H_q, c, D]`` are viewed as ``[B, H_kv, G*c, D]`` so that one SDPA call over the
cache ``[B, H_kv, S, D]`` needs neither repeated K/V nor GQA support in the kernel; the mask
``[B, 1, G*c, S]`` is the padding mask, causal within the chunk, and always lets a query see its
own slot (a left-pad query then attends to itself instead of to nothing, which would give NaN).

Precision: merged bf16 weights round ``W + dW``; an update smaller than half a bf16 ulp of ``W``
is rounded away in the rollout policy (not in the trainer). On GPU use
``grpo.old_logprobs=recompute`` (optionally with ``tis_cap``) if that mismatch matters; on CPU
(float32) merged and unmerged agree to ~1e-6.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tracekit.llm.moe_experts import FusedExperts, fused_experts_reason
from tracekit.llm.prefix_cache import PrefixStore, batch_shared_prefixes
from tracekit.moe.arrow import arrow_weights
from tracekit.moe.layer import LoRAMoELinear, adapter_weights, gate_probs
from tracekit.moe.model import LoRAMoEModel
from tracekit.ranges import check_value

log = logging.getLogger(__name__)

FAST_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe")
FAST_MODES = ("auto", "on", "off")  # merged-weight fast decoding: where it applies | required | never
PREFIX_CACHE_MIB = ">= 0"  # the prefix store's size rule (the client, the decoder and validate check this one)


@dataclass
class Completion:
    """One sampled completion: token ids (the stop token included), their log-probs, why it ended."""

    ids: list[int]
    logprobs: list[float]
    finish_reason: str  # stop | length


def causal_lm_of(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers CausalLM inside a peft / DeepSpeed wrapper (LoRA layers stay injected)."""
    m = getattr(model, "module", model)
    return m.get_base_model() if hasattr(m, "get_base_model") else m


# --------------------------------------------------------------------------------------------
# Sampling (shared by every device-side picker)


def filter_top_p(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Mask logits outside the smallest set whose probability reaches ``top_p`` (nucleus). [B, V]."""
    sorted_logits, idx = torch.sort(logits, descending=True, dim=-1)
    p = torch.softmax(sorted_logits, dim=-1)
    drop = p.cumsum(-1) - p >= top_p  # keep the token that crosses top_p
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, idx, sorted_logits)


def sample_step(
    logits: torch.Tensor, temperature: float, top_p: float, gen: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick one token per row of float32 logits [B, V] -> (tokens [B] long, log-probs [B] float32).

    T > 0: ``token ~ softmax(logits / T)`` (nucleus-truncated when top_p < 1), log-prob
    ``log_softmax(logits / T)[token]`` before truncation (the tempered policy GRPO optimizes).
    T = 0: argmax, log-prob ``log_softmax(logits)[token]``.
    """
    if temperature > 0:
        logp = torch.log_softmax(logits / temperature, dim=-1)
        probs_from = logp if top_p >= 1.0 else torch.log_softmax(filter_top_p(logits / temperature, top_p), -1)
        tok = torch.multinomial(probs_from.exp(), 1, generator=gen).squeeze(1)
    else:
        logp = torch.log_softmax(logits, dim=-1)
        tok = logits.argmax(-1)
    return tok, logp.gather(1, tok[:, None]).squeeze(1)


# --------------------------------------------------------------------------------------------
# Sessions


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """B prompts -> (ids [B, W] long, attention mask [B, W] long), left-padded to the longest W."""
    if not prompts:
        raise ValueError("no prompts")
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        if not p:
            raise ValueError(f"prompt {i} is empty")
        ids[i, width - len(p) :] = torch.tensor(list(p), dtype=torch.long)
        mask[i, width - len(p) :] = 1
    return ids, mask


def _cache_kw(lm: torch.nn.Module) -> str:
    """transformers >= 5.2x names the KV cache argument ``cache``; earlier 5.x ``past_key_values``."""
    import inspect

    return "cache" if "cache" in inspect.signature(lm.forward).parameters else "past_key_values"


def _can_prune(cache) -> bool:
    """Whether every layer of the KV cache can drop batch rows (hybrid linear-attention caches cannot)."""
    layers = getattr(cache, "layers", None)
    return hasattr(cache, "batch_select_indices") and bool(layers) and all(hasattr(x, "batch_select_indices") for x in layers)


class PlainSession:
    """The reference path: the live model's own forward with a ``DynamicCache``.

    ``prefill()`` -> logits [B, V] float32 at each row's last prompt token; ``step(tokens, active)``
    feeds one token per row (finished rows' tokens are masked out of later attention) -> next
    logits; ``keep(index)`` drops rows (when ``can_prune``).
    """

    def __init__(self, model: torch.nn.Module, prompts: Sequence[Sequence[int]], pad_id: int, prefill_chunk: int | None = None):
        self.model = model
        self.lm = causal_lm_of(model)
        self.dev = next(model.parameters()).device
        ids, attn = left_pad(prompts, pad_id)
        self.ids, self.attn = ids.to(self.dev), attn.to(self.dev)
        self.pos = (self.attn.cumsum(-1) - 1).clamp(min=0)
        self.chunk = prefill_chunk or self.ids.shape[1]
        self.kw = _cache_kw(self.lm)
        self.cache = None
        self.batch = len(prompts)

    def _forward(self, ids: torch.Tensor, attn: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        if self.cache is None:
            from transformers import DynamicCache

            self.cache = DynamicCache(config=self.lm.config)
        out = self.model(input_ids=ids, attention_mask=attn, position_ids=pos, use_cache=True, logits_to_keep=1, **{self.kw: self.cache})
        new = out.get("cache") if out.get("cache") is not None else out.get("past_key_values")
        self.cache = new if new is not None else self.cache
        return out.logits[:, -1, :].float()

    def prefill(self) -> torch.Tensor:
        width = self.ids.shape[1]
        for s in range(0, width, self.chunk):
            e = min(width, s + self.chunk)
            logits = self._forward(self.ids[:, s:e], self.attn[:, :e], self.pos[:, s:e])
        self.last_pos = self.pos[:, -1:]
        return logits

    def step(self, tokens: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
        self.attn = torch.cat([self.attn, active.to(self.dev, self.attn.dtype)[:, None]], dim=1)
        self.last_pos = self.last_pos + 1
        return self._forward(tokens.to(self.dev)[:, None], self.attn, self.last_pos)

    @property
    def can_prune(self) -> bool:
        return self.cache is not None and _can_prune(self.cache)

    def keep(self, index: torch.Tensor) -> None:
        index = index.to(self.dev)
        self.cache.batch_select_indices(index)
        self.attn, self.last_pos = self.attn[index], self.last_pos[index]
        self.batch = int(index.numel())


# --------------------------------------------------------------------------------------------
# The fast path: merged weights, static cache, CUDA graphs


def _is_lora(m: torch.nn.Module) -> bool:
    return hasattr(m, "lora_A") and hasattr(m, "get_base_layer")


def _base_linear(m: torch.nn.Module) -> torch.nn.Module:
    if isinstance(m, LoRAMoELinear):  # the bank is applied beside the base weights, never merged into them
        return m.base
    return m.get_base_layer() if _is_lora(m) else m


def _active_adapters(m: torch.nn.Module) -> list[str]:
    if not _is_lora(m) or getattr(m, "disable_adapters", False) or getattr(m, "merged", False):
        return []  # disabled, or peft already merged the delta into the base weight in place
    return [a for a in m.active_adapters if a in m.lora_A]


_BENIGN_HOOKS = ("make_inputs_require_grads",)  # transformers' checkpointing hook: sets requires_grad only


def lora_moe_of(model: torch.nn.Module):
    """The :class:`~tracekit.moe.model.LoRAMoEModel` ``model`` is (inside a DeepSpeed wrapper), else None."""
    m = getattr(model, "module", model)
    return m if isinstance(m, LoRAMoEModel) else None


def hooks_reason(model: torch.nn.Module, applied: frozenset[int] = frozenset()) -> str | None:
    """Forward hooks on any module would be bypassed by the fast path, except those whose ids are in ``applied``
    (a LoRA-MoE's gate and release hooks: the decoder runs the gates itself)."""
    for name, m in model.named_modules():
        hooks = [h for d in (m._forward_hooks, m._forward_pre_hooks) for i, h in d.items() if i not in applied]
        if any(getattr(h, "__name__", "") not in _BENIGN_HOOKS for h in hooks):
            return f"module {name or type(m).__name__} has forward hooks"
    return None


_BANK_PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
_BANK_MLP = ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def _lora_moe_reason(model: torch.nn.Module, layers: Sequence[torch.nn.Module]) -> str | None:
    """Why the fast path cannot apply ``model``'s LoRA-MoE banks: one outside a LoRAMoEModel (no gate to run),
    or on a projection the decoder does not fuse (attention and dense-MLP projections only)."""
    moe = lora_moe_of(model)
    for i, layer in enumerate(layers):
        allowed = _BANK_PROJECTIONS + (_BANK_MLP if _dense_mlp(layer.mlp) else ())
        for name, m in layer.named_modules():
            if not isinstance(m, LoRAMoELinear):
                continue
            if moe is None or i not in moe.routings:
                return f"layer {i}: {name} is a LoRAMoELinear outside a LoRAMoEModel's adapted blocks (no gate to run)"
            if name not in allowed:
                return f"layer {i}: a LoRA-MoE bank on {name} (fast decoding applies banks to {', '.join(allowed)})"
    return None


def unsupported_reason(model: torch.nn.Module) -> str | None:
    """Why :class:`FastDecoder` cannot run ``model`` (None: it can)."""
    lm = causal_lm_of(model)
    if getattr(lm, "config", None) is None:
        return f"{type(lm).__name__} has no transformers config"
    moe = lora_moe_of(model)
    hooked = hooks_reason(model, moe.gate_hook_ids if moe is not None else frozenset())
    if hooked is not None:
        return hooked
    cfg = lm.config.get_text_config() if hasattr(lm.config, "get_text_config") else lm.config
    if getattr(cfg, "model_type", None) not in FAST_MODEL_TYPES:
        return f"model_type {getattr(cfg, 'model_type', None)!r} is not one of {FAST_MODEL_TYPES}"
    if any(hasattr(p, "ds_id") for p in lm.parameters()):
        return "DeepSpeed ZeRO-3 partitioned parameters"
    body = getattr(lm, "model", None)
    layers = getattr(body, "layers", None)
    if layers is None or not hasattr(body, "rotary_emb") or not hasattr(body, "norm"):
        return "no model.layers / model.rotary_emb / model.norm"
    if _is_lora(lm.get_output_embeddings()) or _is_lora(lm.get_input_embeddings()):
        return "LoRA on the embeddings or lm_head"
    for i, layer in enumerate(layers):
        att = getattr(layer, "self_attn", None)
        if att is None or not all(hasattr(att, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj", "scaling")):
            return f"layer {i} has no standard self_attn (q/k/v/o_proj)"
        if getattr(att, "sliding_window", None):
            return "sliding-window attention"
        norms = [layer.input_layernorm, layer.post_attention_layernorm] + [getattr(att, n) for n in ("q_norm", "k_norm") if hasattr(att, n)]
        if not all(hasattr(n, "variance_epsilon") and getattr(n, "weight", None) is not None for n in norms):
            return f"layer {i}: norms are not weight * RMSNorm (variance_epsilon)"
        for m in (att.q_proj, att.k_proj, att.v_proj, att.o_proj, *_dense_mlp(layer.mlp)):
            if _is_lora(m) and any(m.use_dora.get(a, False) for a in _active_adapters(m)):
                return "DoRA adapters"
            if type(_base_linear(m)) is not torch.nn.Linear:
                return f"layer {i}: {type(_base_linear(m)).__name__} is not a plain (or LoRA-wrapped) Linear"
    return _lora_moe_reason(model, layers)


def _dense_mlp(mlp: torch.nn.Module) -> tuple[torch.nn.Module, ...]:
    """(gate, up, down) of a SwiGLU MLP; () for anything else (e.g. a MoE block, run as a module)."""
    if all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj", "act_fn")) and not hasattr(mlp, "experts"):
        return (mlp.gate_proj, mlp.up_proj, mlp.down_proj)
    return ()


class _Fused:
    """A working copy of several (possibly LoRA-adapted) linears stacked along the output dim."""

    def __init__(self, mods: Sequence[torch.nn.Module]):
        self.mods = list(mods)
        bases = [_base_linear(m) for m in self.mods]
        w0 = bases[0].weight
        self.weight = torch.empty((sum(b.out_features for b in bases), bases[0].in_features), dtype=w0.dtype, device=w0.device)
        has_bias = [b.bias is not None for b in bases]
        self.bias = torch.zeros(self.weight.shape[0], dtype=w0.dtype, device=w0.device) if any(has_bias) else None
        self.refresh()

    def params(self) -> list[torch.Tensor]:
        """Every tensor the copy is computed from (for version-based staleness checks)."""
        out = []
        for m in self.mods:
            b = _base_linear(m)
            out += [b.weight] + ([b.bias] if b.bias is not None else [])
            for a in _active_adapters(m):
                out += [m.lora_A[a].weight, m.lora_B[a].weight]
        return out

    def refresh(self) -> None:
        """``W' = W + sum_a delta_a`` into the copy, in place (CUDA graphs keep its address)."""
        row = 0
        for m in self.mods:
            b = _base_linear(m)
            n = b.out_features
            w = b.weight.float()
            for a in _active_adapters(m):
                w = w + m.get_delta_weight(a).float()
            self.weight[row : row + n].copy_(w)
            if self.bias is not None and b.bias is not None:
                self.bias[row : row + n].copy_(b.bias)
            row += n


class _LoRAMoEBlock:
    """One LoRA-MoE block on the fast path: working copies of its gate and of its bank, restacked per fused
    projection (q/k/v, o, gate/up, down) so that each costs three kernels: shrink, weight, expand-and-add.

    Per fused projection with P adapted parts (C adapters, the block's rank r): ``A`` [C*P*r, d_in] (adapter-major,
    then part) and ``Bt`` [C*P*r, d_out] holding each part's (s_c B_c)^T in that part's output columns, zeros
    elsewhere; None where no part is adapted. ``delta = ((x A^T) * w_c per adapter) Bt``, with w the dense top-k
    weights of :func:`~tracekit.moe.layer.adapter_weights`: every adapter on every token, the others' weights zero
    (as the bank's dense decode plan; C*P*r rows are a few percent of a projection's GEMM). The copies keep their
    addresses across :meth:`refresh` (captured CUDA graphs read them); the spec is read live.
    """

    def __init__(self, gate: torch.nn.Module | None, routing: torch.nn.Module, groups: Sequence[Sequence[torch.nn.Module]]):
        self.gate, self.routing = gate, routing  # gate None: Arrow routing (each projection by its prototypes)
        self.gate_w = None if gate is None else torch.empty_like(gate.weight)
        self.gate_b = None if gate is None else torch.empty_like(gate.bias)
        self.groups = []  # per fused projection: ([(part, first output column)], A, Bt, Arrow prototypes or None) or None
        C, r = routing.n_adapters, routing.rank
        for mods in groups:
            parts, col = [], 0
            for m in mods:
                if isinstance(m, LoRAMoELinear):
                    parts.append((m, col))
                col += _base_linear(m).out_features
            if not parts:
                self.groups.append(None)
                continue
            w = parts[0][0].A3
            A = torch.empty((C, len(parts), r, w.shape[2]), dtype=w.dtype, device=w.device)
            Bt = torch.zeros((C, len(parts), r, col), dtype=w.dtype, device=w.device)
            # Arrow: each part's prototypes [P, C, d_in], so one score GEMM gives the weights [T, P, C] of every part
            protos = None if gate is not None else torch.empty((len(parts), C, w.shape[2]), dtype=w.dtype, device=w.device)
            self.groups.append((parts, A, Bt, protos))
        self.refresh()

    def params(self) -> list[torch.Tensor]:
        gate = [] if self.gate is None else [self.gate.weight, self.gate.bias]
        return [*gate, self.routing.bank_A, self.routing.bank_B]

    def refresh(self) -> None:
        if self.gate is not None:
            self.gate_w.copy_(self.gate.weight)
            self.gate_b.copy_(self.gate.bias)
        for g in self.groups:
            if g is not None:
                parts, A, Bt, protos = g
                for j, (m, col) in enumerate(parts):
                    A[:, j].copy_(m.A3)
                    Bt[:, j, :, col : col + m.out_features].copy_(m.Bt3)
                    if protos is not None:
                        protos[j].copy_(m.prototypes)

    def args(self) -> tuple:
        """(gate weight, bias, top_k, renormalize, base slot, then per fused projection (A, Bt) or None); Arrow: gate
        None and each projection's (A, Bt, (prototypes [P, C, d_in], top_k, temperature))."""
        spec = self.routing.spec
        loras = []
        for g in self.groups:
            if g is None:
                loras.append(None)
                continue
            ab = (g[1].view(-1, g[1].shape[-1]), g[2].view(-1, g[2].shape[-1]))
            m = g[0][0][0]
            loras.append(ab if g[3] is None else (*ab, (g[3], m.arrow_top_k, m.arrow_temperature)))
        return (self.gate_w, self.gate_b, spec.top_k, spec.renormalize, self.routing.base_slot, *loras)


def _moe_weights(x: torch.Tensor, moe: tuple) -> torch.Tensor:
    """The block's adapter weights [T, C] in x's dtype from its input x [T, H], as the model's gate hook computes
    them (:func:`~tracekit.moe.layer.gate_probs`, then the routing spec's top-k)."""
    gw, gb, top_k, renormalize, base_slot = moe[:5]
    if gw is None:  # Arrow: each projection weighs its adapters on its own input (_with_delta)
        return None
    return adapter_weights(gate_probs(x, gw, gb), top_k, renormalize, base_slot).to(x.dtype)


def _with_delta(out: torch.Tensor, x: torch.Tensor, lora: tuple | None, w: torch.Tensor | None) -> torch.Tensor:
    """``out + ((x A^T) * w per adapter) Bt`` (see :class:`_LoRAMoEBlock`); out itself without a bank. w [T, C]: the
    block gate's weights; an Arrow bank (a third element) weighs each part by its prototypes on x: w [T, C, P]."""
    if lora is None:
        return out
    A, Bt = lora[:2]
    if len(lora) == 3:
        protos, top_k, temperature = lora[2]
        w = arrow_weights(x, protos, top_k, temperature).transpose(1, 2).to(x.dtype)  # [T, P, C] -> [T, C, P]
    z = F.linear(x, A)
    z = (z.view(z.shape[0], *w.shape[1:], -1) * w.unsqueeze(-1)).view(z.shape[0], -1)
    return torch.addmm(out, z, Bt)


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm, ``w * (x * rsqrt(mean(x^2) + eps)).to(dtype)``, as the fused kernel + one mul."""
    return F.rms_norm(x, (x.shape[-1],), None, eps) * w


def _add_linear(x: torch.Tensor, a: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """``x + a W^T (+ b)`` for 2-D x, a; without a bias one ``addmm`` (the add rides in the GEMM)."""
    if b is not None:
        return x + F.linear(a, w, b)
    return torch.addmm(x, a, w.t())


@dataclass(frozen=True)
class _Shape:
    """The per-model constants of a layer step (hashable: the compiled step specializes on them)."""

    n_kv: int
    group: int
    head_dim: int
    eps: float  # input / post-attention RMSNorm epsilon
    qk_eps: float  # q_norm / k_norm epsilon (unused without qk norms)
    scaling: float
    attention: str  # sdpa | bmm


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, sh: _Shape) -> torch.Tensor:
    """softmax(q k^T * scale + bias) v per (row, KV head). q [B, Hkv, M, D]; k, v [B, Hkv, S, D]
    (strided views of the cache); bias (0 / -inf) [B, 1, M or 1, S] for sdpa, [B * Hkv, M, S] for
    bmm -> [B, Hkv, M, D].

    ``sdpa``: one fused kernel. ``bmm`` (decode steps; prefill uses sdpa): scores by a batched GEMM
    (bf16, scale and mask in its epilogue), softmax in float32, then P V (transformers'
    eager-attention precision): at decode sizes (M = G query heads) a GEMM streams the cache closer
    to bandwidth than the fused kernels' 64-row query tiles.
    """
    if sh.attention == "sdpa" or q.shape[2] > sh.group:  # prefill chunks: the fused kernel
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=sh.scaling)
    B, H, M, D = q.shape
    S = k.shape[2]
    scores = torch.baddbmm(bias, q.reshape(B * H, M, D), k.reshape(B * H, S, D).transpose(1, 2), alpha=sh.scaling)
    p = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.bmm(p, v.reshape(B * H, S, D)).view(B, H, M, D)


def _attention_block(
    x: torch.Tensor,
    ln: torch.Tensor,
    qkv_w: torch.Tensor,
    qkv_b: torch.Tensor | None,
    qk_norm: torch.Tensor | None,
    o_w: torch.Tensor,
    o_b: torch.Tensor | None,
    kc: torch.Tensor,
    vc: torch.Tensor,
    new: torch.Tensor,
    cos: torch.Tensor,
    sin_signed: torch.Tensor,
    bias: torch.Tensor,
    sh: _Shape,
    lora: tuple | None = None,
) -> torch.Tensor:
    """``x + o_proj(attention(rope(qk_norm(qkv_proj(rms(x))))))`` for x [B*c, H]; writes this chunk's
    K/V into the cache views kc, vc [B, Hkv, S, D] at slots ``new`` [c] (in place).

    cos, sin_signed [B, c, 1, D]; bias: see :func:`_attend`; qk_norm [Hq + Hkv, D] (q_norm then
    k_norm weights, one RMSNorm over all heads of the contiguous qkv; v's are discarded); lora: a LoRA-MoE
    block's (adapter weights [B*c, C], qkv bank, o bank) (:func:`_with_delta`).
    """
    B = kc.shape[0]
    c = x.shape[0] // B
    G, D, n_kv = sh.group, sh.head_dim, sh.n_kv
    Hq = n_kv * G
    dq, dkv = Hq * D, n_kv * D
    half = D // 2
    h = _rms(x, ln, sh.eps)
    qkv = F.linear(h, qkv_w, qkv_b)
    if lora is not None:
        qkv = _with_delta(qkv, h, lora[1], lora[0])
    qkv = qkv.view(B, c, -1)
    if qk_norm is not None:
        qk = F.rms_norm(qkv.view(B, c, -1, D), (D,), None, sh.qk_eps)[:, :, : Hq + n_kv] * qk_norm
    else:
        qk = qkv[..., : dq + dkv].view(B, c, -1, D)  # q heads then k heads
    qk = torch.addcmul(qk * cos, torch.cat((qk[..., half:], qk[..., :half]), dim=-1), sin_signed)
    v = qkv[..., dq + dkv :].view(B, c, -1, D)
    kc.index_copy_(2, new, qk[:, :, Hq:].transpose(1, 2))
    vc.index_copy_(2, new, v.transpose(1, 2))
    # [B, c, Hq, D] -> [B, Hkv, G*c, D]: query head h uses KV head h // G (a view when c == 1)
    qg = qk[:, :, :Hq].transpose(1, 2).reshape(B, n_kv, G * c, D)
    span = bias.shape[-1]
    o = _attend(qg, kc[:, :, :span], vc[:, :, :span], bias, sh)
    o = o.reshape(B, Hq, c, D).transpose(1, 2).reshape(B * c, dq)
    out = _add_linear(x, o, o_w, o_b)
    return out if lora is None else _with_delta(out, o, lora[2], lora[0])


def _dense_layer(x: torch.Tensor, attn: tuple, mlp: tuple, act, moe: tuple | None = None) -> torch.Tensor:
    """One decoder layer with a SwiGLU MLP: ``x' = x + attn(x)``, ``x' + down(act(gate(h)) * up(h))``
    with ``h = rms(x')``. ``attn``: :func:`_attention_block`'s arguments after x; ``mlp``: (ln2 weight,
    gate_up weight, bias, down weight, bias); ``moe``: a LoRA-MoE block's :meth:`_LoRAMoEBlock.args` (its gate
    runs on the layer's input x, as the model's pre-hook does). A pure function of its tensors (the cache writes
    aside), so that one compiled artifact serves every layer."""
    ln2, gu_w, gu_b, down_w, down_b = mlp
    if moe is None:
        x = _attention_block(x, *attn)
        g, u = F.linear(_rms(x, ln2, attn[-1].eps), gu_w, gu_b).chunk(2, dim=-1)
        return _add_linear(x, act(g) * u, down_w, down_b)
    w = _moe_weights(x, moe)
    qkv_l, o_l, gu_l, down_l = moe[5:]
    x = _attention_block(x, *attn, lora=(w, qkv_l, o_l))
    h = _rms(x, ln2, attn[-1].eps)
    g, u = _with_delta(F.linear(h, gu_w, gu_b), h, gu_l, w).chunk(2, dim=-1)
    a = act(g) * u
    return _with_delta(_add_linear(x, a, down_w, down_b), a, down_l, w)


class FastDecoder:
    """Merged-weight decoding of a (peft) causal LM: fused working copies, static cache, CUDA graphs.

    ``refresh()`` re-merges after an optimizer step (``HFEngine.sync`` calls it each iteration;
    sessions also re-merge when any source tensor's version counter moved). ``cuda_graphs``: capture
    one decode step per (batch bucket, attended-length bucket) on CUDA (None: on when the model is
    on CUDA and every MLP is dense). ``seq_bucket``: attended-length granularity of the graphs: each
    step reads the KV cache up to its bucket's end, so a bucket of n slots reads n/2 unused slots on
    average (64 instead of 128: Qwen3-1.7B, batch 64, 512-token prompts + 128 new: 15,317 -> 16,005 decoded
    tok/s) at the cost of one capture per n tokens of length.
    ``attention``: ``sdpa`` or ``bmm`` (see :func:`_attend`). ``compile_layers``: run decode steps
    through ``torch.compile`` of :func:`_dense_layer` (one artifact for all layers; RMSNorm, RoPE,
    SiLU * up and the cache writes fuse; no cudagraphs of its own, the session captures the step);
    dense MLPs only; if the compiler backend fails (e.g. no C++ compiler for CPU code) decoding
    continues uncompiled with the reason logged.
    ``moe``: how MoE blocks run. ``fused`` (``auto`` picks it where
    :func:`tracekit.llm.moe_experts.fused_experts_reason` allows): routing, grouped expert GEMMs and the
    experts' LoRA (peft ``target_parameters``) per (token, expert) pair, on the base weights in place
    (:class:`~tracekit.llm.moe_experts.FusedExperts`), graph-capturable; ``module``: the block's own
    forward (peft then materialises every expert's adapted weight per call; no CUDA graphs).
    ``prefix_cache_mib``: keep the K/V of prefilled sequences (up to this many MiB, on the cache's device) and
    copy them into later prompts that start with the same tokens (:mod:`tracekit.llm.prefix_cache`; 0: off).
    A session's prefill first computes once each prefix its prompts share (a GRPO group, one environment's
    system prompt), then only what no stored sequence covers; :meth:`FastSession.remember` stores a finished
    batch's rows (prompt + answer) for the episode's next turn. ``refresh`` (new weights) forgets them all.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        cuda_graphs: bool | None = None,
        prefill_chunk: int = 512,
        seq_bucket: int = 64,
        attention: str = "sdpa",
        compile_layers: bool = False,
        moe: str = "auto",
        prefix_cache_mib: float = 0,
    ):
        check_value("prefix_cache_mib", prefix_cache_mib, PREFIX_CACHE_MIB)
        if moe not in ("auto", "fused", "module"):
            raise ValueError(f"moe must be auto, fused or module, got {moe!r}")
        if attention not in ("sdpa", "bmm"):
            raise ValueError(f"attention must be sdpa or bmm, got {attention!r}")
        self.attention = attention
        reason = unsupported_reason(model)
        if reason is not None:
            raise NotImplementedError(f"fast decoding does not support this model: {reason}")
        self.model = model
        self.lm = causal_lm_of(model)
        body = self.lm.model
        self.layers = list(body.layers)
        self.embed = self.lm.get_input_embeddings()
        self.norm = body.norm
        self.rotary = body.rotary_emb
        self.head = self.lm.get_output_embeddings()
        att = self.layers[0].self_attn
        cfg = self.lm.config.get_text_config() if hasattr(self.lm.config, "get_text_config") else self.lm.config
        self.n_kv = cfg.num_key_value_heads
        self.head_dim = getattr(att, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.group = cfg.num_attention_heads // self.n_kv
        self.dev = self.head.weight.device
        self.dtype = self.head.weight.dtype
        self.prefill_chunk, self.seq_bucket = prefill_chunk, seq_bucket
        dense = all(_dense_mlp(layer.mlp) for layer in self.layers)
        self.moe_blocks: list[FusedExperts | None] = [None] * len(self.layers)
        if not dense and moe != "module":
            why = {i: fused_experts_reason(l.mlp) for i, l in enumerate(self.layers) if not _dense_mlp(l.mlp)}
            bad = {i: r for i, r in why.items() if r is not None}
            if bad and moe == "fused":
                i, r = next(iter(bad.items()))
                raise NotImplementedError(f"moe=fused: layer {i}: {r}")
            if not bad:
                with torch.no_grad():
                    self.moe_blocks = [FusedExperts(l.mlp, self.dtype) if i in why else None for i, l in enumerate(self.layers)]
        graphable = all(_dense_mlp(l.mlp) or m is not None for l, m in zip(self.layers, self.moe_blocks))
        self.cuda_graphs = (self.dev.type == "cuda" and graphable) if cuda_graphs is None else bool(cuda_graphs and self.dev.type == "cuda")
        if cuda_graphs and not graphable:
            raise NotImplementedError(
                "CUDA-graph decoding needs dense MLPs or fused-experts MoE blocks (moe=module runs a block's data-dependent forward)"
            )
        if compile_layers and not dense:
            raise NotImplementedError("compile_layers needs dense MLPs (a MoE block runs as its own module)")
        with torch.no_grad():
            self.qkv = [_Fused([l.self_attn.q_proj, l.self_attn.k_proj, l.self_attn.v_proj]) for l in self.layers]
            self.o = [_Fused([l.self_attn.o_proj]) for l in self.layers]
            self.gu = [_Fused(_dense_mlp(l.mlp)[:2]) if _dense_mlp(l.mlp) else None for l in self.layers]
            self.down = [_Fused(_dense_mlp(l.mlp)[2:]) if _dense_mlp(l.mlp) else None for l in self.layers]
        self._fused = [f for f in (*self.qkv, *self.o, *self.gu, *self.down) if f is not None]
        moe_model = lora_moe_of(model)
        if compile_layers and moe_model is not None:  # the compiled step is built and checked for plain layers only
            raise NotImplementedError("compile_layers with a LoRA-MoE model (its gated layer step runs eagerly)")
        # a LoRA-MoE: each adapted block's gate and bank run inside the layer step; its hooks are bypassed
        self.applied_hooks = moe_model.gate_hook_ids if moe_model is not None else frozenset()
        self.lora_moe: list[_LoRAMoEBlock | None] = [None] * len(self.layers)
        with torch.no_grad():
            for b in moe_model.blocks if moe_model is not None else ():
                l = self.layers[b]
                att, mlp = l.self_attn, _dense_mlp(l.mlp)
                groups = [[att.q_proj, att.k_proj, att.v_proj], [att.o_proj]] + ([mlp[:2], mlp[2:]] if mlp else [])
                self.lora_moe[b] = _LoRAMoEBlock(*moe_model.block_router(b), groups)
        self.qk_norm: list[torch.Tensor] | None = None  # per layer [Hq + Hkv, D]: q_norm then k_norm weights
        self._stack_qk_norms()
        qk_eps = getattr(getattr(att, "q_norm", None), "variance_epsilon", 0.0)
        norm0 = self.layers[0].input_layernorm
        self.shape = _Shape(self.n_kv, self.group, self.head_dim, norm0.variance_epsilon, qk_eps, att.scaling, attention)
        # fullgraph: a graph break would leave per-op launches inside the step; default mode: the
        # session's own CUDA graph replays the compiled kernels (inductor's cudagraphs would nest)
        self.compiled = torch.compile(_dense_layer, fullgraph=True) if compile_layers else None
        self._versions = self._version_key()
        self._specs = self._routing_specs()
        self.cap_b = self.cap_s = 0
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool = None
        self.prefixes = PrefixStore(int(prefix_cache_mib * 2**20)) if prefix_cache_mib > 0 else None

    # ---- weights ---------------------------------------------------------------------------
    def _version_key(self) -> tuple:
        """Which tensors the working copies come from, at which version, and the LoRA-MoE routing specs: any change
        is another policy (an update, another active adapter, gates that moved, top-k changed), so the copies are
        re-merged and the stored prefixes, computed by the old policy, forgotten. Tensor identities, not only
        versions: two adapters at the same versions are still two policies."""
        srcs = [f.params() for f in self._fused] + [m.params() for m in (*self.moe_blocks, *self.lora_moe) if m is not None]
        return tuple((id(t), t._version) for ts in srcs for t in ts), self._routing_specs()

    def _routing_specs(self) -> tuple:
        return tuple(m.routing.spec for m in self.lora_moe if m is not None)

    def _stack_qk_norms(self) -> None:
        if not hasattr(self.layers[0].self_attn, "q_norm"):
            return
        hq = self.n_kv * self.group
        with torch.no_grad():
            self.qk_norm = [
                torch.cat([l.self_attn.q_norm.weight.expand(hq, -1), l.self_attn.k_norm.weight.expand(self.n_kv, -1)]).clone()
                for l in self.layers
            ]

    def refresh(self) -> None:
        """Re-merge every adapted weight into the working copies (after an optimizer update); stored
        prefixes were computed with the old weights and are forgotten."""
        if self.prefixes is not None:
            self.prefixes.clear()
        with torch.no_grad():
            for f in self._fused:
                f.refresh()
            for m in (*self.moe_blocks, *self.lora_moe):
                if m is not None:
                    m.refresh()
            if self.qk_norm is not None:
                for w, l in zip(self.qk_norm, self.layers):
                    hq = self.n_kv * self.group
                    w[:hq].copy_(l.self_attn.q_norm.weight.expand(hq, -1))
                    w[hq:].copy_(l.self_attn.k_norm.weight.expand(self.n_kv, -1))
        self._versions = self._version_key()
        if self._routing_specs() != self._specs:  # another top-k is another graph of kernels: capture anew
            self._specs = self._routing_specs()
            self.graphs.clear()
            self._pool = None

    def refresh_if_stale(self) -> None:
        if self._version_key() != self._versions:
            self.refresh()

    # ---- cache -----------------------------------------------------------------------------
    def ensure_capacity(self, batch: int, length: int) -> None:
        """Static cache for >= batch rows of >= length slots (grown by 1.5x; graphs re-captured)."""
        if batch <= self.cap_b and length <= self.cap_s:
            return
        b = max(batch, self.cap_b)
        s = max(length, int(self.cap_s * 1.5) if length > self.cap_s else self.cap_s)
        s = -(-s // self.seq_bucket) * self.seq_bucket
        self.graphs.clear()
        self._pool = None  # a pool whose graphs are all gone must not be captured into again
        self.k = self.v = []
        if self.dev.type == "cuda":
            torch.cuda.empty_cache()
        shape = (b, self.n_kv, s, self.head_dim)
        self.k = [torch.zeros(shape, dtype=self.dtype, device=self.dev) for _ in self.layers]
        self.v = [torch.zeros(shape, dtype=self.dtype, device=self.dev) for _ in self.layers]
        self.valid = torch.zeros((b, s), dtype=torch.bool, device=self.dev)
        self.slots = torch.arange(s, device=self.dev)
        self.cap_b, self.cap_s = b, s

    # ---- prefill (with stored prefixes) ----------------------------------------------------
    def prefill(self, ids: torch.Tensor, attn: torch.Tensor, pos: torch.Tensor, prompts: Sequence[Sequence[int]]) -> torch.Tensor:
        """Prefill the left-padded ``prompts`` (``ids`` [R, W] with ``attn`` a bool mask and ``pos`` positions;
        rows past the prompts are graph dummy rows, never active, left uncomputed) into cache rows [0, R) ->
        the last slot's hidden state [len(prompts), H].

        Without a prefix store: every slot of every row, in chunks. With one, each row first gets the K/V of its
        longest stored prefix (its last token is always computed: its logits start the decode); the rows are then
        cut into contiguous runs, each computed from the first slot one of its rows still needs
        (:func:`_prefill_runs`), so one row that reuses nothing does not make the others recompute what they reuse.
        """
        R, W = ids.shape
        B = len(prompts)
        self.valid[:R].zero_()
        self.valid[:R, :W] = attn
        runs = [(0, B, 0)]
        if self.prefixes is not None:
            starts = [W - len(p) for p in prompts]
            needed = []
            for r, (p, start) in enumerate(zip(prompts, starts)):
                entry, n = self.prefixes.lookup(p, limit=len(p) - 1)
                if entry is not None:
                    for kc, vc, ek, ev in zip(self.k, self.v, entry.k, entry.v):
                        kc[r, :, start : start + n] = ek[:, :n]
                        vc[r, :, start : start + n] = ev[:, :n]
                needed.append(start + n)
            runs = _prefill_runs(needed, W)
            self.prefixes.prefilled_tokens += sum(W - max(first, starts[r]) for a, b, first in runs for r in range(a, b))
        hidden = torch.empty((B, self.head.weight.shape[1]), dtype=self.dtype, device=self.dev)
        for a, b, first in runs:
            for s in range(first, W, self.prefill_chunk):
                e = min(W, s + self.prefill_chunk)
                h = self.forward(ids[a:b, s:e], pos[a:b, s:e], torch.tensor([s], device=self.dev), e, row0=a)
            hidden[a:b] = h
        return hidden

    def prefill_shared(self, prompts: Sequence[Sequence[int]], pad_id: int) -> None:
        """Prefill and store, once each, the prefixes the prompts share that no stored sequence covers yet
        (:func:`~tracekit.llm.prefix_cache.batch_shared_prefixes`), so that the batch's own prefill reuses them."""
        have = [self.prefixes.longest(p, len(p) - 1)[1] for p in prompts]
        shared = batch_shared_prefixes(prompts, have, _MIN_SHARED_PREFIX)
        if not shared:
            return
        ids, attn = left_pad(shared, pad_id)
        pos = (attn.cumsum(-1) - 1).clamp(min=0)
        self.prefill(ids.to(self.dev), attn.to(self.dev).bool(), pos.to(self.dev), shared)
        self.store_rows(shared, [ids.shape[1] - len(p) for p in shared])

    def store_rows(self, seqs: Sequence[Sequence[int]], starts: Sequence[int]) -> None:
        """Store row r's sequence ``seqs[r]`` whose K/V fill cache slots ``starts[r] ..`` (copies)."""
        for r, (seq, start) in enumerate(zip(seqs, starts)):
            end = start + len(seq)
            self.prefixes.add(seq, lambda r=r, start=start, end=end: (
                [k[r, :, start:end].clone() for k in self.k], [v[r, :, start:end].clone() for v in self.v]))

    # ---- the forward -----------------------------------------------------------------------
    def forward(self, ids: torch.Tensor, pos: torch.Tensor, slot0: torch.Tensor, span: int, row0: int = 0) -> torch.Tensor:
        """Run c new tokens per row through every layer; write their K/V at slots slot0..slot0+c-1 of cache rows
        row0..row0+B-1.

        ids, pos: [B, c] long; slot0: [1] long (a tensor, so a captured graph reads it at replay);
        span: attended slots [0, span) (>= slot0 + c). Needs ``valid[row0:row0 + B, slots]`` set for the new
        tokens. -> final normed hidden state of the last token [B, H].

        Few kernels per layer (each costs microseconds at decode sizes, whatever its work): fused
        RMSNorm (``F.rms_norm``, then the weight: transformers' rounding), q and k normed and
        rotated together, residual adds folded into ``addmm``, one additive mask per step; with
        ``compile_layers``, each decode step's layers run as one compiled :func:`_dense_layer`.
        """
        B, c = ids.shape
        G = self.group
        new = slot0 + torch.arange(c, device=ids.device)  # [c]
        keys = self.slots[:span]
        # mask[b, i, j]: key j is a real token of row b at or before query i, or is query i itself
        valid = self.valid[row0 : row0 + B]
        mask = (valid[:, None, :span] & (keys[None, None, :] <= new[None, :, None])) | (keys[None, None, :] == new[None, :, None])
        mask = mask[:, None] if c == 1 else mask.repeat(1, G, 1)[:, None]  # [B, 1, G*c or 1, span]
        bias = torch.zeros(mask.shape, dtype=self.dtype, device=mask.device).masked_fill_(~mask, float("-inf"))
        if self.attention == "bmm" and c == 1:  # the GEMM epilogue's [B * Hkv, G, span] bias, built once per step
            bias = bias.expand(B, self.n_kv, G, span).reshape(B * self.n_kv, G, span)
        x = self.embed(ids)
        cos, sin = self.rotary(x, pos)
        cos, sin = cos[:, :, None], sin[:, :, None]  # [B, c, 1, D]
        half = self.head_dim // 2
        sin_signed = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)  # rotate_half(x) * sin = cat(x2, x1) * this
        x = x.view(B * c, -1)
        compiled = c == 1 and self.compiled is not None  # prefill chunks: GEMM-bound, eager
        for i, layer in enumerate(self.layers):
            ln, ln2 = layer.input_layernorm.weight, layer.post_attention_layernorm.weight
            qkv, o, qkn = self.qkv[i], self.o[i], None if self.qk_norm is None else self.qk_norm[i]
            kc, vc = self.k[i][row0 : row0 + B], self.v[i][row0 : row0 + B]
            attn = (ln, qkv.weight, qkv.bias, qkn, o.weight, o.bias, kc, vc, new, cos, sin_signed, bias, self.shape)
            moe = None if self.lora_moe[i] is None else self.lora_moe[i].args()
            if self.gu[i] is None:  # a MoE block: fused experts, or its own module
                x = _attention_block(x, *attn, lora=None if moe is None else (_moe_weights(x, moe), *moe[5:7]))
                if self.moe_blocks[i] is not None:
                    x = x + self.moe_blocks[i](_rms(x, ln2, self.shape.eps))
                    continue
                out = layer.mlp(_rms(x, ln2, self.shape.eps).view(B, c, -1))
                x = x + (out[0] if isinstance(out, tuple) else out).reshape(B * c, -1)
                continue
            gu, dn = self.gu[i], self.down[i]
            args = (x, attn, (ln2, gu.weight, gu.bias, dn.weight, dn.bias), layer.mlp.act_fn, moe)
            x = self._compiled_layer(*args) if compiled else _dense_layer(*args)
        return _rms(x.view(B, c, -1)[:, -1], self.norm.weight, self.norm.variance_epsilon)

    def _compiled_layer(self, *args) -> torch.Tensor:
        """:func:`_dense_layer` through the compiled artifact; on a compiler-backend failure (nothing
        ran, so the cache is untouched) log why, stop compiling, and run it eagerly."""
        if self.compiled is not None:  # None once a failure switched compiling off (also mid-step)
            try:
                return self.compiled(*args)
            except torch._dynamo.exc.BackendCompilerFailed as e:
                log.warning("compile_layers off, decoding uncompiled: %s", str(e).strip().splitlines()[0])
                self.compiled = None
        return _dense_layer(*args)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.head.weight, self.head.bias).float()

    def session(self, prompts: Sequence[Sequence[int]], pad_id: int, max_new_tokens: int) -> FastSession:
        return FastSession(self, prompts, pad_id, max_new_tokens)


_MIN_SHARED_PREFIX = 16  # tokens a shared prefix must save to be prefilled on its own first
_RUN_COST = 32  # a prefill run's fixed cost, in token rows (its forward calls' per-kernel overhead)


def _prefill_runs(needed: Sequence[int], width: int) -> list[tuple[int, int, int]]:
    """Cut rows into contiguous runs ``(a, b, first)``, each prefilled from slot ``first`` = the smallest
    ``needed[r]`` (row r's first slot without reused K/V) of its rows to ``width``, minimising the token rows
    computed plus :data:`_RUN_COST` per run (dynamic programming over the cut points)."""
    n = len(needed)
    best = [0.0] + [float("inf")] * n  # best[j]: cost of rows [0, j)
    cut = [0] * (n + 1)
    for j in range(1, n + 1):
        first = width
        for i in range(j - 1, -1, -1):  # run [i, j)
            first = min(first, needed[i])
            cost = best[i] + (j - i) * (width - first) + _RUN_COST
            if cost < best[j]:
                best[j], cut[j] = cost, i
    runs, j = [], n
    while j > 0:
        i = cut[j]
        runs.append((i, j, min(needed[i:j])))
        j = i
    return runs[::-1]


def _batch_bucket(b: int) -> int:
    """Graph batch sizes: 1, 2, 4, 8, then multiples of 8 (few captures, little padding)."""
    if b <= 8:
        return 1 << (b - 1).bit_length()
    return -(-b // 8) * 8


class FastSession:
    """One batch in a :class:`FastDecoder` (same interface as :class:`PlainSession`).

    Sessions of one decoder share its static cache: use one at a time (prefill to last step).
    With CUDA graphs the batch is padded to a bucket with inactive dummy rows.
    """

    def __init__(self, dec: FastDecoder, prompts: Sequence[Sequence[int]], pad_id: int, max_new_tokens: int):
        self.dec = dec
        self.dev = dec.dev
        self.batch = len(prompts)
        self.prompts = [list(p) for p in prompts]
        self.pad_id = pad_id
        self.graphed = dec.cuda_graphs
        rows = _batch_bucket(self.batch) if self.graphed else self.batch
        ids, attn = left_pad(list(prompts) + [[pad_id]] * (rows - self.batch), pad_id)
        attn[self.batch :] = 0  # dummy rows filling a graph's batch: no real token, never active
        self.width = ids.shape[1]
        self.rows = rows
        dec.ensure_capacity(rows, self.width + max_new_tokens)
        with torch.inference_mode():
            dec.refresh_if_stale()
        dev = dec.dev
        self.ids, self.attn = ids.to(dev), attn.to(dev).bool()
        self.pos = (attn.cumsum(-1) - 1).clamp(min=0).to(dev)
        self.t = self.width  # next cache slot
        self.last_pos = self.pos[:, -1].clone()
        self.pad_active = torch.zeros(rows - self.batch, dtype=torch.bool, device=dev)

    @torch.inference_mode()
    def prefill(self) -> torch.Tensor:
        d = self.dec
        if d.prefixes is not None:
            d.prefixes.prompt_tokens += sum(map(len, self.prompts))
            d.prefill_shared(self.prompts, self.pad_id)
        return d.logits(d.prefill(self.ids, self.attn, self.pos, self.prompts))[: self.batch]

    @torch.inference_mode()
    def remember(self, seqs: Sequence[Sequence[int]]) -> None:
        """Store each row's sequence (its prompt, then tokens fed by :meth:`step` since) in the decoder's prefix
        store, for a later prompt that continues it (an episode's next turn). No-op without a store."""
        d = self.dec
        if d.prefixes is None:
            return
        if len(seqs) != self.batch:
            raise ValueError(f"remember: {len(seqs)} sequences for a batch of {self.batch}")
        starts = [self.width - len(p) for p in self.prompts]
        for r, (seq, prompt, start) in enumerate(zip(seqs, self.prompts, starts)):
            if list(seq[: len(prompt)]) != prompt or start + len(seq) > self.t:
                raise ValueError(f"remember: row {r}'s sequence is not its prompt followed by at most the {self.t - self.width} tokens fed")
        d.store_rows(seqs, starts)

    def _span(self) -> int:
        if not self.graphed:
            return self.t + 1
        return min(self.dec.cap_s, -(-(self.t + 1) // self.dec.seq_bucket) * self.dec.seq_bucket)

    @torch.inference_mode()
    def step(self, tokens: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
        d = self.dec
        if self.t >= d.cap_s:
            raise RuntimeError(f"fast decoding ran past its cache ({d.cap_s} slots): more steps than max_new_tokens")
        self.last_pos = self.last_pos + 1
        tokens, active = tokens.to(d.dev), active.to(d.dev)
        if self.rows > self.batch:
            tokens = torch.cat([tokens, torch.zeros_like(self.pad_active, dtype=tokens.dtype)])
            active = torch.cat([active, self.pad_active])
        span = self._span()
        if not self.graphed:
            d.valid[: self.rows, self.t] = active
            hidden = d.forward(tokens[:, None], self.last_pos[:, None], torch.tensor([self.t], device=d.dev), span)
            out = d.logits(hidden)
        else:
            out = self._replay(tokens, active, span)
        self.t += 1
        return out[: self.batch]

    def _replay(self, tokens: torch.Tensor, active: torch.Tensor, span: int) -> torch.Tensor:
        d = self.dec
        key = (self.rows, span)
        fresh = key not in d.graphs
        if fresh:
            io = {
                "ids": torch.zeros((self.rows, 1), dtype=torch.long, device=d.dev),
                "pos": torch.zeros((self.rows, 1), dtype=torch.long, device=d.dev),
                "slot": torch.zeros(1, dtype=torch.long, device=d.dev),
                "active": torch.zeros(self.rows, dtype=torch.bool, device=d.dev),
            }
        else:
            graph, io = d.graphs[key]
        io["ids"].copy_(tokens[:, None])
        io["pos"].copy_(self.last_pos[:, None])
        io["slot"].fill_(self.t)
        io["active"].copy_(active)
        if fresh:
            graph = self._capture(io, span)
            d.graphs[key] = (graph, io)
        graph.replay()
        return io["logits"]

    def _capture(self, io: dict[str, torch.Tensor], span: int) -> torch.cuda.CUDAGraph:
        """Capture this step (inputs already in ``io``). The warm-up executes the real step, whose
        cache writes the replay then repeats with the same values (idempotent)."""
        d, B = self.dec, self.rows

        def body() -> torch.Tensor:
            d.valid[:B].index_copy_(1, io["slot"], io["active"][:, None])
            return d.logits(d.forward(io["ids"], io["pos"], io["slot"], span))

        stream = torch.cuda.Stream(device=d.dev)  # lazy kernel init must not happen during capture
        stream.wait_stream(torch.cuda.current_stream(d.dev))
        with torch.cuda.stream(stream):
            body()
        torch.cuda.current_stream(d.dev).wait_stream(stream)
        if d._pool is None:
            d._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=d._pool):
            io["logits"] = body()
        log.debug("captured a decode graph: batch %d, span %d", B, span)
        return graph

    can_prune = False

    def keep(self, index: torch.Tensor) -> None:
        raise RuntimeError("FastSession rows are masked, not pruned")


# --------------------------------------------------------------------------------------------
# The device-side picker


def open_session(model_or_decoder, prompts: Sequence[Sequence[int]], pad_id: int, max_new_tokens: int, prefill_chunk: int | None = None):
    """A :class:`FastSession` for a :class:`FastDecoder`, else a :class:`PlainSession` of the model.

    A decoder whose model has gained forward hooks since it was built decodes plainly (logged)."""
    if isinstance(model_or_decoder, FastDecoder):
        hooked = hooks_reason(model_or_decoder.model, model_or_decoder.applied_hooks)
        if hooked is None:
            return model_or_decoder.session(prompts, pad_id, max_new_tokens)
        log.info("plain decoding for this batch: %s", hooked)
        return PlainSession(model_or_decoder.model, prompts, pad_id, prefill_chunk or model_or_decoder.prefill_chunk)
    return PlainSession(model_or_decoder, prompts, pad_id, prefill_chunk)


@torch.no_grad()
def generate(
    model_or_decoder,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    temperature: float,
    top_p: float = 1.0,
    stop_ids: Sequence[int] = (),
    pad_id: int = 0,
    seed: int = 0,
    sync_every: int = 8,
) -> list[Completion]:
    """Batched sampling on the device with per-row stopping (the rollout engine's sampler).

    ``model_or_decoder``: a (peft) model (plain path) or a :class:`FastDecoder` (merged path); both
    give the same tokens under greedy decoding. A row ends at its first stop id (kept) or after
    ``max_new_tokens``; the loop checks for "all done" every ``sync_every`` steps (one host sync).
    """
    if not prompts:
        return []
    sess = open_session(model_or_decoder, prompts, pad_id, max_new_tokens)
    dev = sess.dev
    sync_every = sync_every if dev.type == "cuda" else 1  # a host check costs nothing on CPU
    B = len(prompts)
    gen = torch.Generator(device=dev).manual_seed(int(seed))
    stop = torch.tensor(sorted(set(stop_ids)) or [-1], device=dev)
    out_ids = torch.full((B, max_new_tokens), pad_id, dtype=torch.long, device=dev)
    out_lp = torch.zeros((B, max_new_tokens), dtype=torch.float32, device=dev)
    lengths = torch.zeros(B, dtype=torch.long, device=dev)
    done = torch.zeros(B, dtype=torch.bool, device=dev)
    stopped = torch.zeros(B, dtype=torch.bool, device=dev)
    pad = torch.full((B,), pad_id, dtype=torch.long, device=dev)
    logits = sess.prefill()
    for t in range(max_new_tokens):
        tok, lp = sample_step(logits, temperature, top_p, gen)
        active = ~done
        out_ids[:, t] = torch.where(active, tok, pad)
        out_lp[:, t] = torch.where(active, lp, torch.zeros_like(lp))
        lengths += active.long()
        hit = active & torch.isin(tok, stop)
        stopped |= hit
        done |= hit
        if t + 1 == max_new_tokens or ((t + 1) % sync_every == 0 and bool(done.all())):
            break
        logits = sess.step(out_ids[:, t], ~done)
    ids_cpu, lp_cpu, len_cpu, stop_cpu = out_ids.cpu(), out_lp.cpu(), lengths.cpu(), stopped.cpu()
    return [
        Completion(
            ids=ids_cpu[i, : len_cpu[i]].tolist(),
            logprobs=lp_cpu[i, : len_cpu[i]].tolist(),
            finish_reason="stop" if stop_cpu[i] else "length",
        )
        for i in range(B)
    ]
