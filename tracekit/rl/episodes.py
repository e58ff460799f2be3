"""A minimal lockstep multi-turn episode runner that records the policy's exact tokens per turn.

All episodes of a rollout batch advance together: each step sends one batched ``chat`` call with
the requests of every episode still running, so the model's batch stays full. Each turn's prompt
ids, completion ids and log-probs go to ``Trajectory.info['turns']`` (the shape
``tracekit.rollout`` uses when asked for tokens), from which ``tracekit.rl.tokens`` builds the
training rows.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from tracekit.envs.base import EnvSuite
from tracekit.llm.base import ChatClient, ChatRequest
from tracekit.types import Message, Task, Trajectory, stable_hash

log = logging.getLogger(__name__)


@dataclass
class EpisodeSpec:
    """One rollout to run: a task, the environment seed (shared by a GRPO group) and a sample index."""

    task: Task
    seed: int
    sample: int
    group: int  # GRPO group id within the iteration


def run_episodes(
    client: ChatClient,
    suite: EnvSuite,
    specs: list[EpisodeSpec],
    *,
    temperature: float,
    top_p: float = 1.0,
    max_new_tokens: int = 512,
    max_steps: int = 50,
    sample_seed: int = 0,
) -> list[Trajectory]:
    """Run every spec to its end (env done, ``max_steps`` assistant turns, or context exhausted).

    ``sample_seed`` and the spec identify each request's sampling seed, so a rerun with the same
    arguments reproduces the same rollouts on CPU. Environments are reset and stepped through
    ``suite.reset_batch`` / ``step_batch`` (which batch simulated-user calls); an exception raised
    by an environment ends only that episode (``termination='env_error'``, reward 0, ``error`` set).
    """
    n = len(specs)
    eps = [suite.episode(sp.task, seed=sp.seed) for sp in specs]
    msgs: list[list[Message]] = [[] for _ in range(n)]
    tools: list[list[dict]] = [[] for _ in range(n)]
    turns: list[list[dict]] = [[] for _ in range(n)]
    term = [""] * n
    errors: list[str | None] = [None] * n

    def fail(i: int, where: str, e: Exception) -> None:
        log.warning("episode %s/%s raised in %s: %s", specs[i].task.id, specs[i].sample, where, e)
        term[i], errors[i] = "env_error", f"{type(e).__name__}: {e}"

    active = []
    for i, obs in enumerate(suite.reset_batch(eps)):  # batched: a simulated user may open the dialogue
        if isinstance(obs, Exception):
            fail(i, "reset", obs)
        else:
            msgs[i], tools[i] = list(obs.messages), obs.tools
            active.append(i)
    step = 0
    while active:
        reqs = [
            ChatRequest(
                messages=msgs[i],
                tools=tools[i] or None,
                temperature=temperature,
                top_p=top_p,
                max_new_tokens=max_new_tokens,
                seed=int(stable_hash([sample_seed, specs[i].group, specs[i].sample, step], 15), 16),
                return_tokens=True,
            )
            for i in active
        ]
        stepping = []
        for i, resp in zip(active, client.chat(reqs)):
            if resp.finish_reason == "error":
                term[i] = "context_limit"
                continue
            if resp.prompt_token_ids is None or resp.completion_token_ids is None or resp.completion_logprobs is None:
                raise RuntimeError(f"{type(client).__name__} returned no token ids/log-probs although return_tokens was set")
            turns[i].append(
                {
                    "prompt_ids": resp.prompt_token_ids,
                    "completion_ids": resp.completion_token_ids,
                    "completion_logprobs": resp.completion_logprobs,
                    "finish_reason": resp.finish_reason,
                }
            )
            msgs[i].append(resp.message)
            stepping.append(i)
        results = suite.step_batch([eps[i] for i in stepping], [msgs[i][-1] for i in stepping]) if stepping else []
        active = []
        for i, res in zip(stepping, results):
            if isinstance(res, Exception):  # a buggy environment must not take the whole batch down
                fail(i, "step", res)
                continue
            msgs[i].extend(res.messages)
            if res.done:
                term[i] = res.termination or "done"
            elif len(turns[i]) >= max_steps:
                term[i] = "max_steps"
            else:
                active.append(i)
        step += 1
    out = []
    for i, sp in enumerate(specs):
        reward, success, oinfo = 0.0, False, {}
        if errors[i] is None:
            try:
                o = eps[i].outcome()
                reward, success, oinfo = float(o.reward), bool(o.success), dict(o.info)
            except Exception as e:  # a failing verifier scores 0 and is recorded, like a failing step
                fail(i, "outcome", e)
        out.append(
            Trajectory(
                task_id=sp.task.id,
                env=suite.name,
                seed=sp.seed,
                sample=sp.sample,
                messages=msgs[i],
                reward=reward,
                success=success,
                termination=term[i],
                error=errors[i],
                info={"turns": turns[i], "group": sp.group, "outcome": oinfo},
            )
        )
    return out


def tool_calls(messages: list[Message]) -> int:
    """Tool calls the agent made in an episode."""
    return sum(len(m.tool_calls) for m in messages if m.role == "assistant")
