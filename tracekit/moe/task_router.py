"""TRACE's task-level router (``consolidation=route``; the official repository's
``docs/inference_routing_subsection.tex``): per episode, retrieve similar training trajectories, let the base
model classify the task over the retrieved capabilities' descriptions plus "no adapter", keep the top-p weights,
and run the episode on ``W + sum_c alpha_c B_c A_c``.

The saved router (``router.json`` + ``router_embeddings.safetensors`` beside the LoRA-MoE files) holds the slot
descriptions, the settings (``top_p``, ``retrieve_k``) and the corpus: one entry per retrieved-able trajectory
(its capability, its task text, an example text) and its embedding. The decision for an episode's opening:

1. embed the task text (the opening's user messages; the system prompt where there is none) and take the
   ``retrieve_k`` corpus entries of highest cosine similarity; their capabilities, in rank order, are the candidates;
2. one prompt lists each candidate under a letter (A, B, ...) with its description and its best retrieved example,
   and one more letter for "no adapter"; the base model's next-token probabilities over those letters, renormalized
   over them, are pi(c | task);
3. "no adapter" most probable: weight 1 on the base slot. Otherwise the candidates' probabilities renormalized among
   themselves, sorted, the smallest prefix whose mass reaches ``top_p`` kept and renormalized: alpha.

Everything runs on the composed model pinned to the base slot, which is the backbone alone.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from tracekit.artifacts import atomic_write_json, read_json
from tracekit.moe.model import LoRAMoEModel
from tracekit.types import Message

ROUTER_FILE, EMBEDDINGS_FILE = "router.json", "router_embeddings.safetensors"
TASK_CHARS = 1200  # task text kept for the embedding and the classifier prompt
LABELS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"

Encode = Callable[[list[Any], Any], list[int]]


def task_text(messages: Sequence[Any]) -> str:
    """An episode opening's task: its user messages' text (the system prompt where there is none), cut."""
    users = [m.content or "" for m in messages if m.role == "user"]
    text = "\n".join(users) if any(users) else "\n".join(m.content or "" for m in messages if m.role == "system")
    return text[:TASK_CHARS]


def example_text(messages: Sequence[Any], chars: int) -> str:
    """A training trajectory as the classifier sees it: the task, then the agent's tool calls in order, cut."""
    calls = [f"{c.name}({', '.join(f'{k}={v!r}' for k, v in c.arguments.items())})"
             for m in messages if m.role == "assistant" for c in (m.tool_calls or [])]
    return f"Task: {task_text(messages)}\nActions: {'; '.join(calls) or '(none)'}"[:chars]


def label_ids(tokenizer: Any, n: int) -> list[int]:
    """The token id of each of the first ``n`` letters; one line naming the first letter that is not one token."""
    if n > len(LABELS):
        raise ValueError(f"the task router labels at most {len(LABELS)} options, got {n}")
    out = []
    for letter in LABELS[:n]:
        ids = tokenizer(letter, add_special_tokens=False)["input_ids"]
        if len(ids) != 1:
            raise ValueError(f"the task router needs each label to be one token: the tokenizer splits {letter!r} "
                             f"into {len(ids)}")
        out.append(int(ids[0]))
    if len(set(out)) != n:
        raise ValueError("the task router's labels must be distinct tokens")
    return out


