"""A tiny offline policy and a tiny environment for GRPO smoke runs, tests and the CPU benchmark.

- :func:`tiny_tokenizer`: a byte-level BPE trained in memory (deterministic, ~1 s) with ChatML
  special tokens and a Hermes-style tool-call chat template (``<tool_call>{json}</tool_call>``),
  the format Qwen3 uses.
- :func:`tiny_model`: a random-init ``Qwen3ForCausalLM`` (``conf/backbone/tiny.yaml``'s shape).
- :class:`KeywordSuite`: a multi-turn tool-use environment: the user asks the agent to ``ping`` a
  host; each assistant turn scores 1.0 for a parsed ``ping`` tool call with the right host, 0.5
  for a reply that mentions the tool name ``ping`` without a valid call, else 0; the episode reward
  is the mean over its turns; success iff every turn scored 1.0. The shaped 0.5 exists so a
  random-init model has a non-zero chance of reward (a well-formed call is out of its reach).
"""

from __future__ import annotations

import random
from typing import Any

from tracekit.envs.base import EnvSuite, Episode, Observation, Outcome, StepResult
from tracekit.types import Message, Task

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>"]

# ChatML with tools in the system message and tool calls rendered as Hermes JSON. It is
# prefix-preserving for replies in canonical form: rendering a conversation then appending a reply
# yields the rendering of the longer conversation.
CHAT_TEMPLATE = (
    "{%- if messages[0].role == 'system' %}{%- set sys = messages[0].content %}{%- set rest = messages[1:] %}"
    "{%- else %}{%- set sys = '' %}{%- set rest = messages %}{%- endif %}"
    "{%- if sys or tools %}{{- '<|im_start|>system\\n' + sys }}"
    "{%- if tools %}{{- '\\n\\n# Tools\\n<tools>' }}{%- for t in tools %}{{- '\\n' + (t | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>' }}{%- endif %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- for m in rest %}"
    "{%- if m.role == 'assistant' %}{{- '<|im_start|>assistant\\n' + (m.content or '') }}"
    "{%- for c in (m.tool_calls or []) %}{%- if c.function %}{%- set c = c.function %}{%- endif %}"
    "{%- if (loop.first and m.content) or not loop.first %}{{- '\\n' }}{%- endif %}"
    "{{- '<tool_call>\\n{\"name\": \"' + c.name + '\", \"arguments\": ' + (c.arguments | tojson) + '}\\n</tool_call>' }}"
    "{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif m.role == 'tool' %}{{- '<|im_start|>user\\n<tool_response>\\n' + m.content + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

HOSTS = ["alpha", "bravo", "delta", "gamma", "kilo", "lima", "echo", "tango"]
PING_TOOL = {
    "type": "function",
    "function": {
        "name": "ping",
        "description": "Check that a host is reachable.",
        "parameters": {
            "type": "object",
            "properties": {"host": {"type": "string", "description": "host name"}},
            "required": ["host"],
        },
    },
}
SYSTEM_PROMPT = "You are an operations assistant. Use the tools to act on the user's request."


def _corpus(seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    words = "the a to is on host please check ping call tool reply ok done again now network status user".split()
    lines = []
    for _ in range(400):
        h = rng.choice(HOSTS)
        lines.append(f'<tool_call>\n{{"name": "ping", "arguments": {{"host": "{h}"}}}}\n</tool_call>')
        lines.append(" ".join(rng.choice(words) for _ in range(12)) + f" {h}.")
        lines.append(f"Please ping {h}. " + SYSTEM_PROMPT)
    return lines


def tiny_tokenizer(vocab_size: int = 384):
    """A deterministic byte-level BPE (``vocab_size`` incl. specials) as a PreTrainedTokenizerFast."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
    )


def tiny_model(vocab_size: int, seed: int = 0, **arch: Any):
    """A random-init Qwen3ForCausalLM (float32) of ``conf/backbone/tiny.yaml``'s shape, seeded.

    ``initializer_range`` defaults to 0.1 (transformers: 0.02): with tied 64-d embeddings drawn at
    0.02 the largest logit gap any hidden state can reach is ~1.3 nats, so no adapter could make
    one token likely; at 0.1 it is ~6 nats and RL can move the policy.
    """
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    shape = dict(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
        tie_word_embeddings=True,
        max_position_embeddings=4096,
        initializer_range=0.1,
    )
    shape.update(arch)
    cfg = Qwen3Config(vocab_size=vocab_size, **shape)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(cfg)
    return model.eval()


def tiny_policy(seed: int = 0, vocab_size: int = 384):
    """(model, tokenizer) pair: the factory the launcher's worker uses for toy runs."""
    tok = tiny_tokenizer(vocab_size)
    return tiny_model(len(tok), seed=seed), tok


class _KeywordEpisode(Episode):
    def __init__(self, host: str, turns: int):
        self.host = host
        self.turns = turns
        self.scores: list[float] = []

    def reset(self) -> Observation:
        return Observation(
            messages=[Message(role="system", content=SYSTEM_PROMPT), Message(role="user", content=f"Please ping {self.host}.")],
            tools=[PING_TOOL],
        )

    def step(self, action: Message) -> StepResult:
        ok = [c for c in action.tool_calls if c.name == "ping" and c.arguments.get("host") == self.host]
        mentions = "ping" in (action.content or "") or any(c.name == "ping" for c in action.tool_calls)
        self.scores.append(1.0 if ok else 0.5 if mentions else 0.0)
        if action.tool_calls:
            out = [
                Message(
                    role="tool",
                    tool_call_id=c.id,
                    name=c.name,
                    content='{"status": "reachable"}' if c.name == "ping" else f"unknown tool {c.name}",
                    error=c.name != "ping",
                )
                for c in action.tool_calls
            ]
        else:
            out = []
        done = len(self.scores) >= self.turns
        if not done:
            out.append(Message(role="user", content=f"Please ping {self.host} again."))
        return StepResult(messages=out, done=done, termination="all_turns_done" if done else "")

    def outcome(self) -> Outcome:
        reward = sum(self.scores) / self.turns
        return Outcome(reward=reward, success=len(self.scores) == self.turns and all(s == 1.0 for s in self.scores))


class KeywordSuite(EnvSuite):
    """``n_tasks`` seeds, each a host to ping over ``turns`` assistant turns (see module docstring)."""

    def __init__(self, n_tasks: int = 16, turns: int = 2):
        self.name = "toy_keyword"
        self.n_tasks = n_tasks
        self.turns = turns

    def tasks(self) -> list[Task]:
        return [
            Task(id=f"ping-{i}", env=self.name, instruction=f"ping {HOSTS[i % len(HOSTS)]}", data={"host": HOSTS[i % len(HOSTS)]})
            for i in range(self.n_tasks)
        ]

    def episode(self, task: Task, seed: int = 0) -> Episode:
        return _KeywordEpisode(task.data["host"], self.turns)

    def interface(self) -> dict[str, Any]:
        return {"tools": [PING_TOOL], "policy": SYSTEM_PROMPT}


def keyword_suite(n_tasks: int = 16, turns: int = 2) -> KeywordSuite:
    """Factory for the launcher's worker (``tracekit.rl.toy:keyword_suite``)."""
    return KeywordSuite(n_tasks=n_tasks, turns=turns)
