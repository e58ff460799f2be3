"""The scale-out rollout path: an OpenAI-compatible inference server with runtime LoRA loading (vLLM's API).

The trainer keeps the model; a server (``vllm serve --enable-lora``, or anything that speaks the same
subset) samples the rollouts. Per iteration only the adapter travels: it is saved with peft's
``save_pretrained`` and loaded at runtime under a fresh name (``POST /v1/load_lora_adapter``); the
previous one is unloaded and its files removed. The backbone is never merged or pushed as full weights.

Completions are requested with the prompt as *token ids* rendered here (``"prompt": [ids]``, so the
server cannot re-tokenize differently), ``logprobs: 1``, ``return_tokens_as_token_ids`` and
``return_token_ids``. Training therefore sees exactly the rollout's tokens and the log-probs the server
sampled them with. A server that echoes ``prompt_token_ids`` is checked against the ids sent. Mismatched
sampler numerics (the server's kernels against the trainer's) are what ``grpo.old_logprobs=recompute``
with ``grpo.tis_cap`` (truncated importance sampling) corrects.

The server must be the vLLM release this client was written and checked against (``SUPPORTED_VLLM``, read from
``GET /version`` before any rollout; ``vllm_version`` names another at the user's risk), and it must serve LoRA
adapters at runtime (``--enable-lora`` and ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``): either missing is one
line, not a failed rollout. Refused too, in one line before any rollout (vllm#42125, trl#7017): a data-parallel
server (``--data-parallel-size`` > 1 in the command, or ``GET /metrics`` naming more than one engine: a runtime
adapter load reaches one replica only, so the others would roll out the stale policy), and float32 with LoRA
(vLLM 0.26's Triton LoRA kernels take float16 / bfloat16 only: the server would die while profiling).
``max_lora_rank`` defaults to the adapters' rank (``grpo.lora.rank``) rounded up to a rank vLLM accepts: the
server sizes its LoRA buffers by it, so 64 for an r 8 adapter wastes memory and LoRA kernel time.

Server lifecycle (:class:`VLLMServer`):

- launched by the engine (``command``: an argv template, ``vllm serve`` by default), or an already
  running one (``base_url``);
- ``stop_during_update``: the engine's ``release()`` (called between an iteration's rollouts and its
  update under ``grpo.release_rollout_memory``) stops the server, so the update has the GPU to itself, and
  the next ``sync`` starts it again and loads the new adapter: a server restart between iterations;
  ``restart_every`` restarts it every n iterations whatever else happens;
- ending: a launched server runs in its own process group (its engine core and workers with it), and every
  exit path ends that whole group: ``close()``, a refusal after the start (another version, data-parallel), a
  failed start, the interpreter's exit (``atexit``, which also runs after Ctrl-C / SIGINT). A kill no handler
  sees (SIGKILL at a call's limit) is covered by ``TRACEKIT_SERVER_PIDS``: where set, each launched server writes
  its process group id there (one file, removed when it is stopped), for the caller's shell to end
  (``benchmarks/gpu_run.sh``);
- recovery: a request that finds the server gone (connection refused) restarts a managed server (or waits
  for an external one to come back), and one that finds the adapter unknown (404 after a restart nobody
  told the engine about) loads the current adapter again; then the request is retried, up to
  ``max_retries`` times.
"""

from __future__ import annotations

import atexit
import logging
import os
import re
import shutil
import signal
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from tracekit.llm.base import EndpointError
from tracekit.llm.decoding import Completion
from tracekit.llm.hf import stop_token_ids
from tracekit.ports import free_port
from tracekit.rl.engines import PolicyChat

log = logging.getLogger(__name__)

