"""The training episode runner: lockstep over a chat client, recording the policy's exact tokens.

A driver of the episode core (:mod:`tracekit.episodes`, shared with evaluation): every episode of a
rollout batch is live from the start and each round sends one batched ``chat`` call with the
requests of every episode still running, so the model's batch stays full. Each turn's prompt ids,
completion ids and log-probs go to ``Trajectory.info['turns']``, from which ``tracekit.rl.tokens``
builds the training rows.
"""

from __future__ import annotations

from dataclasses import dataclass

from tracekit.envs.base import EnvSuite
from tracekit.episodes import INFRA_RETRIES, EpisodeRun, drive_episodes
from tracekit.llm.base import ChatClient, ChatRequest, ChatResponse
from tracekit.types import Message, Task, Trajectory, stable_hash


@dataclass
class EpisodeSpec:
    """One rollout to run: a task, the environment seed (shared by a GRPO group) and a sample index."""

    task: Task
    seed: int
    sample: int
    group: int  # GRPO group id within the iteration


def request_seed(sample_seed: int, spec: EpisodeSpec, step: int) -> int:
    """The sampling seed of an episode's ``step``-th request: a function of (sample_seed, group,
    sample, step) only, so a rerun samples the same whatever else shares the batch."""
    return int(stable_hash([sample_seed, spec.group, spec.sample, step], 15), 16)


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
    infra_retries: int = INFRA_RETRIES,
) -> list[Trajectory]:
    """Run every spec to its end; one trajectory per spec, in spec order, with ``info['group']``.

    Terminations as in :mod:`tracekit.episodes`; an environment that raises ends only its episode
    (``error``, reward 0). An episode that ends on an infrastructure failure (a worker died or hung, the environment
    server or sandbox failed) is never trained on: it is run again (the same seeds, so the same group), at most
    ``infra_retries`` times, then :class:`~tracekit.episodes.InfraFailure` stops the run; a retried episode's
    trajectory says how often (``info['infra_retries']``), which the trainer counts per iteration.
    """
    runs = [EpisodeRun(sp.task, sp.sample, sp.seed) for sp in specs]
    spec_of = dict(zip(runs, specs))

    def act(live: list[EpisodeRun]) -> list[ChatResponse | Exception]:
        reqs = [
            ChatRequest(
                messages=list(r.messages),
                tools=r.tools or None,
                temperature=temperature,
                top_p=top_p,
                max_new_tokens=max_new_tokens,
                seed=request_seed(sample_seed, spec_of[r], r.steps),
                return_tokens=True,
            )
            for r in live
        ]
        resps = client.chat(reqs)
        for resp in resps:  # training needs every generated token: a client that drops them is a bug
            tokens = (resp.prompt_token_ids, resp.completion_token_ids, resp.completion_logprobs)
            if resp.finish_reason != "error" and None in tokens:
                raise RuntimeError(f"{type(client).__name__} returned no token ids/log-probs although return_tokens was set")
        return list(resps)

    out: dict[EpisodeRun, Trajectory] = {}
    client.clear_prefix_cache()  # prompt prefixes are shared within these episodes only (as in a rollout)
    try:
        for r in drive_episodes(suite, runs, act, max_steps=max_steps, batch_size=max(len(runs), 1),
                                infra_retries=infra_retries):
            t = r.trajectory(suite.name)
            t.info.update(group=spec_of[r].group, outcome=r.outcome_info)
            if r.retries:
                t.info["infra_retries"] = r.retries
            out[r] = t
    finally:
        client.clear_prefix_cache()
    return [out[r] for r in runs]


def tool_calls(messages: list[Message]) -> int:
    """Tool calls the agent made in an episode."""
    return sum(len(m.tool_calls) for m in messages if m.role == "assistant")
