"""The recipes of docs/ARCHITECTURE.md, held (issue 38): adding a target takes one folder, one line of the targets' index,
its conf/benchmark file and the docs (issue 51), a method with settings <= 6, a consolidation strategy with settings 6. Each test follows its recipe in a temporary copy of the tree, with a throwaway target or method that has
settings of its own, counts the files the recipe touched, and runs the copy: the config composes with the new
entry, its settings are checked by the rules it declares (one line), its keys hold its own settings and no other
target's, and the docs' registry checks pass there."""

from __future__ import annotations

import filecmp
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
COPIED = ("tracekit", "conf", "docs", "sweeps", "README.md", ".importlinter", "tests/conftest.py", "tests/__init__.py",
          "tests/test_docs_registries.py")


def _copy_tree(dst: Path) -> None:
    for rel in COPIED:
        src = ROOT / rel
        if src.is_dir():
            shutil.copytree(src, dst / rel, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        elif src.exists():
            (dst / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst / rel)


def _touched(copy: Path) -> list[str]:
    """The files of the copy that differ from the tree, or are new."""
    out = []
    for rel in COPIED:
        base = copy / rel
        for f in [base] if base.is_file() else (p for p in base.rglob("*") if p.is_file()):
            if "__pycache__" in f.parts:
                continue
            r = f.relative_to(copy)
            if not (ROOT / r).is_file() or not filecmp.cmp(ROOT / r, f, shallow=False):
                out.append(str(r))
    return sorted(out)


def _edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text, f"{path}: the recipe's anchor {old!r} is gone: update the recipe and this test"
    path.write_text(text.replace(old, new, 1))


def _run(copy: Path, code: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(copy)}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=copy, env=env, capture_output=True,
                          text=True, timeout=300)


def _docs_checks(copy: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(copy)}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_docs_registries.py"],
                          cwd=copy, env=env, capture_output=True, text=True, timeout=300)


TARGET_MODULE = """
\"\"\"A throwaway target (tests/test_extension_recipes.py): each task asks the agent to say a word back.\"\"\"

from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from tracekit.agents import GoldAgent
from tracekit.analysis.rules import RuleLabeler
from tracekit.envs.base import EnvSuite, Episode, Observation, Outcome, StepResult
from tracekit.evaluate import summarize
from tracekit.targets.base import Target
from tracekit.types import Capability, LabelValue, Message, Task

WORDS = ("apple", "pear", "plum", "fig")


@dataclass
class EchoSettings:
    rounds: int = 1
    mode: str = "plain"

    RANGES: ClassVar[dict[str, str]] = {"rounds": ">= 1"}
    CHOICES: ClassVar[dict[str, tuple[str, ...]]] = {"mode": ("plain", "loud")}


class EchoEpisode(Episode):
    def __init__(self, task):
        self.task, self.said = task, ""

    def reset(self):
        return Observation([Message(role="system", content="Say the word back."),
                            Message(role="user", content=self.task.instruction)], [])

    def step(self, action):
        self.said = action.content or ""
        return StepResult([], done=True, termination="agent_stop")

    def outcome(self):
        ok = self.task.data["communicate_info"][0] in self.said
        return Outcome(float(ok), ok)


class EchoSuite(EnvSuite):
    name = "echo"

    def __init__(self, rounds):
        self.rounds = rounds

    def tasks(self):
        return [Task(id=f"{w}-{r}", env="echo", instruction=f"Say {w}.", data={"actions": [], "communicate_info": [w]})
                for r in range(self.rounds) for w in WORDS]

    def episode(self, task, seed=0):
        return EchoEpisode(task)


class EchoLabeler(RuleLabeler):
    capabilities = ("echoing",)
    dictionary_path = Path(__file__)

    def rules(self, traj):
        return {"echoing": (LabelValue.PRESENT if traj.success else LabelValue.LACKING, "said the word")}


class EchoTarget(Target):
    kind = "echo"
    settings = EchoSettings
    domains = ("echo",)
    summary = "a throwaway target"
    metric = "pass_rate"
    columns = ("overall",)

    def build_suite(self, cfg, split, client_for):
        return EchoSuite(self.own(cfg.benchmark).rounds)

    def reference_dictionary(self):
        return [Capability(name="echoing", description="says back the word it was asked to")]

    def reference_labeler(self, noise):
        return EchoLabeler(noise)

    def gold_agent(self):
        return GoldAgent()
"""