# The vLLM release the client's request fields and answers were checked against (issue 41: the real server on an
# H200). The completions fields it relies on (return_tokens_as_token_ids, return_token_ids, prompt token ids) and the
# runtime LoRA routes changed shape across releases, so another version is refused unless named in vllm_version.
SUPPORTED_VLLM = "0.26.0"
# The ranks `vllm serve --max-lora-rank` accepts (vLLM 0.26 LoRAConfig); an adapter of rank r is served under the
# smallest one >= r.
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
# dtypes vLLM 0.26's LoRA kernels run in (vllm/lora/ops/triton_ops/lora_expand_op.py asserts fp16 / bf16)
LORA_DTYPES = ("bfloat16", "float16", "half", "auto")

VLLM_COMMAND = (
    "vllm", "serve", "{model}", "--host", "{host}", "--port", "{port}", "--enable-lora", "--max-lora-rank", "{max_lora_rank}",
    "--max-loras", "2", "--dtype", "{dtype}", "--gpu-memory-utilization", "{gpu_memory_utilization}", "--max-model-len", "{max_model_len}",
)  # fmt: skip


@dataclass
class VLLMSettings:
    model_path: str  # the backbone as a local HF folder (the server loads it itself)
    host: str = "127.0.0.1"
    port: int | None = None  # None: a free port (a fresh one at every restart)
    max_lora_rank: int | None = None  # None: the adapters' rank rounded up to a VLLM_LORA_RANKS entry (see served_rank)
    gpu_memory_utilization: float = 0.5  # the trainer shares the GPU
    dtype: str = "bfloat16"
    max_model_len: int = 32768
    startup_timeout_s: float = 900.0
    request_timeout_s: float = 600.0
    concurrency: int = 64
    extra_args: tuple[str, ...] = ()
    base_url: str | None = None  # an already running server (then nothing is launched)
    # argv template of the server ({model} {host} {port} {max_lora_rank} {dtype} {gpu_memory_utilization}
    # {max_model_len}); empty: ``vllm serve`` (VLLM_COMMAND) plus extra_args
    command: tuple[str, ...] = ()
    stop_during_update: bool = False  # release() stops a managed server; the next sync starts it again
    restart_every: int = 0  # > 0: restart a managed server every n iterations (at sync)
    max_retries: int = 2  # per request: after a restart / re-load of the adapter
    verify_prompt_ids: bool = True  # compare a server's echoed prompt_token_ids with the ids sent
    env: dict[str, str] = field(default_factory=dict)  # extra environment of a launched server
    vllm_version: str = SUPPORTED_VLLM  # the server's GET /version must equal it


def vllm_settings(options: dict[str, Any]) -> VLLMSettings:
    """``grpo.vllm`` as :class:`VLLMSettings`; ValueError (one line) naming an unknown key or a missing
    ``model_path``."""
    known = [f.name for f in fields(VLLMSettings)]
    for k in options:
        if k not in known:
            raise ValueError(f"unknown key grpo.vllm.{k} (valid: {', '.join(known)})")
    if not options.get("model_path"):
        raise ValueError("grpo.vllm.model_path is not set: it must be the backbone as a local HF folder with "
                         "grpo.engine=vllm (the server loads it itself)")
    return VLLMSettings(**options)


def served_rank(lora_rank: int) -> int:
    """The ``--max-lora-rank`` that serves adapters of ``lora_rank``: the smallest rank vLLM accepts that holds it."""
    for r in VLLM_LORA_RANKS:
        if r >= lora_rank:
            return r
    raise ValueError(f"grpo.lora.rank={lora_rank} is invalid with grpo.engine=vllm: vLLM serves LoRA ranks up to "
                     f"{VLLM_LORA_RANKS[-1]}")


def data_parallel_size(argv: Sequence[str]) -> int:
    """The ``--data-parallel-size`` / ``-dp`` a server command line asks for (1 where it names none)."""
    size = 1
    for i, a in enumerate(argv):
        key, eq, val = str(a).partition("=")
        if key in ("--data-parallel-size", "-dp", "--data_parallel_size"):
            val = val if eq else (str(argv[i + 1]) if i + 1 < len(argv) else "")
            size = int(val) if val.isdigit() else size
    return size


