"""``rollout_throughput.py`` with only some of its host-step arms (issue 40).

``ROLLOUT_ARMS=batched`` (comma-separated; ``batched`` must stay: the lora and moe arms reuse its settings) keeps
those of ``arm_settings``'s arms; every argument goes to ``rollout_throughput.py`` unchanged. On the gain target's
300 episodes the ``reference`` arm's row-by-row host step and the ``host_pick`` arm take minutes of a device call
each; their ratios to ``batched`` were measured at 30 episodes (``results/rollout_throughput_h200*``).

    ROLLOUT_ARMS=batched python benchmarks/rollout_arms.py --targets gain --gain-limit 100 --moe --lora-target gain
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import rollout_throughput as rt  # noqa: E402

KEEP = [a for a in os.environ.get("ROLLOUT_ARMS", "").split(",") if a]
if KEEP:
    _all = rt.arm_settings
    rt.arm_settings = lambda cuda: {k: v for k, v in _all(cuda).items() if k in KEEP}

if __name__ == "__main__":
    raise SystemExit(rt.main())