def top_p_weights(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Nucleus filter of one distribution [C]: the smallest set of most probable entries whose mass reaches
    ``top_p`` (at least one), renormalized; 0 elsewhere."""
    p = probs / probs.sum()
    order = torch.argsort(p, descending=True)
    mass = torch.cumsum(p[order], 0)
    keep = int((mass < top_p - 1e-9).sum()) + 1
    out = torch.zeros_like(p)
    out[order[:keep]] = p[order[:keep]]
    return out / out.sum()


class TaskRouter:
    """One decision per episode opening (module docstring): slot weights over the base slot and the adapters."""

    def __init__(self, model: LoRAMoEModel, encode: Encode, tokenizer: Any, pad_id: int, spec: dict[str, Any],
                 embeddings: torch.Tensor):
        if not model.moe_config.include_base_slot or model.slot_names[0] != "base":
            raise ValueError("the task router needs the composed model's base slot (slot 0: no adapter)")
        self.model, self.encode, self.pad_id = model, encode, pad_id
        self.descriptions: dict[str, str] = spec["descriptions"]
        missing = [s for s in model.slot_names[1:] if not self.descriptions.get(s, "").strip()]
        if missing:
            raise ValueError(f"the task router needs a description of every capability: none for {', '.join(missing)}")
        self.top_p, self.retrieve_k = float(spec["top_p"]), int(spec["retrieve_k"])
        self.corpus: list[dict[str, str]] = spec["corpus"]
        self.embeddings = torch.nn.functional.normalize(embeddings.float(), dim=-1)
        self.labels = label_ids(tokenizer, len(model.slot_names))  # the adapters' letters and one for "no adapter"
        self.base = torch.zeros(len(model.slot_names))
        self.base[0] = 1.0

    def _forward(self, prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(last hidden states [B, L, d], attention mask [B, L], logits at each prompt's last token [B, V]) on the
        backbone alone (right-padded batch)."""
        L = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), L), self.pad_id, dtype=torch.long)
        attn = torch.zeros((len(prompts), L), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, : len(p)], attn[i, : len(p)] = torch.tensor(p), 1
        device = self.model.model.get_output_embeddings().weight.device
        with torch.no_grad(), self.model.pinned(self.base):
            out = self.model.model(input_ids=ids.to(device), attention_mask=attn.to(device), output_hidden_states=True)
        last = torch.tensor([len(p) - 1 for p in prompts])
        return out.hidden_states[-1].float().cpu(), attn, out.logits[torch.arange(len(prompts)), last].float().cpu()

    def embed(self, texts: Sequence[str]) -> torch.Tensor:
        """Unit-norm mean-pooled last hidden states [B, d] of each text as one user message (its first
        ``max_position_embeddings`` tokens)."""
        limit = getattr(self.model.config, "max_position_embeddings", None) or 10**9
        hidden, attn, _ = self._forward([self.encode([Message(role="user", content=t)], None)[:limit] for t in texts])
        m = attn.unsqueeze(-1).float()
        return torch.nn.functional.normalize((hidden * m).sum(1) / m.sum(1), dim=-1)

    def prompt(self, task: str, candidates: list[tuple[str, str]]) -> list[Message]:
        """The classifier's prompt: each candidate (slot name, example) under its letter, then "no adapter"."""
        options = [f"{LABELS[i]}. {name}: {self.descriptions[name]}\n   Example: {example}"
                   for i, (name, example) in enumerate(candidates)]
        options.append(f"{LABELS[len(candidates)]}. none of these: the task needs no special capability")
        system = ("Pick the capability the task below needs most. Options:\n" + "\n".join(options)
                  + "\nAnswer with the option's letter only.")
        return [Message(role="system", content=system), Message(role="user", content=task)]

    def fitted_prompt(self, task: str, candidates: list[tuple[str, str]]) -> list[int]:
        """The classifier prompt's ids within the backbone's context (``max_position_embeddings``): the examples, then
        the task, cut by half until it fits (a small world model's context is a few hundred tokens)."""
        limit = getattr(self.model.config, "max_position_embeddings", None) or 10**9
        ids = self.encode(self.prompt(task, candidates), None)
        while len(ids) > limit and any(example for _, example in candidates):
            candidates = [(name, example[: len(example) // 2]) for name, example in candidates]
            ids = self.encode(self.prompt(task, candidates), None)
        while len(ids) > limit and task:
            task = task[: len(task) // 2]
            ids = self.encode(self.prompt(task, candidates), None)
        if len(ids) > limit:
            raise ValueError(f"the task router's prompt needs {len(ids)} tokens with no example and no task: over the "
                             f"backbone's {limit}")
        return ids

    def decide(self, prompts: list[tuple[list[Any], Any]]) -> torch.Tensor:
        """Slot weights [B, S] (slot 0: the base) for each episode opening ``(messages, tools)``."""
        tasks = [task_text(m) for m, _ in prompts]
        sims = self.embed(tasks) @ self.embeddings.T  # [B, corpus]
        out = []
        slots = self.model.slot_names
        for b, task in enumerate(tasks):
            ranked = torch.argsort(sims[b], descending=True)[: self.retrieve_k].tolist()
            candidates: dict[str, str] = {}
            for j in ranked:  # each capability once, with its best-ranked example
                candidates.setdefault(self.corpus[j]["capability"], self.corpus[j]["example"])
            cands = list(candidates.items())
            _, _, logits = self._forward([self.fitted_prompt(task, cands)])
            pi = torch.softmax(logits[0, self.labels[: len(cands) + 1]], -1)
            w = torch.zeros(len(slots))
            if int(pi.argmax()) == len(cands):  # "no adapter" most probable: the base model, unmodified
                w[0] = 1.0
            else:
                alpha = top_p_weights(pi[: len(cands)], self.top_p)
                for (name, _), a in zip(cands, alpha.tolist()):
                    w[slots.index(name)] = a
            out.append(w)
        return torch.stack(out)


def save_task_router(directory: str | Path, descriptions: dict[str, str], top_p: float, retrieve_k: int,
                     corpus: list[dict[str, str]], embeddings: torch.Tensor) -> None:
    """Write the router's files into a saved LoRA-MoE directory."""
    directory = Path(directory)
    atomic_write_json(directory / ROUTER_FILE, {"descriptions": descriptions, "top_p": top_p, "retrieve_k": retrieve_k,
                                                "corpus": corpus})
    save_file({"embeddings": embeddings.float().contiguous()}, str(directory / EMBEDDINGS_FILE))


def load_task_router(directory: str | Path, model: LoRAMoEModel, encode: Encode, tokenizer: Any, pad_id: int
                     ) -> TaskRouter:
    directory = Path(directory)
    return TaskRouter(model, encode, tokenizer, pad_id, read_json(directory / ROUTER_FILE),
                      load_file(str(directory / EMBEDDINGS_FILE))["embeddings"])