def check_settings(s: VLLMSettings) -> None:
    """What the server settings alone must satisfy before any server is started (ValueError, one line)."""
    if s.dtype not in LORA_DTYPES:
        raise ValueError(f"grpo.vllm.dtype={s.dtype} is invalid: vLLM {SUPPORTED_VLLM} serves LoRA adapters in "
                         f"{' / '.join(LORA_DTYPES[:2])} only (its Triton LoRA kernels; the server would exit while profiling)")
    if s.max_lora_rank is not None and s.max_lora_rank not in VLLM_LORA_RANKS:
        raise ValueError(f"grpo.vllm.max_lora_rank={s.max_lora_rank} is invalid: vLLM accepts {', '.join(map(str, VLLM_LORA_RANKS))}")
    dp = data_parallel_size([*s.command, *s.extra_args])
    if dp > 1:
        raise ValueError(f"grpo.vllm data-parallel size {dp} is invalid: a runtime LoRA load reaches one data-parallel "
                         "replica only (vllm#42125), so the others would roll out a stale policy; serve one replica "
                         "(tensor parallel is fine) or one server per GPU")


def check_recipe(s: VLLMSettings, lora_rank: int, temperature: float, old_logprobs: str) -> None:
    """The rules a vLLM rollout engine puts on the GRPO recipe (ValueError, one line): the settings' own
    (:func:`check_settings`), the server must take the adapter's rank, and a tempered sampler's log-probs must be
    recomputed (vLLM reports those of the untempered logits by default, so the importance ratio would be biased)."""
    check_settings(s)
    if s.max_lora_rank is not None and s.max_lora_rank < lora_rank:
        raise ValueError(f"grpo.vllm.max_lora_rank={s.max_lora_rank} is invalid: must be >= grpo.lora.rank={lora_rank}"
                         " (the server refuses a larger adapter)")
    served_rank(lora_rank)
    if temperature != 1.0 and old_logprobs == "rollout":
        raise ValueError(f"grpo.old_logprobs='rollout' is invalid: must be recompute with grpo.engine=vllm and "
                         f"grpo.temperature={temperature} != 1 (vLLM reports the untempered log-probs)")


_LIVE: set[VLLMServer] = set()  # launched servers not stopped yet: ended at the interpreter's exit


@atexit.register
def _stop_live_servers() -> None:
    for server in list(_LIVE):
        server.stop()


