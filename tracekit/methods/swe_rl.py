"""``swe_rl``: the SWE-RL baseline (Wei et al., 2025; paper Table 2): the GRPO recipe on the coding target's
training tasks with SWE-RL's rule-based reward instead of the tests.

SWE-RL's reward, written here from its definition (arXiv:2502.18449, section 2.1):

- a format error scores -1 (SWE-RL: the output cannot be parsed, a search block is not found, or an edit changes
  nothing; here, where the agent edits a real tree through bash and the patch is ``git diff``, a *format error* is
  a submission that changes nothing, or a patch that does not apply);
- otherwise the reward is the mean, over every file that the predicted patch or the oracle patch changes, of
  ``difflib.SequenceMatcher(None, predicted_file_diff, oracle_file_diff, autojunk=False).ratio()``, where a file
  diff is the unified diff (3 lines of context, the two ``---``/``+++`` header lines dropped) between the file's
  original text and its new text; a file changed by only one side scores 0.

The oracle is the task's gold patch (the bug's reverse). Training tasks, budget (matched to TRACE's per-capability
GRPO episodes unless ``baselines.swe_rl.episodes`` is set), engine and LoRA are ``grpo_target``'s.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping

from tracekit.artifacts import Artifact, atomic_write_json, read_json
from tracekit.methods.base import Method, Policy, PolicyRow, grpo_budget
from tracekit.pipeline import Stage

LABEL = "SWE-RL"
RESULT = "swe_rl.json"
FORMAT_ERROR = -1.0


class FormatError(ValueError):
    """The prediction is not a usable edit (nothing changed, or a patch that does not apply)."""


def file_diff(old: str, new: str, context: int = 3) -> str:
    """SWE-RL's normalized per-file change: the unified diff of ``old`` -> ``new`` without its two header lines."""
    lines = list(difflib.unified_diff(old.splitlines(), new.splitlines(), fromfile="old", tofile="new",
                                      lineterm="", n=context))
    return "\n".join(lines[2:])


def changed_file_diffs(context: Mapping[str, str], new_content: Mapping[str, str]) -> dict[str, str]:
    """path -> normalized diff, for each path of ``new_content`` whose text differs from ``context`` (missing: "")."""
    out = {}
    for path, new in new_content.items():
        d = file_diff(context.get(path, ""), new)
        if d:
            out[path] = d
    return out


def change_similarities(pred: Mapping[str, str], oracle: Mapping[str, str]) -> dict[str, float]:
    """Per changed file (union of both sides): sequence similarity of the two diffs (0 if one side is empty)."""
    out = {}
    for path in sorted(set(pred) | set(oracle)):
        p, o = pred.get(path, ""), oracle.get(path, "")
        out[path] = 0.0 if not p or not o else difflib.SequenceMatcher(None, p, o, autojunk=False).ratio()
    return out


def swe_rl_score(context: Mapping[str, str], oracle_new: Mapping[str, str],
                 pred_new: Mapping[str, str]) -> tuple[float, dict[str, float]]:
    """(reward, per-file similarities): -1 when the prediction changes nothing, else the mean similarity."""
    pred = changed_file_diffs(context, pred_new)
    if not pred:
        return FORMAT_ERROR, {}
    oracle = changed_file_diffs(context, oracle_new)
    sims = change_similarities(pred, oracle)
    return sum(sims.values()) / len(sims), sims


def swe_rl_reward(context: Mapping[str, str], oracle_new: Mapping[str, str], pred_new: Mapping[str, str] | None,
                  malformed: bool = False) -> float:
    """SWE-RL's reward; ``pred_new=None`` or ``malformed``: the prediction could not be read (a format error)."""
    if malformed or pred_new is None:
        return FORMAT_ERROR
    return swe_rl_score(context, oracle_new, pred_new)[0]


# --------------------------------------------------------------------------------------------
# the method: GRPO on the coding target's training split with the SWE-RL reward


def stage_reads(cfg):
    from tracekit.methods.grpo_target import stage_reads as grpo_reads

    return tuple(r if r != "baselines.grpo_target" else "baselines.swe_rl" for r in grpo_reads(cfg))


def stage_inputs(cfg):
    return ("train",) if cfg.baselines.swe_rl.episodes is None else ()


def swe_rl_stage(ctx) -> None:
    from tracekit.methods.grpo_target import train_on_target
    from tracekit.methods.target_train import train_suite_spec

    cfg, s = ctx.cfg, ctx.cfg.baselines.swe_rl
    record = train_on_target(ctx, "swe_rl", s, lambda _: {**train_suite_spec(cfg, limit=s.train_limit), "reward": "swe_rl"},
                             cache_dir=str(cfg.paths.cache_dir))
    atomic_write_json(ctx.work_dir / RESULT, record)


def swe_rl_report(art: Artifact, ctx) -> None:
    r = read_json(art.path / RESULT)
    b = r["budget"]
    ctx.record.section("SWE-RL", (
        f"{r['iterations']} GRPO iterations on the coding target's training tasks with SWE-RL's patch-similarity "
        f"reward: {b['episodes']:,} episodes, {b['generated_tokens']:,} generated tokens, "
        f"{b['optimizer_steps']:,} optimizer steps."))


class SweRl(Method):
    name = "swe_rl"
    summary = "GRPO on the coding target's training tasks with SWE-RL's reward (patch similarity to the oracle)"
    stages = (Stage("swe_rl", reads=stage_reads, inputs=stage_inputs, compute=swe_rl_stage, report=swe_rl_report),)

    def inputs(self, cfg):
        return ("swe_rl",)

    def validate(self, cfg):
        from tracekit.config import ConfigError
        from tracekit.methods.target_train import refuse_without_training_split
        from tracekit.targets import target_of

        if not target_of(cfg).patch_reward:
            from tracekit.targets import kinds, target

            with_patches = " or ".join(k for k in kinds() if target(k).patch_reward)
            raise ConfigError(f"swe_rl trains with SWE-RL's patch-similarity reward on the coding target's training "
                              f"split (gold patches): benchmark.kind={with_patches} (got {cfg.benchmark.kind}, "
                              f"{cfg.benchmark.name})")
        refuse_without_training_split(cfg, self.name)

    def rows(self, ctx):
        art = ctx.inputs["swe_rl"]
        r = read_json(art.path / RESULT)
        adapter = art.resolve(r["adapter"])
        budget = grpo_budget(adapter)
        note = (f"{r['iterations']} GRPO iterations on the coding training split, SWE-RL reward: "
                f"{budget.episodes:,} episodes")
        return [PolicyRow(LABEL, Policy("adapter", adapter, "adapter"), budget, (note,))]