def test_adding_a_target_touches_one_folder_one_index_line_its_config_and_the_docs(tmp_path):
    copy = tmp_path / "tree"
    _copy_tree(copy)
    # the recipe (docs/ARCHITECTURE.md, "Adding a target")
    (copy / "tracekit/targets/echo").mkdir()
    (copy / "tracekit/targets/echo/__init__.py").write_text('"""A throwaway target."""\n')
    (copy / "tracekit/targets/echo/target.py").write_text(TARGET_MODULE)
    _edit(copy / "tracekit/target_index.py", "KINDS: dict[str, Kind] = {\n",
          'KINDS: dict[str, Kind] = {\n    "echo": Kind("echo.target:EchoTarget", ("echo",)),\n')
    (copy / "conf/benchmark/echo.yaml").write_text("name: echo\nkind: echo\ndomains: [echo]\necho:\n  rounds: 2\n")
    _edit(copy / "docs/ARCHITECTURE.md", "<!-- /registry -->\n\nA `Target`",
          "| `echo` | `echo/` | a throwaway target | none |\n<!-- /registry -->\n\nA `Target`")
    _edit(copy / "docs/ARCHITECTURE.md", "  targets/              one folder per benchmark.kind, each: ",
          "  targets/              one folder per benchmark.kind (echo/: target), each: ")
    _edit(copy / "README.md", "**Targets** (`conf/benchmark/`, `benchmark=<name>`): ",
          "**Targets** (`conf/benchmark/`, `benchmark=<name>`): `echo` (a throwaway target), ")
    touched = _touched(copy)
    assert touched == ["README.md", "conf/benchmark/echo.yaml", "docs/ARCHITECTURE.md", "tracekit/target_index.py",
                       "tracekit/targets/echo/__init__.py", "tracekit/targets/echo/target.py"]
    index = (copy / "tracekit/target_index.py").read_text().splitlines()
    assert len(index) == len((ROOT / "tracekit/target_index.py").read_text().splitlines()) + 1  # one index line
    out = _run(copy, """
        from pathlib import Path
        from tests.conftest import compose_config
        from tracekit.artifacts import StageCache, read_json
        from tracekit.pipeline import RunRecord
        from tracekit.report.logging import RunLogger
        from tracekit.runs import trajectories_of
        from tracekit.analysis.discovery import DICTIONARY_FILE
        from tracekit.config import ConfigError
        from tracekit.validate import _leaves, _check_leaf, RANGES, CHOICES
        from tracekit.wiring import rollout_reads
        from tracekit.stages import build_pipeline
        tmp = Path("runs")
        cfg = compose_config(["benchmark=echo"], tmp)
        assert cfg.benchmark.echo.rounds == 2 and "benchmark.echo.rounds" in RANGES and "benchmark.echo.mode" in CHOICES
        reads = rollout_reads(cfg)
        assert "benchmark.echo" in reads and not any(r.startswith("benchmark.toolsandbox") for r in reads), reads
        for bad in ("benchmark.echo.rounds=0", "benchmark.echo.mode=quiet"):
            c = compose_config(["benchmark=echo", bad], tmp)
            try:
                for key, pattern, node, name in _leaves(c, __import__("tracekit.schema").schema.config_schema()):
                    if pattern in RANGES or pattern in CHOICES:
                        _check_leaf(key, pattern, node[name])
            except ConfigError as e:
                print("refused:", e)
            else:
                raise SystemExit(f"{bad} was not refused")
        pipe = build_pipeline()
        key = lambda c: pipe.key(c, pipe.stages["rollout"], {})
        assert key(cfg) != key(compose_config(["benchmark=echo", "benchmark.echo.rounds=3"], tmp))
        assert key(cfg) == key(compose_config(["benchmark=echo", "benchmark.toolsandbox.train_seed=7"], tmp))
        # the target runs: rollout (the gold agent), discover and label (analysis=reference) on its episodes
        run = compose_config(["benchmark=echo", "agent=gold", "analysis.discovery=reference", "analysis.labeler=reference",
                              "thresholds.n=2", "logger=none"], tmp)
        tmp.joinpath("run").mkdir(parents=True)
        record = RunRecord(tmp / "run")
        record.logger = RunLogger(run, tmp / "run")  # logger=none: a no-op sink
        done = pipe.run(run, ["label"], StageCache(tmp / "cache"), record)
        episodes = trajectories_of(done["rollout"])
        assert len(episodes) == 8 and all(t.success and t.env == "echo" for t in episodes), episodes
        assert [c["name"] for c in read_json(done["discover"].path / DICTIONARY_FILE)["capabilities"]] == ["echoing"]
        report = read_json(done["label"].path / "labeling_report.json")
        assert report["labeler"] == "reference" and report["labels"] == 2 * 8 and report["missing"] == 0, report
        print("ok")
    """)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stdout + out.stderr
    assert "refused: benchmark.echo.rounds=0 is invalid: must be >= 1" in out.stdout
    assert "refused: benchmark.echo.mode='quiet' is invalid: must be one of plain, loud" in out.stdout
    docs = _docs_checks(copy)
    assert docs.returncode == 0, docs.stdout[-3000:] + docs.stderr[-2000:]