class VLLMServer:
    """A managed server process (or an external one at ``base_url``): start, health, stop, restart."""

    def __init__(self, s: VLLMSettings, work_dir: Path):
        self.s = s
        self.work_dir = Path(work_dir)
        self.proc: subprocess.Popen | None = None
        self.managed = not s.base_url
        self.url: str | None = s.base_url.rstrip("/") if s.base_url else None
        self.starts = 0

    def argv(self, port: int) -> list[str]:
        values = dict(
            model=self.s.model_path, host=self.s.host, port=port, max_lora_rank=self.s.max_lora_rank, dtype=self.s.dtype,
            gpu_memory_utilization=self.s.gpu_memory_utilization, max_model_len=self.s.max_model_len,
        )  # fmt: skip
        template = list(self.s.command) if self.s.command else [*VLLM_COMMAND, *self.s.extra_args]
        if self.s.max_lora_rank is None and any("{max_lora_rank}" in str(a) for a in template):
            raise ValueError("grpo.vllm.max_lora_rank is unset: give it, or the adapters' rank (VLLMEngine lora_rank=)")
        return [str(a).format(**values) for a in template]

    @property
    def running(self) -> bool:
        return not self.managed or (self.proc is not None and self.proc.poll() is None)

    def start(self) -> str:
        if not self.managed:  # an external server is taken as it is; requests find out if it is not there
            return self.url
        if self.running:
            return self.url
        port = self.s.port or free_port()
        argv = self.argv(port)
        if shutil.which(argv[0]) is None and not Path(argv[0]).is_file():
            raise EndpointError(f"grpo.engine=vllm needs the `{argv[0]}` command (pip install the gpu extra); not found on PATH")
        self.work_dir.mkdir(parents=True, exist_ok=True)
        logf = open(self.work_dir / "vllm_server.log", "ab")  # noqa: SIM115 - the child keeps it open
        env = dict(os.environ, VLLM_ALLOW_RUNTIME_LORA_UPDATING="True", **self.s.env)
        log.info("starting %s", " ".join(argv))
        # its own process group: stop() ends the server with its engine core and workers
        self.proc = subprocess.Popen(argv, stdout=logf, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        logf.close()
        _LIVE.add(self)
        self._write_pid_file()
        self.url = f"http://{self.s.host}:{port}"
        self.starts += 1
        try:
            self.wait_healthy()
            self.check_version()
        except BaseException:  # refused or not healthy: a server tracekit started does not outlive the refusal
            self.stop()
            raise
        return self.url

    def _pid_file(self) -> Path | None:
        where = os.environ.get("TRACEKIT_SERVER_PIDS")
        return Path(where) / f"vllm-{os.getpid()}-{id(self):x}.pgid" if where and self.proc is not None else None

    def _write_pid_file(self) -> None:
        if (f := self._pid_file()) is not None:
            f.parent.mkdir(parents=True, exist_ok=True)
            f.write_text(f"{self.proc.pid}\n")

    def check_data_parallel(self) -> None:
        """Refuse (one line) a server whose ``GET /metrics`` names more than one engine: a data-parallel server, where
        a runtime adapter load reaches one replica only (vllm#42125). A server without /metrics is taken as one."""
        import httpx

        try:
            r = httpx.get(f"{self.url}/metrics", timeout=30)
        except httpx.HTTPError:
            return
        engines = set(re.findall(r'engine="([^"]+)"', r.text)) if r.status_code == 200 else set()
        if len(engines) > 1:
            raise EndpointError(f"inference server at {self.url} is data-parallel ({len(engines)} engines in GET /metrics): "
                                "a runtime LoRA load reaches one replica only (vllm#42125); serve one replica")

    def check_version(self) -> str:
        """The server's vLLM version (``GET /version``), refused in one line unless it is ``vllm_version``."""
        import httpx

        try:
            r = httpx.get(f"{self.url}/version", timeout=30)
        except httpx.HTTPError as e:
            raise EndpointError(f"inference server at {self.url} did not answer GET /version: {type(e).__name__}: {e}") from e
        got = r.json().get("version") if r.status_code == 200 else None
        if got is None:
            raise EndpointError(f"inference server at {self.url} reports no version (GET /version: {r.status_code}): "
                                f"tracekit's vLLM client supports vLLM {self.s.vllm_version}")
        if got != self.s.vllm_version:
            raise EndpointError(f"inference server at {self.url} is vLLM {got}; tracekit's vLLM client supports vLLM "
                                f"{self.s.vllm_version} (grpo.vllm.vllm_version names another at your risk)")
        return got

    def wait_healthy(self) -> None:
        """Until ``GET /health`` answers 200 (a managed server: vLLM opens its port once the model is
        loaded) or answers at all (an external one, which may not implement /health)."""
        import httpx

        t0 = time.time()
        while time.time() - t0 < self.s.startup_timeout_s:
            if self.managed and self.proc is not None and self.proc.poll() is not None:
                code = self.proc.returncode
                self.proc = None
                raise EndpointError(f"inference server exited with code {code}; see {self.work_dir / 'vllm_server.log'}")
            try:
                code = httpx.get(f"{self.url}/health", timeout=5).status_code
                if code == 200 or not self.managed:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2 if time.time() - t0 < 10 else 2)
        self.stop()
        raise EndpointError(f"inference server not healthy after {self.s.startup_timeout_s:.0f}s at {self.url}")

    def stop(self) -> None:
        """End the server's whole process group (SIGTERM, SIGKILL after 30 s): vLLM's engine core and workers are
        its children, and one left behind holds the GPU's memory."""
        if self.proc is not None:
            pgid = self.proc.pid  # the group leader (start_new_session)
            for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
                try:
                    os.killpg(pgid, sig)
                except ProcessLookupError:
                    break
                try:
                    self.proc.wait(timeout=wait)
                except subprocess.TimeoutExpired:
                    continue
                if not _group_alive(pgid, wait):
                    break
            if (f := self._pid_file()) is not None:
                f.unlink(missing_ok=True)
        _LIVE.discard(self)
        self.proc = None

    def restart(self) -> str:
        self.stop()
        return self.start()


