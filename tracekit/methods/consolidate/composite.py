"""Composite gate data (issue 53, beyond the paper): the LoRA-MoE gate also trains on chained episodes.

The paper trains TRACE's gate on each capability adapter's own rollouts, so no gate example shows two capabilities
in one task. With ``synthesis.chains`` (:mod:`tracekit.synthesis.chain`) the synthesize stage samples the base
policy on chained environments ("refuse the locked item, then finish the other writes"); here each chain's
successful episodes (every one with ``moe.gate_data=all``) become token rows (the assistant's turns masked in, as the
warm start's demonstrations are built) in a gate-training group of their own, beside the capabilities' groups:

- the capabilities' groups are mixed exactly as without chains (the same per-group count, the same draw), and each
  chain adds up to that many of its own examples, shuffled in with one seeded draw; a share of each chain's
  examples is held out, so the gate's routing on chained episodes is measured on examples it never trained on;
- every chained episode sampled (failures included) counts in TRACE's budget;
- the row says so: ``TRACE (composite gate data, beyond the paper)``, and the results note gives each chain's
  successes and episodes.

Nothing here runs while ``synthesis.chains`` is empty: TRACE's keys, data and row are the paper's.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from tracekit.methods.adp_data import assistant_turns
from tracekit.moe.gate import GateExample
from tracekit.policy import Budget
from tracekit.rl.tokens import build_rows
from tracekit.synthesis.chain import chain_records, chain_trajectories

COMPOSITE_WORDS = "composite gate data, beyond the paper"  # the row label's words (TRACE (<words>))
COMPOSITE_SETTINGS = ("synthesis.chains", "synthesis.chain_seeds", "synthesis.chain_samples")


def composite_on(cfg: DictConfig) -> bool:
    """Whether the gate trains on chained episodes too (``synthesis.chains`` non-empty); off where a stage's view masks
    the group (one level at a time: a masked group reads as a MISSING string)."""
    node: Any = cfg
    for part in ("synthesis", "chains"):
        node = OmegaConf.select(node, part, default=None) if isinstance(node, DictConfig) else None
    return isinstance(node, ListConfig) and len(node) > 0


def composite_reads(cfg: DictConfig) -> tuple[str, ...]:
    """What the compose key reads for composite gate data: nothing while it is off (TRACE's keys as before)."""
    return COMPOSITE_SETTINGS if composite_on(cfg) else ()


def composite_inputs(cfg: DictConfig) -> tuple[str, ...]:
    return ("synthesize",) if composite_on(cfg) else ()


def chain_examples(synthesize_dir: Path, tokenizer: Any, successes_only: bool = True,
                   ) -> tuple[dict[str, list[GateExample]], Budget, str]:
    """({chain: gate examples}, the chains' episodes as a budget, the results note) of a synthesize artifact. A chain
    that yields no example is refused (RuntimeError naming it): its row would be TRACE's under another name."""
    records = chain_records(synthesize_dir)
    if not records:
        raise RuntimeError(f"compose: synthesis.chains is set but {synthesize_dir} has no ready chain (each needs both "
                           "capabilities selected and synthesized; see its environments.json)")
    groups: dict[str, list[GateExample]] = {}
    for chain, record in records.items():
        rows = [r for t in chain_trajectories(synthesize_dir, chain, successes_only)
                for r in build_rows(assistant_turns(t.messages, record["tools"], tokenizer))]
        groups[chain] = [GateExample(list(r.token_ids), list(r.loss_mask)) for r in rows if any(r.loss_mask)]
        if not groups[chain]:
            raise RuntimeError(f"compose: chain {chain}: {record['successes']} of {record['episodes']} base-policy "
                               "episodes succeed, no gate example (more synthesis.chain_seeds or chain_samples, or "
                               "moe.gate_data=all)")
    episodes = sum(r["episodes"] for r in records.values())
    each = "; ".join(f"{c}: {r['successes']} of {r['episodes']} base-policy episodes succeed"
                     for c, r in records.items())
    note = (f"beyond the paper: the gate also trained on chained episodes ({each}); their {episodes:,} episodes are "
            "in the budget")
    return groups, Budget(episodes=episodes), note


def with_chains(examples: list[GateExample], chain_groups: dict[str, list[GateExample]], per_group: int,
                seed: int) -> list[GateExample]:
    """The capabilities' mixed ``examples`` plus up to ``per_group`` examples of each chain, shuffled (seeded)."""
    rng = random.Random(f"{seed}:composite-gate-data")
    extra = [ex for name in sorted(chain_groups) for ex in rng.sample(chain_groups[name],
                                                                        min(per_group, len(chain_groups[name])))]
    out = list(examples) + extra
    rng.shuffle(out)
    return out