METHOD_MODULE = '''
"""A throwaway method with settings (tests/test_extension_recipes.py)."""

from dataclasses import dataclass
from typing import ClassVar

from tracekit.methods.base import Method


@dataclass
class EchoMethodSettings:
    episodes: int | None = None
    style: str = "plain"

    RANGES: ClassVar[dict[str, str]] = {"episodes": ">= 1"}
    CHOICES: ClassVar[dict[str, tuple[str, ...]]] = {"style": ("plain", "loud")}


class EchoMethod(Method):
    name = "echo_method"
    settings = EchoMethodSettings
    summary = "a throwaway method"

    def inputs(self, cfg):
        return ()

    def reads(self, cfg):
        return ("baselines.echo_method",)

    def rows(self, ctx):
        return []
'''


def test_adding_a_method_with_settings_touches_at_most_6_files(tmp_path):
    copy = tmp_path / "tree"
    _copy_tree(copy)
    # the recipe (docs/ARCHITECTURE.md, "Adding a method")
    (copy / "tracekit/methods/echo_method.py").write_text(METHOD_MODULE)
    _edit(copy / "tracekit/methods/__init__.py", "from tracekit.methods.adp_sft import AdpSft\n",
          "from tracekit.methods.adp_sft import AdpSft\nfrom tracekit.methods.echo_method import EchoMethod\n")
    _edit(copy / "tracekit/methods/__init__.py", "    SweRl(),\n", "    SweRl(), EchoMethod(),\n")
    # conf/baselines/paper.yaml: no line (the dataclass holds its defaults)
    _edit(copy / "docs/ARCHITECTURE.md", "<!-- registry: methods -->\n",
          "<!-- registry: methods -->\n- `echo_method`: a throwaway method\n")
    _edit(copy / "docs/ARCHITECTURE.md", "the registry (base: Method, PolicyRow); ", "the registry (base: Method, PolicyRow); echo_method, ")
    _edit(copy / "README.md", "<!-- registry: methods -->\n", "<!-- registry: methods -->\n- `echo_method`: a throwaway method\n")
    touched = _touched(copy)
    assert touched == ["README.md", "docs/ARCHITECTURE.md", "tracekit/methods/__init__.py",
                       "tracekit/methods/echo_method.py"] and len(touched) <= 6
    out = _run(copy, """
        from pathlib import Path
        from tests.conftest import compose_config
        from tracekit.config import ConfigError
        from tracekit.validate import validate
        from tracekit.stages import build_pipeline
        tmp = Path("runs")
        cfg = compose_config(["eval.methods=[base,echo_method]", "baselines.echo_method.episodes=5"], tmp)
        validate(cfg)
        for bad in ("baselines.echo_method.episodes=0", "baselines.echo_method.style=quiet", "eval.methods=[echo_methd]"):
            try:
                validate(compose_config([bad], tmp))
            except ConfigError as e:
                print("refused:", e)
            else:
                raise SystemExit(f"{bad} was not refused")
        pipe = build_pipeline()
        reads = pipe.reads(cfg, "evaluate")
        assert "baselines.echo_method" in reads, reads
        print("ok")
    """)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stdout + out.stderr
    assert "refused: baselines.echo_method.episodes=0 is invalid: must be >= 1" in out.stdout
    assert "refused: baselines.echo_method.style='quiet' is invalid: must be one of plain, loud" in out.stdout
    assert "refused: eval.methods='echo_methd' is invalid: must be one of" in out.stdout
    docs = _docs_checks(copy)
    assert docs.returncode == 0, docs.stdout[-3000:] + docs.stderr[-2000:]