def _group_alive(pgid: int, wait_s: float) -> bool:
    """Whether processes of group ``pgid`` remain after waiting up to ``wait_s`` for them to exit."""
    t0 = time.time()
    while True:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return False
        if time.time() - t0 > wait_s:
            return True
        time.sleep(0.1)


class _AdapterGone(Exception):
    """The server answered 404 for the adapter's name: it was restarted without it."""


class VLLMEngine:
    """Rollouts from an OpenAI-compatible server with runtime LoRA loading (adapter-only sync each iteration)."""

    kind = "vllm"

    def __init__(
        self, settings: VLLMSettings, tokenizer: Any, work_dir: str | Path, *, chat_format: str = "qwen3",
        max_prompt_tokens: int = 32000, lora_rank: int | None = None,
    ):
        """``lora_rank``: the adapters' rank, the server's ``--max-lora-rank`` where the settings leave it unset.
        Every refusal (settings, version, data-parallel) comes before any rollout and stops a server it started."""
        import dataclasses

        import httpx

        try:
            check_settings(settings)
        except ValueError as e:
            raise EndpointError(str(e)) from None
        if settings.max_lora_rank is None and lora_rank is not None:
            settings = dataclasses.replace(settings, max_lora_rank=served_rank(lora_rank))
        self.s = settings
        self.work_dir = Path(work_dir)
        self.server = VLLMServer(settings, self.work_dir)
        self.lora_name: str | None = None
        self._lora_path: Path | None = None
        self.restarts = 0  # restarts the engine made (between iterations or to recover)
        self.reloads = 0  # adapter re-loads after a server forgot it
        self._lock = threading.Lock()  # one recovery at a time (requests run in a thread pool)
        self._recoveries = 0
        self.base_url = self.server.start()
        self.http = httpx.Client(timeout=settings.request_timeout_s)
        try:
            if not self.server.managed:  # a managed server was checked as it started
                self.server.check_version()
            self.server.check_data_parallel()
            self.base_model = self._served_base()
        except BaseException:
            self.close()
            raise
        self.serve_base = False  # True: requests go to the base model until the first sync (see use_base)
        self.client = PolicyChat(
            tokenizer,
            self._generate,
            stop_token_ids(None, tokenizer),
            chat_format=chat_format,
            max_prompt_tokens=max_prompt_tokens,
            batch_size=settings.concurrency,
        )

    @property
    def proc(self) -> subprocess.Popen | None:
        return self.server.proc

    # ---- the adapter -----------------------------------------------------------------------
    def _post(self, path: str, body: dict) -> Any:
        return self.http.post(f"{self.server.url}{path}", json=body)

    def _served_base(self) -> str:
        """The served base model's name: the first of ``GET /v1/models`` that is no adapter (vLLM lists the base
        first, with adapters after it naming it as their parent)."""
        r = self.http.get(f"{self.server.url}/v1/models")
        if r.status_code != 200:
            raise EndpointError(f"inference server at {self.server.url}: GET /v1/models answered {r.status_code}: {r.text[:200]}")
        models = [m for m in r.json().get("data", []) if not m.get("parent")]
        if not models:
            raise EndpointError(f"inference server at {self.server.url} serves no base model (GET /v1/models)")
        return str(models[0]["id"])

    def use_base(self) -> None:
        """Roll out with the served base model, no adapter, until the next :meth:`sync` (e.g. to measure or check
        the base policy through the server)."""
        self.serve_base = True

    def _load(self, name: str, path: Path) -> None:
        r = self._post("/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(path.resolve())})
        if r.status_code == 200:
            return
        no_route = r.status_code == 404 and "lora" not in r.text.lower()
        if no_route or "LoRA is not enabled" in r.text:
            what = ("has no runtime LoRA loading (POST /v1/load_lora_adapter: 404; set VLLM_ALLOW_RUNTIME_LORA_UPDATING=True)"
                    if no_route else "was started without LoRA support (start it with --enable-lora)")
            raise EndpointError(f"inference server at {self.server.url} {what}: cannot load adapter {name}")
        raise EndpointError(f"load_lora_adapter {name} failed ({r.status_code}): {r.text[:300]}")

    def sync(self, iteration: int, save_adapter: Callable[[Path], None]) -> None:
        """Save the current adapter and load it under a fresh name (starting or restarting the server
        first where the settings ask); unload the old one and remove its files."""
        if self.server.managed:
            due = bool(self.s.restart_every) and iteration > 0 and iteration % self.s.restart_every == 0
            if due or not self.server.running:
                self._restart("restart_every" if due else "stopped since the last iteration")
        path = self.work_dir / "adapters" / f"iter_{iteration:05d}"
        if path.exists() and path != self._lora_path:  # left by a run cut in this work folder: not ours to keep
            shutil.rmtree(path)
        save_adapter(path)
        name = f"policy-it{iteration}-{uuid.uuid4().hex[:6]}"
        self._load(name, path)
        if self.lora_name is not None:
            try:
                self._post("/v1/unload_lora_adapter", {"lora_name": self.lora_name})
            except Exception as e:  # noqa: BLE001 - a server restarted since then no longer has it
                log.debug("unload %s: %s", self.lora_name, e)
            if self._lora_path is not None and self._lora_path != path:
                shutil.rmtree(self._lora_path, ignore_errors=True)
        self.lora_name, self._lora_path = name, path
        self.serve_base = False

    def _restart(self, why: str) -> None:
        log.info("restarting the inference server (%s)", why)
        self.server.restart()
        self.restarts += 1

    def _recover(self, err: Exception, seen: int | None = None) -> None:
        """After a failed request: bring the server back (restart a managed one that died, else wait for
        it) and load the current adapter again if the server lost it. ``seen``: the recovery count the
        failed request started under; if another thread has recovered since, nothing more is done."""
        with self._lock:
            if seen is not None and seen != self._recoveries:
                return
            self._recover_locked(err)
            self._recoveries += 1

    def _recover_locked(self, err: Exception) -> None:
        if isinstance(err, _AdapterGone):
            pass
        elif self.server.managed and not self.server.running:
            self._restart(f"server gone: {type(err).__name__}")
        else:
            self.server.wait_healthy()
        if self.lora_name is not None and self._lora_path is not None:
            try:
                self._load(self.lora_name, self._lora_path)
                self.reloads += 1
            except EndpointError as e:  # "already loaded": the adapter survived, the error was elsewhere
                log.debug("re-load of %s: %s", self.lora_name, e)

    # ---- sampling --------------------------------------------------------------------------
    def release(self) -> None:
        """Between rollouts and the update: stop a managed server when ``stop_during_update`` (the update
        gets its GPU memory); the next :meth:`sync` starts it again with the new adapter."""
        if self.s.stop_during_update and self.server.managed:
            self.server.stop()

    def _complete(self, prompt: list[int], max_new: int, temperature: float, top_p: float, seed: int) -> Completion:
        import httpx

        body = {
            "model": self.base_model if self.serve_base else self.lora_name, "prompt": prompt, "max_tokens": max_new, "temperature": temperature, "top_p": top_p,
            "seed": seed % (2**31), "logprobs": 1, "return_tokens_as_token_ids": True, "return_token_ids": True,
            "skip_special_tokens": False, "stop_token_ids": self.client.stop_ids, "include_stop_str_in_output": True,
        }  # fmt: skip
        for attempt in range(self.s.max_retries + 1):
            seen = self._recoveries
            try:
                r = self._post("/v1/completions", body)
                if r.status_code == 404:
                    raise _AdapterGone(r.text[:200])
                if r.status_code != 200:
                    raise EndpointError(f"completion failed ({r.status_code}): {r.text[:300]}")
                choice = r.json()["choices"][0]
                echoed = choice.get("prompt_token_ids")
                if self.s.verify_prompt_ids and echoed is not None and list(echoed) != list(prompt):
                    raise EndpointError("the server's prompt_token_ids differ from the ids sent: the rollout would not be the trained tokens")
                return parse_vllm_choice(choice, self.client.stop_ids)
            except (_AdapterGone, httpx.TransportError) as e:
                if attempt == self.s.max_retries:
                    raise EndpointError(f"completion failed after {attempt + 1} tries: {type(e).__name__}: {e}") from e
                self._recover(e, seen)
        raise AssertionError("unreachable")

    def _generate(self, prompts: list[list[int]], temperature: float, top_p: float, max_new: int, seed: int) -> list[Completion]:
        if self.lora_name is None and not self.serve_base:
            raise EndpointError("vllm engine used before sync(): no adapter loaded (use_base() rolls out the base model)")
        from concurrent.futures import ThreadPoolExecutor

        if not self.server.running:  # stopped for the update and not synced since: bring it back with the adapter
            self._recover(EndpointError("server stopped"))
        with ThreadPoolExecutor(max_workers=max(1, min(self.s.concurrency, len(prompts)))) as ex:
            return list(ex.map(lambda i: self._complete(prompts[i], max_new, temperature, top_p, seed + i), range(len(prompts))))

    def close(self) -> None:
        self.server.stop()
        self.http.close()


def parse_vllm_choice(choice: dict[str, Any], stop_ids: Sequence[int]) -> Completion:
    """A ``/v1/completions`` choice -> ids and log-probs.

    Ids from ``token_ids`` (vLLM's ``return_token_ids``) where present, else from the log-prob tokens,
    which ``return_tokens_as_token_ids`` formats as ``"token_id:<id>"``; both, when given, must agree.
    A completion counts as stopped iff its last id is a stop id (the sampled end-of-turn token is trained
    on like any other generated token).
    """
    lp = choice.get("logprobs") or {}
    toks, lps = lp.get("tokens"), lp.get("token_logprobs")
    if toks is None or lps is None:
        raise EndpointError("vllm response has no token log-probs (was logprobs requested?)")
    ids = []
    for t in toks:
        if not isinstance(t, str) or not t.startswith("token_id:"):
            raise EndpointError(f"vllm token {t!r} is not 'token_id:<id>' (is return_tokens_as_token_ids supported?)")
        ids.append(int(t.split(":", 1)[1]))
    direct = choice.get("token_ids")
    if direct is not None and list(direct) != ids:
        raise EndpointError(f"vllm token_ids {list(direct)[:8]}... disagree with its log-prob tokens {ids[:8]}...")
    if len(ids) != len(lps):
        raise EndpointError(f"vllm returned {len(ids)} tokens but {len(lps)} log-probs")
    if any(x is None for x in lps):
        raise EndpointError("vllm returned a null log-prob for a generated token")
    finish = "stop" if ids and ids[-1] in set(stop_ids) else "length"
    return Completion(ids=ids, logprobs=[float(x) for x in lps], finish_reason=finish)
