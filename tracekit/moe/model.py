"""Compose trained peft LoRA adapters into one LoRA-MoE model over a frozen backbone (paper section 3.5).

``build_lora_moe(backbone, adapters)`` loads each adapter directory written by peft's
``save_pretrained`` (adapter_config.json + adapter_model.safetensors), replaces every adapted
Linear of every adapted decoder block with a :class:`~tracekit.moe.layer.LoRAMoELinear` and installs
one gate per adapted block. The gate runs once per block in a forward pre-hook on the decoder layer
(input = the block's input hidden state, the residual stream) and its probabilities are shared by
all adapted projections of that block. Backbone and adapter bank are frozen; only the gates train.

Works on HF causal LMs whose decoder layers are ``model.model.layers`` (Qwen3, Qwen3-MoE, Llama /
SmolLM2). Adapted modules must be ``nn.Linear``: LoRA on fused 3-D expert parameters (peft
``target_parameters``), DoRA, LoRA biases, ``modules_to_save`` and embedding LoRA are rejected.

A composed model saves to a directory: ``moe_config.json`` (backbone reference, adapter names,
routing config, architecture check), ``adapters/<i>_<name>/`` (the peft adapter files copied
byte for byte) and ``gates.safetensors``.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from tracekit.artifacts import atomic_write_json, read_json
from tracekit.moe.arrow import arrow_prototype
from tracekit.moe.counts import composed_parameter_counts, format_counts
from tracekit.moe.layer import BlockGate, BlockRouting, LoRAMoELinear, RoutingSpec, decision_weights
from tracekit.ranges import check_choice, check_value

log = logging.getLogger(__name__)

FORMAT = "tracekit-lora-moe"
FORMAT_VERSION = 1
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
_KEY = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<which>[AB])\.weight$")
_BLOCK = re.compile(r"^model\.layers\.(?P<block>\d+)\.(?P<sub>.+)$")
# adapter_config fields that change the forward pass in ways a plain (A, B, alpha/r) bank cannot express
_UNSUPPORTED = (
    "use_dora", "lora_bias", "fan_in_fan_out", "target_parameters", "modules_to_save",
    "trainable_token_indices", "alora_invocation_tokens", "layer_replication", "arrow_config",
    "use_qalora", "kasa_config", "velora_config", "monteclora_config", "use_bdlora",
)  # fmt: skip


@dataclass
class MoEConfig:
    """Routing configuration of a composed model.

    top_k / renormalize: inference routing (paper: top-1; raw probabilities as the official code).
    impl: how top-k routing is computed ("grouped", "grouped_mm" or "masked_dense"; see layer.py).
    train_top_k: None = the paper's training mixture over all experts; k = top-k training.
    include_base_slot: add the official code's "no adapter" slot 0 to the gate.
    gate_init_std: 0 = zero-initialized gates (uniform p at start, as the official code); > 0 = N(0, std)
    drawn with ``seed``.
    router: "gate" (TRACE: one trained linear gate per adapted block, routing every projection of the block) or
    "arrow" (training-free, :mod:`tracekit.moe.arrow`: every adapted projection routes its own input by its
    adapters' prototypes, ``top_k`` of them weighed by a softmax at ``router_temperature``; no gate, no base slot,
    every adapter of one rank on one set of modules).
    granularity (issue 53): "token" (the paper's: every token routed by its block's gate), "turn" (one decision per
    assistant turn, from the turn's prompt) or "trajectory" (one decision per episode, from its opening); the two
    coarse ones are applied by :class:`tracekit.moe.routed.PromptRoutedClient`, which pins every gate to the
    decision's weights for the turn (:meth:`LoRAMoEModel.pinned`).
    soft_top_k / soft_temperature: None = hard routing (``top_k``; the paper's top-1); k = soft top-k mixing at
    inference, the k most probable slots weighed by softmax(logit / soft_temperature) over those k (weights sum to
    1). At token granularity the temperature is folded into the gates when a saved model is loaded for inference.
    decider: "gate" (the decisions come from the gates) or "task" (``consolidation=route``: a task-level router
    decides per episode, :mod:`tracekit.moe.task_router`; the gates only carry its decisions).
    """

    top_k: int = 1
    renormalize: bool = False
    impl: str = "grouped"
    train_top_k: int | None = None
    include_base_slot: bool = False
    gate_dtype: str = "float32"
    gate_init_std: float = 0.0
    seed: int = 0
    router: str = "gate"
    router_temperature: float = 1.0
    granularity: str = "token"
    soft_top_k: int | None = None
    soft_temperature: float = 1.0
    decider: str = "gate"

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> MoEConfig:
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown MoE config keys: {sorted(unknown)} (known: {sorted(known)})")
        return cls(**d)

    def __post_init__(self) -> None:
        check_choice("granularity", self.granularity, GRANULARITIES)
        check_choice("decider", self.decider, ("gate", "task"))
        check_value("soft_top_k", self.soft_top_k, ">= 1")
        check_value("soft_temperature", self.soft_temperature, "> 0")
        if self.decider == "task" and (self.granularity != "trajectory" or not self.include_base_slot):
            raise ValueError("decider 'task' decides once per episode over the adapters and the base: it needs "
                             "granularity 'trajectory' and include_base_slot")
        if self.router == "arrow" and (self.granularity != "token" or self.soft_top_k is not None):
            raise ValueError("Arrow routes every token by its own prototypes (its top_k and router_temperature): no "
                             "granularity or soft top-k of the gate")

    def saved(self) -> dict[str, Any]:
        """The fields as saved in ``moe_config.json``: the routing fields added with issue 53 only where they are not
        their defaults, so a model composed as before saves the same file."""
        out = asdict(self)
        for name in _ROUTING_FIELDS:
            if out[name] == _ROUTING_DEFAULTS[name]:
                del out[name]
        return out


GRANULARITIES = ("token", "turn", "trajectory")  # MoEConfig.granularity: how often the routing is decided
_ROUTING_FIELDS = ("granularity", "soft_top_k", "soft_temperature", "decider")
_ROUTING_DEFAULTS = {f.name: f.default for f in fields(MoEConfig) if f.name in _ROUTING_FIELDS}


@dataclass
class PeftLoRA:
    """One peft LoRA adapter: module path (``model.layers.3.self_attn.q_proj``) -> factors and scale."""

    name: str
    path: Path
    config: dict[str, Any]
    factors: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(repr=False)  # (A [r, d_in], B [d_out, r])
    scales: dict[str, float]

    @property
    def modules(self) -> list[str]:
        return sorted(self.factors)


def load_peft_adapter(path: str | Path, name: str | None = None) -> PeftLoRA:
    """Read a peft ``save_pretrained`` directory; scale = alpha / r (alpha / sqrt(r) with rsLoRA), per module."""
    from peft.utils.other import get_pattern_key

    path = Path(path)
    for f in ADAPTER_FILES:
        if not (path / f).is_file():
            raise FileNotFoundError(f"{path}: not a peft LoRA adapter directory (missing {f})")
    cfg = read_json(path / "adapter_config.json")
    if cfg.get("peft_type") != "LORA":
        raise ValueError(f"{path}: peft_type {cfg.get('peft_type')!r} is not LORA")
    bad = [k for k in _UNSUPPORTED if cfg.get(k) not in (None, False, [], {}, "none")]
    if cfg.get("bias", "none") != "none":
        bad.append(f"bias={cfg['bias']!r}")
    if bad:
        raise ValueError(f"{path}: LoRA features the MoE bank does not support: {', '.join(bad)}")
    raw = load_file(str(path / "adapter_model.safetensors"))
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in raw.items():
        m = _KEY.match(key)
        if m is None:
            raise ValueError(f"{path}: unsupported tensor {key!r} (only Linear lora_A/lora_B weights are supported)")
        parts.setdefault(m["module"], {})[m["which"]] = tensor
    factors, scales = {}, {}
    rank_pattern, alpha_pattern = cfg.get("rank_pattern") or {}, cfg.get("alpha_pattern") or {}
    for module, ab in parts.items():
        if set(ab) != {"A", "B"}:
            raise ValueError(f"{path}: module {module} has only lora_{''.join(ab)}")
        A, B = ab["A"], ab["B"]
        r = A.shape[0]
        if A.dim() != 2 or B.dim() != 2 or B.shape[1] != r:
            raise ValueError(f"{path}: {module}: A {tuple(A.shape)} and B {tuple(B.shape)} are not LoRA factors")
        expected_r = rank_pattern.get(get_pattern_key(rank_pattern.keys(), module), cfg["r"])
        if r != expected_r:
            raise ValueError(f"{path}: {module}: rank {r} in the weights, {expected_r} in adapter_config.json")
        alpha = alpha_pattern.get(get_pattern_key(alpha_pattern.keys(), module), cfg["lora_alpha"])
        factors[module] = (A, B)
        scales[module] = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
    if not factors:
        raise ValueError(f"{path}: adapter holds no LoRA weights")
    return PeftLoRA(name or path.name, path, cfg, factors, scales)


def check_arrow_adapters(adapters: Sequence[PeftLoRA]) -> None:
    """Arrow's prototypes compare adapters module by module: every adapter must adapt the same modules at the same
    rank (peft's ``check_loaded_lora_compatibility_arrow``). One line naming the adapters that differ, else None."""
    ref = adapters[0]
    for a in adapters[1:]:
        if set(a.factors) != set(ref.factors):
            def short(names):  # peft's target_modules: the modules' own names
                return ", ".join(sorted({n.rpartition(".")[2] for n in names}))
            raise ValueError(f"Arrow needs adapters on the same target modules: {ref.name!r} targets "
                             f"[{short(ref.factors)}] ({len(ref.factors)} modules), {a.name!r} [{short(a.factors)}] "
                             f"({len(a.factors)} modules)")
        ranks = {m: (ref.factors[m][0].shape[0], a.factors[m][0].shape[0]) for m in ref.factors}
        bad = {m: rr for m, rr in ranks.items() if rr[0] != rr[1]}
        if bad:
            m, (r0, r1) = sorted(bad.items())[0]
            raise ValueError(f"Arrow needs adapters of one rank: {ref.name!r} has rank {r0} and {a.name!r} rank {r1} "
                             f"(on {m}{f' and {len(bad) - 1} more modules' if len(bad) > 1 else ''})")


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """``model.model.layers`` of an HF causal LM, or one clear error."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise TypeError(f"{type(model).__name__}: decoder layers not found at model.model.layers")
    return layers


def _has_submodule(model: nn.Module, name: str) -> bool:
    try:
        model.get_submodule(name)
    except AttributeError:
        return False
    return True


def _arch(model: nn.Module) -> dict[str, Any]:
    c = model.config
    return {k: getattr(c, k, None) for k in ("model_type", "hidden_size", "num_hidden_layers", "vocab_size")}


class LoRAMoEModel(nn.Module):
    """A frozen causal LM whose adapted projections mix a bank of frozen LoRA adapters by per-block gates.

    ``forward``/``generate`` are the backbone's. Routing follows ``config.top_k`` (inference) until
    changed with :meth:`set_routing` or the :meth:`routing` context manager (gate training uses
    ``RoutingSpec(config.train_top_k, ...)``).
    """

    def __init__(
        self,
        model: nn.Module,
        adapters: list[PeftLoRA],
        config: MoEConfig,
        backbone_spec: dict[str, Any] | None,
    ):
        super().__init__()
        self.model = model
        self.moe_config = config
        self.adapter_names = [a.name for a in adapters]
        self.adapter_dirs = [a.path for a in adapters]
        self.backbone_spec = backbone_spec
        self.slot_names = (["base"] if config.include_base_slot else []) + self.adapter_names
        modules = adapters[0].modules
        by_block: dict[int, list[str]] = {}
        for module in modules:
            m = _BLOCK.match(module)
            if m is None:
                raise ValueError(f"adapted module {module} is not inside a decoder block model.layers.N")
            by_block.setdefault(int(m["block"]), []).append(module)
        self.blocks = sorted(by_block)
        self.adapted_modules = modules
        layers = decoder_layers(model)
        arrow = config.router == "arrow"
        if config.router not in ("gate", "arrow"):
            raise ValueError(f"router must be 'gate' or 'arrow', got {config.router!r}")
        if arrow:
            check_arrow_adapters(adapters)
            if config.include_base_slot:
                raise ValueError("Arrow routing has no base slot (include_base_slot=True)")
            if not 1 <= config.top_k <= len(adapters):
                raise ValueError(f"Arrow top_k={config.top_k} must be in [1, {len(adapters)}] (the adapters)")
        for module in modules:  # validate everything before touching the backbone
            base = model.get_submodule(module) if _has_submodule(model, module) else None
            if not isinstance(base, nn.Linear):
                kind = "missing" if base is None else type(base).__name__
                raise TypeError(f"adapted module {module} is {kind} in the backbone; LoRAMoELinear wraps nn.Linear")
        model.requires_grad_(False)
        hidden = model.config.hidden_size
        n_slots = len(self.slot_names)
        gen = torch.Generator().manual_seed(config.seed)
        self.routings: dict[int, BlockRouting] = {}
        gates = {}
        for b in self.blocks:
            routing = BlockRouting(len(adapters), config.include_base_slot, self.inference_spec)
            self.routings[b] = routing
            for module in by_block[b]:
                parent_name, _, child = module.rpartition(".")
                parent = model.get_submodule(parent_name)
                bank = LoRAMoELinear(
                    getattr(parent, child),
                    [a.factors[module] for a in adapters],
                    [a.scales[module] for a in adapters],
                    routing,
                )
                setattr(parent, child, bank)
                if arrow:
                    protos = torch.stack([arrow_prototype(*a.factors[module]) for a in adapters])
                    bank.set_arrow(protos, config.top_k, config.router_temperature)
            if arrow:  # no gate: each projection routes itself
                continue
            device = next(layers[b].parameters()).device
            gate = BlockGate(hidden, n_slots, dtype=getattr(torch, config.gate_dtype))
            with torch.no_grad():
                if config.gate_init_std > 0:
                    gate.weight.copy_(torch.randn(gate.weight.shape, generator=gen) * config.gate_init_std)
                else:
                    gate.weight.zero_()
                gate.bias.zero_()
            gates[str(b)] = gate.to(device)
        self.gates = nn.ModuleDict(gates)
        self.banks = nn.ModuleDict({str(b): r for b, r in self.routings.items()})  # the frozen adapter banks
        hooked = [] if arrow else self.blocks  # Arrow: no gate to run, no plan to release
        self._hooks = [
            layers[b].register_forward_pre_hook(self._gate_hook(b), with_kwargs=True) for b in hooked
        ] + [layers[b].register_forward_hook(self._release_hook(b)) for b in hooked]
        self._tempered = False  # apply_inference_temperature ran: the gates hold logits / T
        self.assert_frozen()

    def _gate_hook(self, block: int) -> Callable:
        gate, routing = self.gates[str(block)], self.routings[block]

        def hook(_module: nn.Module, args: tuple, kwargs: dict) -> None:
            h = args[0] if args else kwargs["hidden_states"]
            routing.set_probs(gate.probs(h).reshape(-1, routing.n_slots), h.dtype)

        return hook

    def _release_hook(self, block: int) -> Callable:
        routing = self.routings[block]

        def hook(_module: nn.Module, _args: tuple, _output: Any) -> None:
            routing.release()

        return hook

    # ------------------------------------------------------------------ decoders that route themselves

    @property
    def gate_hook_ids(self) -> frozenset[int]:
        """Ids of the gate pre-hooks and release hooks this model put on its decoder layers. A decoder that runs
        each adapted block's gate and bank itself (``tracekit.llm.decoding.FastDecoder``, through
        :meth:`block_router`) bypasses exactly these; any other hook still stops it."""
        return frozenset(h.id for h in self._hooks)

    def block_router(self, block: int) -> tuple[BlockGate | None, BlockRouting]:
        """Adapted block ``block``'s gate and routing (its spec and bank; the projections hold their column
        offsets). What :meth:`_gate_hook` runs, for a decoder that computes
        ``adapter_weights(gate_probs(block input, ...), spec...)`` and the bank's delta itself. Arrow routing: no
        gate (None); the projections hold their prototypes."""
        if block not in self.routings:
            raise KeyError(f"block {block} is not adapted (adapted blocks: {self.blocks})")
        return self.gates[str(block)] if str(block) in self.gates else None, self.routings[block]

    @property
    def router(self) -> str:
        return self.moe_config.router

    # ------------------------------------------------------------------ routing

    @property
    def inference_spec(self) -> RoutingSpec:
        c = self.moe_config
        if c.soft_top_k is not None:  # soft top-k: the kept slots' weights renormalized (they sum to 1)
            return RoutingSpec(c.soft_top_k, True, c.impl)
        return RoutingSpec(c.top_k, c.renormalize, c.impl)

    @property
    def training_spec(self) -> RoutingSpec:
        return RoutingSpec(self.moe_config.train_top_k, self.moe_config.renormalize, self.moe_config.impl)

    @property
    def spec(self) -> RoutingSpec:
        return next(iter(self.routings.values())).spec

    def set_routing(self, spec: RoutingSpec) -> None:
        for r in self.routings.values():
            r.set_spec(spec)

    @contextlib.contextmanager
    def routing(self, spec: RoutingSpec) -> Iterator[None]:
        """Temporarily route with ``spec`` (restored on exit)."""
        old = self.spec
        self.set_routing(spec)
        try:
            yield
        finally:
            self.set_routing(old)

    @contextlib.contextmanager
    def pinned(self, weights: torch.Tensor) -> Iterator[None]:
        """Route every token of every adapted block with the fixed slot weights ``weights`` [S] (a turn's or an
        episode's decision: non-negative, summing to 1) until exit: each gate's weight is zeroed and its bias set to
        log(weights), so softmax gives exactly ``weights`` on every token, under the dense mixture. The plain forward
        (gate hooks) and the fast decoder (which copies the gates when their version counters move) both route
        so; the gates and the routing spec are restored on exit."""
        if self.router != "gate":
            raise ValueError(f"router {self.router!r} has no gates to pin")
        w = torch.as_tensor(weights, dtype=torch.float32).flatten()
        if w.numel() != len(self.slot_names) or bool((w < 0).any()) or abs(float(w.sum()) - 1.0) > 1e-4:
            raise ValueError(f"pinned weights must be {len(self.slot_names)} non-negative values summing to 1, "
                             f"got {w.tolist()}")
        saved = {b: (g.weight.detach().clone(), g.bias.detach().clone()) for b, g in self.gates.items()}
        try:
            with torch.no_grad():
                for g in self.gates.values():
                    g.weight.zero_()
                    g.bias.copy_(w.log().to(g.bias))  # log 0 = -inf: that slot's probability is exactly 0
            with self.routing(RoutingSpec(None, False, self.moe_config.impl)):
                yield
        finally:
            with torch.no_grad():
                for b, g in self.gates.items():
                    g.weight.copy_(saved[b][0])
                    g.bias.copy_(saved[b][1])

    def decide(self, probs: torch.Tensor) -> torch.Tensor:
        """Slot weights [B, S] of one turn's or episode's decision from its routing distribution ``probs`` [B, S]
        (:func:`tracekit.moe.gate.prompt_decisions`), by the configured hard or soft top-k
        (:func:`tracekit.moe.layer.decision_weights`)."""
        c = self.moe_config
        return decision_weights(probs, c.soft_top_k, c.soft_temperature)

    def apply_inference_temperature(self) -> None:
        """Fold ``soft_temperature`` into the gates (logits / T) for token-level soft top-k: every decoder computes
        ``softmax(h W^T + b)`` from the gate's parameters, so scaling them is the tempered softmax on every path.
        A model so scaled is an inference view: :meth:`save` refuses it."""
        c = self.moe_config
        if c.soft_top_k is None or c.granularity != "token" or c.soft_temperature == 1.0 or self._tempered:
            return
        with torch.no_grad():
            for g in self.gates.values():
                g.weight.div_(c.soft_temperature)
                g.bias.div_(c.soft_temperature)
        self._tempered = True

    def gate_probs(self) -> dict[int, torch.Tensor]:
        """Per adapted block, the gate probabilities [tokens, slots] of the latest forward."""
        out = {}
        for b, r in self.routings.items():
            if r.probs is None:
                raise RuntimeError("no forward has run yet")
            out[b] = r.probs
        return out

    # ------------------------------------------------------------------ passthrough

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.model(*args, **kwargs)

    def get_base_model(self) -> Any:
        """The CausalLM carrying the gates and MoE projections (peft's name: callers unwrap either alike)."""
        return self.model

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        return self.model.generate(*args, **kwargs)

    @property
    def config(self) -> Any:
        return self.model.config

    # ------------------------------------------------------------------ training invariants

    def trainable_parameters(self) -> dict[str, nn.Parameter]:
        """The gate parameters, by name (``gates.<block>.weight`` / ``.bias``): the only trainable ones."""
        return {f"gates.{n}": p for n, p in self.gates.named_parameters()}

    def assert_frozen(self) -> None:
        """Raise unless the backbone and the adapter bank are frozen and every gate parameter trains."""
        gate_names = set(self.trainable_parameters())
        wrong = [n for n, p in self.named_parameters() if p.requires_grad != (n in gate_names)]
        if wrong:
            raise RuntimeError(f"only the gates may train; requires_grad is wrong for: {wrong[:10]}")

    def parameter_counts(self) -> dict[str, Any]:
        return composed_parameter_counts(self)

    # ------------------------------------------------------------------ save / load

    def save(self, directory: str | Path) -> Path:
        """Write the composed model to ``directory`` atomically (temp dir + rename)."""
        if self.backbone_spec is None:
            raise ValueError("no backbone reference: pass backbone_spec=... to build_lora_moe to make it saveable")
        if self._tempered:
            raise ValueError("the gates hold logits / soft_temperature (an inference view): save the model as composed")
        directory = Path(directory)
        directory.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=directory.parent, prefix=f".{directory.name}."))
        try:
            entries = []
            for i, (name, src) in enumerate(zip(self.adapter_names, self.adapter_dirs)):
                rel = f"adapters/{i:02d}_{re.sub(r'[^A-Za-z0-9_.-]', '_', name)}"
                (tmp / rel).mkdir(parents=True)
                for f in ADAPTER_FILES:
                    if not (src / f).is_file():
                        raise FileNotFoundError(f"adapter {name}: {src / f} no longer exists; cannot copy it")
                    shutil.copyfile(src / f, tmp / rel / f)
                entries.append({"name": name, "dir": rel, "source": f"{src.parent.name}/{src.name}"})  # not a path: the cache can move
            gates = {
                f"{b}.{k}": v.detach().float().cpu().contiguous()
                for b, g in self.gates.items()
                for k, v in g.state_dict().items()
            }
            save_file(gates, str(tmp / "gates.safetensors"))
            atomic_write_json(
                tmp / "moe_config.json",
                {
                    "format": FORMAT,
                    "version": FORMAT_VERSION,
                    "backbone": self.backbone_spec,
                    "backbone_arch": _arch(self.model),
                    "adapters": entries,
                    "blocks": self.blocks,
                    "adapted_modules": self.adapted_modules,
                    "slot_names": self.slot_names,
                    "moe": self.moe_config.saved(),
                },
            )
            if directory.exists():
                old = Path(tempfile.mkdtemp(dir=directory.parent, prefix=f".{directory.name}.old."))
                os.replace(directory, old / "x")
                os.replace(tmp, directory)
                shutil.rmtree(old)
            else:
                os.replace(tmp, directory)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return directory

    @classmethod
    def load(
        cls,
        directory: str | Path,
        backbone: nn.Module | None = None,
        backbone_loader: Callable[[dict[str, Any]], nn.Module] | None = None,
    ) -> LoRAMoEModel:
        """Rebuild a saved composed model; the backbone comes from ``backbone``, ``backbone_loader(spec)``
        or :func:`load_backbone`."""
        directory = Path(directory)
        meta = read_json(directory / "moe_config.json")
        if meta.get("format") != FORMAT or meta.get("version") != FORMAT_VERSION:
            raise ValueError(f"{directory}: not a {FORMAT} v{FORMAT_VERSION} directory")
        if backbone is None:
            backbone = (backbone_loader or load_backbone)(meta["backbone"])
        if _arch(backbone) != meta["backbone_arch"]:
            raise ValueError(f"backbone architecture {_arch(backbone)} differs from the saved {meta['backbone_arch']}")
        adapters = {a["name"]: directory / a["dir"] for a in meta["adapters"]}
        model = build_lora_moe(backbone, adapters, MoEConfig.from_dict(meta["moe"]), backbone_spec=meta["backbone"])
        state = load_file(str(directory / "gates.safetensors"))
        expected = {f"{b}.{k}" for b, g in model.gates.items() for k in g.state_dict()}
        if set(state) != expected:
            raise ValueError(f"{directory}/gates.safetensors: keys {sorted(set(state) ^ expected)[:6]} do not match")
        with torch.no_grad():
            for b, g in model.gates.items():
                for k, p in g.named_parameters():
                    p.copy_(state[f"{b}.{k}"])
        model.apply_inference_temperature()
        return model


def load_backbone(spec: Mapping[str, Any]) -> nn.Module:
    """Backbone from a reference: ``{"name_or_path", "dtype"?, "revision"?}`` (from_pretrained) or
    ``{"hf_config": {...}, "seed", "dtype"?}`` (random init from a config, same seed -> same weights on CPU)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    dtype = getattr(torch, spec.get("dtype", "float32"))
    if "name_or_path" in spec:
        return AutoModelForCausalLM.from_pretrained(spec["name_or_path"], dtype=dtype, revision=spec.get("revision"))
    if "hf_config" in spec:
        cfg = dict(spec["hf_config"])
        config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(int(spec["seed"]))
            return AutoModelForCausalLM.from_config(config, dtype=dtype)
    raise ValueError(f"backbone reference needs 'name_or_path' or 'hf_config'+'seed', got keys {sorted(spec)}")


def build_lora_moe(
    backbone: nn.Module,
    adapters: Mapping[str, str | Path] | Sequence[str | Path],
    config: MoEConfig | None = None,
    backbone_spec: dict[str, Any] | None = None,
) -> LoRAMoEModel:
    """Compose peft adapters (``{name: dir}`` or a list of dirs, named by directory) over ``backbone``.

    All adapters must adapt the same set of modules (ranks may differ). The backbone is modified in
    place (its adapted Linears are replaced) and frozen. ``backbone_spec`` is the reference saved with
    the model (default: ``{"name_or_path": config._name_or_path}`` when the backbone has one).
    """
    config = config or MoEConfig()
    decoder_layers(backbone)
    items = list(adapters.items()) if isinstance(adapters, Mapping) else [(None, p) for p in adapters]
    if not items:
        raise ValueError("need at least one adapter")
    loaded = [load_peft_adapter(p, n) for n, p in items]
    names = [a.name for a in loaded]
    if len(set(names)) != len(names):
        raise ValueError(f"adapter names must be unique, got {names}")
    if config.router == "arrow":
        check_arrow_adapters(loaded)
    ref = set(loaded[0].factors)
    for a in loaded[1:]:
        if set(a.factors) != ref:
            only_ref, only_a = sorted(ref - set(a.factors))[:4], sorted(set(a.factors) - ref)[:4]
            raise ValueError(
                f"adapters {loaded[0].name!r} and {a.name!r} adapt different modules "
                f"(only in the first: {only_ref}; only in the second: {only_a}); all adapters must share targets"
            )
    if backbone_spec is None and getattr(backbone.config, "_name_or_path", ""):
        backbone_spec = {"name_or_path": backbone.config._name_or_path}
    model = LoRAMoEModel(backbone, loaded, config, backbone_spec)
    for a in loaded:
        a.factors.clear()  # the bank holds them now

    log.info(
        "LoRA-MoE: %d adapters %s over %d blocks, %d adapted projections, %d gate slots\n%s",
        len(loaded), names, len(model.blocks), len(ref), len(model.slot_names), format_counts(model.parameter_counts()),
    )  # fmt: skip
    return model