STRATEGY_MODULE = '''
"""A throwaway consolidation strategy with settings (tests/test_extension_recipes.py)."""

from dataclasses import dataclass
from typing import ClassVar

from tracekit.methods.consolidate.base import Strategy


@dataclass
class EchoStrategySettings:
    scale: float = 1.0
    order: str = "name"

    RANGES: ClassVar[dict[str, str]] = {"scale": "> 0"}
    CHOICES: ClassVar[dict[str, tuple[str, ...]]] = {"order": ("name", "rank")}


class EchoStrategy(Strategy):
    name = "echo_strategy"
    label = "Echo"
    settings = EchoStrategySettings

    def reads(self, cfg):
        return ("consolidation.echo_strategy",)

    def consolidate(self, ctx, adapters):
        raise RuntimeError("a throwaway strategy consolidates nothing")
'''


def test_adding_a_strategy_with_settings_touches_6_files(tmp_path):
    copy = tmp_path / "tree"
    _copy_tree(copy)
    # the recipe (docs/ARCHITECTURE.md, "Adding a strategy with settings")
    (copy / "tracekit/methods/consolidate/echo_strategy.py").write_text(STRATEGY_MODULE)
    init = copy / "tracekit/methods/consolidate/__init__.py"
    _edit(init, "from tracekit.methods.consolidate.arrow import Arrow\n",
          "from tracekit.methods.consolidate.arrow import Arrow\nfrom tracekit.methods.consolidate.echo_strategy import EchoStrategy\n")
    _edit(init, "Arrow(), Route())", "Arrow(), Route(), EchoStrategy())")
    (copy / "conf/consolidation/echo_strategy.yaml").write_text("method: echo_strategy\necho_strategy:\n  scale: 2.0\n")
    _edit(copy / "sweeps/consolidation.yaml", "on_policy_distill,arrow\n", "on_policy_distill,arrow,echo_strategy\n")
    _edit(copy / "docs/ARCHITECTURE.md", "<!-- registry: strategies -->\n| strategy | module | output | budget |\n|---|---|---|---|\n",
          "<!-- registry: strategies -->\n| strategy | module | output | budget |\n|---|---|---|---|\n"
          "| `echo_strategy` | `echo_strategy.py` | nothing | none |\n")
    _edit(copy / "docs/ARCHITECTURE.md", "consolidate/: base (Strategy), ", "consolidate/: base (Strategy), echo_strategy, ")
    _edit(copy / "README.md", "<!-- registry: strategies -->\n", "<!-- registry: strategies -->\n- `echo_strategy`: a throwaway strategy\n")
    touched = _touched(copy)
    assert touched == ["README.md", "conf/consolidation/echo_strategy.yaml", "docs/ARCHITECTURE.md",
                       "sweeps/consolidation.yaml", "tracekit/methods/consolidate/__init__.py",
                       "tracekit/methods/consolidate/echo_strategy.py"]
    out = _run(copy, """
        from pathlib import Path
        from tests.conftest import compose_config
        from tracekit.config import ConfigError
        from tracekit.validate import validate
        from tracekit.stages import build_pipeline
        tmp = Path("runs")
        cfg = compose_config(["consolidation=echo_strategy"], tmp)
        validate(cfg)
        assert cfg.consolidation.echo_strategy.scale == 2.0
        for bad in ("consolidation.echo_strategy.scale=0", "consolidation.echo_strategy.order=size"):
            try:
                validate(compose_config(["consolidation=echo_strategy", bad], tmp))
            except ConfigError as e:
                print("refused:", e)
            else:
                raise SystemExit(f"{bad} was not refused")
        assert "consolidation.echo_strategy" in build_pipeline().reads(cfg, "compose")
        print("ok")
    """)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stdout + out.stderr
    assert "refused: consolidation.echo_strategy.scale=0.0 is invalid: must be > 0" in out.stdout
    assert "refused: consolidation.echo_strategy.order='size' is invalid: must be one of name, rank" in out.stdout
    docs = _docs_checks(copy)
    assert docs.returncode == 0, docs.stdout[-3000:] + docs.stderr[-2000:]


@pytest.mark.parametrize("recipe", ["Adding a target", "Adding a method", "Adding a strategy"])
def test_the_recipes_are_in_the_architecture_doc(recipe):
    assert f"**{recipe}" in (ROOT / "docs/ARCHITECTURE.md").read_text()
