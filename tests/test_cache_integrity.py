"""The cache keeps its promises: seeds and every read value in keys, verified artifacts, a movable cache."""

from __future__ import annotations

import json
import os
import shutil
import stat
import sys
import textwrap
import time
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from tests import procs
from tracekit.config import ConfigError
from tracekit.validate import validate
from tracekit.artifacts import COMPLETE, CorruptArtifact, StageCache, atomic_write_json, write_jsonl
from tracekit.pipeline import Pipeline, RunRecord, Stage, UndeclaredRead, read_view
from tracekit.stages import build_pipeline


# --------------------------------------------------------------------------------------------
# keys: every value a stage reads, the master seed included, and nothing else


def _leaves(node, prefix=""):
    for k, v in node.items() if isinstance(node, dict) else ():
        full = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            yield from _leaves(v, full + ".")
        else:
            yield full, v


def _mutations(value):
    """Other values for a leaf, in the order to try them (a None leaf's type is the schema's)."""
    if isinstance(value, bool):
        return [not value]
    if isinstance(value, (int, float)):
        return [value + 1]
    if isinstance(value, str):
        return [value + "_x"]
    if isinstance(value, list):
        return [[*value, value[-1]] if value else ["x"], [1]]
    return [{"x": 1}, 1, "x", ["x"], [0.5]]  # None or an empty dict


def _mutate(cfg, leaf, value):
    from omegaconf.errors import ConfigTypeError, ValidationError

    for new in _mutations(value):
        mutated = cfg.copy()
        try:
            OmegaConf.update(mutated, leaf, new, force_add=True)
            return mutated
        except (ValidationError, ConfigTypeError):
            continue
    raise AssertionError(f"no other value fits {leaf}={value!r}")


def _stage_keys(pipe: Pipeline, cfg) -> dict[str, str]:
    from tracekit.artifacts import Artifact

    fake = {n: Artifact(n, "k", Path("/nonexistent") / n / "k", f"content-{n}", hit=True) for n in pipe.stages}
    return {name: pipe.key(cfg, stage, {n: fake[n] for n in pipe.inputs(cfg, name)}) for name, stage in pipe.stages.items()}


def _read_values(cfg, reads):
    return [OmegaConf.to_container(v, resolve=True) if OmegaConf.is_config(v) else v
            for v in (OmegaConf.select(cfg, r) for r in reads)]


@pytest.mark.parametrize("preset", ["smoke", "embedded"])
def test_every_read_value_and_only_those_change_a_stage_key(make_cfg, preset):
    cfg = make_cfg(f"experiment={preset}")
    pipe = build_pipeline()
    base = _stage_keys(pipe, cfg)
    plain = OmegaConf.to_container(cfg, resolve=True)
    checked = 0
    for leaf, value in _leaves(plain):
        if leaf.split(".")[0] in ("paths", "logger", "launcher", "name", "stages", "experiment"):
            continue
        mutated = _mutate(cfg, leaf, value)
        try:
            validate(mutated)
        except ConfigError:
            continue  # a value the run would refuse up front has no key
        keys = _stage_keys(pipe, mutated)
        for name in pipe.stages:
            reads = pipe.reads(cfg, name)
            if pipe.reads(mutated, name) != reads:
                continue  # the value switches which keys the stage reads (e.g. analysis.discovery): covered by name
            # a leaf counts as read when a read value holds it (or interpolates it: grpo.seed is ${seed})
            read = _read_values(cfg, reads) != _read_values(mutated, reads)
            assert read == any(leaf == r or leaf.startswith(r + ".") for r in reads) or leaf == "seed", (name, leaf)
            neutral = pipe.stages[name].key_neutral
            if read and neutral is not None and leaf in neutral(cfg) and leaf in neutral(mutated):
                read = False  # declared key-neutral in both configs: a setting of a switched-off option
            assert (keys[name] != base[name]) == read, (name, leaf)
            checked += 1
    assert checked > 300


def test_the_master_seed_is_in_the_keys_of_the_stages_that_draw_from_it(make_cfg):
    pipe = build_pipeline()
    one = _stage_keys(pipe, make_cfg("experiment=smoke", "seed=1", "analysis.label_noise=0.2"))
    two = _stage_keys(pipe, make_cfg("experiment=smoke", "seed=2", "analysis.label_noise=0.2"))
    # greedy rollout, reference discovery; train through grpo.seed (${seed}) and what follows it; the baselines
    # that train (grpo.seed, baselines.adp_sft.seed) or sample (GEPA, and Figure 4, which runs GEPA) too
    assert {n for n in one if one[n] != two[n]} == {"label", "train", "compose", "grpo_target", "untargeted_synthetic",
                                                    "adp_sft", "gepa", "figure4", "swe_rl"}
    stoch = [_stage_keys(pipe, make_cfg("experiment=smoke", f"seed={s}", "eval=stochastic")) for s in (1, 2)]
    assert stoch[0]["rollout"] != stoch[1]["rollout"] and stoch[0]["evaluate"] != stoch[1]["evaluate"]
    llm = [_stage_keys(pipe, make_cfg("experiment=smoke", f"seed={s}", "analysis=llm")) for s in (1, 2)]
    assert llm[0]["discover"] != llm[1]["discover"]


def test_the_user_endpoint_is_read_only_by_an_llm_user(make_cfg):
    pipe = build_pipeline()
    keys = [_stage_keys(pipe, make_cfg("experiment=smoke", f"llm.endpoints.user.base_url=http://h{i}:1/v1"))
            for i in (1, 2)]
    assert keys[0]["rollout"] == keys[1]["rollout"]  # user=scripted
    assert "llm.endpoints.user" in build_pipeline().reads(make_cfg("experiment=smoke", "user=llm"), "rollout")


def test_a_stage_reading_an_undeclared_value_fails_naming_it(tmp_path):
    def sneaky(ctx):
        (ctx.work_dir / "out.txt").write_text(str(ctx.cfg.y))

    pipe = Pipeline([Stage("a", reads=("x",), inputs=(), compute=sneaky)])
    cfg = OmegaConf.create({"seed": 0, "x": 1, "y": 2, "paths": {}})
    (tmp_path / "run").mkdir()
    with pytest.raises(UndeclaredRead, match="stage a read config value 'y'"):
        pipe.run(cfg, ["a"], StageCache(tmp_path / "cache"), RunRecord(tmp_path / "run"))

    def seeded(ctx):
        (ctx.work_dir / "out.txt").write_text(str(ctx.seed))

    pipe = Pipeline([Stage("b", reads=("x",), inputs=(), compute=seeded)])
    with pytest.raises(UndeclaredRead, match="does not declare `seed`"):
        pipe.run(cfg, ["b"], StageCache(tmp_path / "cache"), RunRecord(tmp_path / "run"))


def test_read_view_keeps_read_subtrees_and_masks_the_rest(make_cfg):
    cfg = make_cfg("experiment=smoke")
    view = read_view(cfg, ("eval.temperature", "grpo"))
    assert view.eval.temperature == cfg.eval.temperature and view.grpo.lr == cfg.grpo.lr
    assert OmegaConf.is_missing(view.eval, "methods") and OmegaConf.is_missing(view, "thresholds")
    assert type(OmegaConf.to_object(view.grpo)).__name__ == "GrpoConfig"  # structured nodes stay structured
    assert view.paths.cache_dir == cfg.paths.cache_dir  # execution keys stay visible


# --------------------------------------------------------------------------------------------
# a COMPLETE artifact is verified before it is trusted


def _complete(tmp_path: Path, files: dict[str, bytes]):
    cache = StageCache(tmp_path / "cache")

    def compute(work):
        for name, data in files.items():
            (work / name).parent.mkdir(parents=True, exist_ok=True)
            (work / name).write_bytes(data)

    return cache, cache.get_or_compute("s", "k", compute)


def test_a_truncated_jsonl_is_corrupt_not_shorter(tmp_path):
    rows = b'{"i": 0}\n{"i": 1}\n'
    cache, art = _complete(tmp_path, {"trajectories.jsonl": rows})
    assert cache.lookup("s", "k") is not None
    (art.path / "trajectories.jsonl").write_bytes(rows[:12])  # cut mid-line
    with pytest.raises(CorruptArtifact, match=r"artifact s/k is corrupt: trajectories.jsonl has 12 bytes.*rm -r"):
        cache.lookup("s", "k")
    with pytest.raises(CorruptArtifact):  # nothing is recomputed over it either
        cache.get_or_compute("s", "k", lambda work: pytest.fail("computed over a corrupt artifact"))


def test_same_size_garbling_and_deletion_are_caught(tmp_path):
    cache, art = _complete(tmp_path, {"adapter/adapter_model.safetensors": bytes(range(256)) * 4, "b.txt": b"x"})
    f = art.path / "adapter" / "adapter_model.safetensors"
    data = bytearray(f.read_bytes())
    data[100] ^= 0xFF
    f.write_bytes(bytes(data))
    with pytest.raises(CorruptArtifact, match="adapter/adapter_model.safetensors differs from its recorded sha256"):
        cache.lookup("s", "k")
    f.unlink()
    with pytest.raises(CorruptArtifact, match="is missing"):
        cache.lookup("s", "k")


def test_large_files_are_hashed_on_full_verify_only(tmp_path, monkeypatch):
    import tracekit.artifacts as artifacts

    cache, art = _complete(tmp_path, {"big.bin": b"a" * 64})
    monkeypatch.setattr(artifacts, "HASH_ALWAYS_BYTES", 16)
    (art.path / "big.bin").write_bytes(b"b" * 64)
    assert cache.lookup("s", "k") is not None  # size and rows only
    monkeypatch.setenv("TRACEKIT_VERIFY", "full")
    with pytest.raises(CorruptArtifact, match="sha256"):
        cache.lookup("s", "k")


def test_a_file_the_manifest_does_not_list_is_corrupt(tmp_path):
    cache, art = _complete(tmp_path, {"a.txt": b"a", "adapter/w.bin": b"w"})
    (art.path / "adapter" / "extra.bin").write_bytes(b"planted")
    with pytest.raises(CorruptArtifact, match=r"artifact s/k is corrupt: adapter/extra.bin is not in its manifest.*"
                                              rf"recompute: rm -r {art.path}$"):
        cache.lookup("s", "k")
    (art.path / "b.txt").write_bytes(b"")
    with pytest.raises(CorruptArtifact, match=r"adapter/extra.bin \(and 1 more\) is not in its manifest"):
        cache.lookup("s", "k")
    (art.path / "adapter" / "extra.bin").unlink()
    (art.path / "b.txt").unlink()
    (art.path / "empty_dir").mkdir()  # a directory holds no data: not a stray file
    assert cache.lookup("s", "k") is not None


def test_an_artifact_without_a_manifest_is_not_trusted(tmp_path):
    path = tmp_path / "cache" / "s" / "k"
    path.mkdir(parents=True)
    atomic_write_json(path / COMPLETE, {"stage": "s", "key": "k", "content_key": "k"})
    with pytest.raises(CorruptArtifact, match="has no manifest"):
        StageCache(tmp_path / "cache").lookup("s", "k")


def test_temp_leftovers_of_a_killed_write_are_not_part_of_an_artifact(tmp_path):
    def compute(work):
        (work / "adapter").mkdir()
        (work / "adapter" / "w.bin").write_bytes(b"w")
        (work / ".adapter.tmp-1a2b3c4d").mkdir()  # what a kill inside an atomic dir write leaves
        (work / ".x.json.abc.tmp").write_text("{")

    art = StageCache(tmp_path / "c").get_or_compute("s", "k", compute)
    assert sorted(p.name for p in art.path.iterdir()) == [COMPLETE, "adapter"]
    assert list(json.loads((art.path / COMPLETE).read_text())["files"]) == ["adapter/w.bin"]


# --------------------------------------------------------------------------------------------
# a cache can be copied or moved


def _ref_pipeline() -> Pipeline:
    def parent(ctx):
        sub = ctx.cache.get_or_compute("sub", f"v{ctx.cfg.x}", lambda w: write_jsonl(w / "rows.jsonl", [{"x": 1}]))
        ctx.use(sub, 0.0)
        atomic_write_json(ctx.work_dir / "ref.json", sub.ref())

    def child(ctx):
        par = ctx.inputs["parent"]
        rows = (par.resolve(json.loads((par.path / "ref.json").read_text())).path / "rows.jsonl").read_text()
        (ctx.work_dir / "n.txt").write_text(str(rows.count("\n")))

    return Pipeline([Stage("parent", reads=("x",), inputs=(), compute=parent),
                     Stage("child", reads=(), inputs=("parent",), compute=child)])


def test_a_moved_cache_is_a_full_hit_and_reads_its_own_files(tmp_path):
    cfg = OmegaConf.create({"seed": 0, "x": 1})
    for d in ("r1", "r2"):
        (tmp_path / d).mkdir()
    _ref_pipeline().run(cfg, ["child"], StageCache(tmp_path / "a"), RunRecord(tmp_path / "r1"))
    assert str(tmp_path / "a") not in "".join(p.read_text() for p in (tmp_path / "a").rglob("*.json"))
    shutil.move(tmp_path / "a", tmp_path / "b")
    record = RunRecord(tmp_path / "r2")
    out = _ref_pipeline().run(cfg, ["child"], StageCache(tmp_path / "b"), record)
    assert all(a["cache_hit"] for a in record.artifacts.values()) and "sub/v1" in record.artifacts
    assert (out["child"].path / "n.txt").read_text() == "1"
    shutil.rmtree(tmp_path / "b" / "sub")  # a sub-artifact that is gone: its parent makes it again, the rest is reused
    record = RunRecord(tmp_path / "r2")
    assert _ref_pipeline().to_compute(cfg, ["child"], StageCache(tmp_path / "b")) == ["parent", "child"]
    _ref_pipeline().run(cfg, ["child"], StageCache(tmp_path / "b"), record)
    assert {k: a["cache_hit"] for k, a in record.artifacts.items()} == {
        "sub/v1": False, "parent/" + out["parent"].key: False, "child/" + out["child"].key: True}


def _sub_pipeline(calls: list[str]) -> Pipeline:
    """A ``train``-like stage: one sub-artifact per item (``adapters/<key>``) and a file of refs to them; a
    downstream stage reads them through it."""

    def parent(ctx):
        calls.append("parent")
        refs = {}
        for item in ("a", "b"):
            def make(work, item=item):
                calls.append(f"sub:{item}")
                write_jsonl(work / "rows.jsonl", [{"item": item, "i": i} for i in range(3)])

            sub = ctx.cache.get_or_compute("sub", f"{item}{ctx.cfg.x}", make)
            ctx.use(sub, 0.0)
            refs[item] = sub.ref()
        atomic_write_json(ctx.work_dir / "refs.json", refs)

    def child(ctx):
        calls.append("child")
        par = ctx.inputs["parent"]
        refs = json.loads((par.path / "refs.json").read_text())
        (ctx.work_dir / "n.txt").write_text(str(sum(len((par.resolve(r).path / "rows.jsonl").read_text().splitlines())
                                                    for r in refs.values())))

    return Pipeline([Stage("parent", reads=("x",), inputs=(), compute=parent),
                     Stage("child", reads=(), inputs=("parent",), compute=child)])


@pytest.mark.parametrize("damage", ["truncate", "garble", "stray", "delete_file"])
def test_the_rm_a_corrupt_sub_artifact_names_recomputes_it_in_one_step(tmp_path, damage):
    cfg = OmegaConf.create({"seed": 0, "x": 1})
    cache = StageCache(tmp_path / "cache")
    calls: list[str] = []
    (tmp_path / "r").mkdir()
    first = _sub_pipeline(calls).run(cfg, ["child"], cache, RunRecord(tmp_path / "r"))
    sub = tmp_path / "cache" / "sub" / "b1"
    rows = sub / "rows.jsonl"
    if damage == "truncate":
        rows.write_bytes(rows.read_bytes()[:-5])
    elif damage == "garble":
        rows.write_bytes(rows.read_bytes().replace(b'"b"', b'"c"'))
    elif damage == "stray":
        (sub / "planted.txt").write_text("x")
    else:
        rows.unlink()
    with pytest.raises(CorruptArtifact) as e:  # named before any work, though its parent verifies
        _sub_pipeline(calls).to_compute(cfg, ["child"], cache)
    msg = str(e.value)
    assert msg.startswith("artifact sub/b1 is corrupt: ") and msg.endswith(f"; recompute: rm -r {sub}")
    shutil.rmtree(msg.rsplit("rm -r ", 1)[1])  # the one command the message names
    calls.clear()
    record = RunRecord(tmp_path / "r")
    out = _sub_pipeline(calls).run(cfg, ["child"], cache, record)
    assert calls == ["parent", "sub:b"]  # the parent again (cheap: refs), the removed sub-artifact; the rest reused
    hits = {k: a["cache_hit"] for k, a in record.artifacts.items()}
    assert hits == {"sub/a1": True, "sub/b1": False, f"parent/{out['parent'].key}": False,
                    f"child/{out['child'].key}": True}  # downstream of the parent: a hit (same key)
    assert out["parent"].key == first["parent"].key and (out["child"].path / "n.txt").read_text() == "6"
    assert _sub_pipeline(calls).to_compute(cfg, ["child"], cache) == []  # and the next run is all hits


def test_a_stale_artifact_is_replaced_and_a_kill_mid_replacement_leaves_nothing_complete(tmp_path):
    cache = StageCache(tmp_path / "c")
    cache.get_or_compute("s", "k", lambda w: (w / "v.txt").write_text("old"))
    art = cache.get_or_compute("s", "k", lambda w: (w / "v.txt").write_text("new"), stale=lambda hit: "test")
    assert not art.hit and (art.path / "v.txt").read_text() == "new" and cache.lookup("s", "k") is not None
    assert sorted(p.name for p in (tmp_path / "c" / "s").iterdir()) == ["k", "k.lock"]  # no leftovers

    def killed(work):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        cache.get_or_compute("s", "k", killed, stale=lambda hit: "test")
    assert (art.path / "v.txt").read_text() == "new" and cache.lookup("s", "k") is not None  # the old one stays
    assert (tmp_path / "c" / "s" / "k.partial").is_dir()  # and the unfinished one to resume from


# --------------------------------------------------------------------------------------------
# the smaller promises


def test_cache_files_are_shareable(tmp_path):
    old = os.umask(0o022)
    try:
        atomic_write_json(tmp_path / "x.json", {"a": 1})
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "x.json").stat().st_mode) == 0o644


def test_orphan_partial_dirs_are_cleaned_but_young_ones_resume(tmp_path):
    cache = StageCache(tmp_path)
    old, young = tmp_path / "s" / "dead.partial", tmp_path / "s" / "live.partial"
    for d in (old, young):
        d.mkdir(parents=True)
        (d / "rows.jsonl").write_text("{}\n")
    stale = time.time() - 30 * 86400
    os.utime(old / "rows.jsonl", (stale, stale))
    os.utime(old, (stale, stale))
    assert cache.clean_orphans("s") == [old]
    assert young.exists() and not old.exists()


_WAITER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from tracekit.artifacts import StageCache
    def compute(work):
        Path(sys.argv[2]).write_text("started")
        while not Path(sys.argv[3]).exists():  # holds the lock until the test releases it: an event, not a clock
            time.sleep(0.02)
        (work / "out.txt").write_text("done")
    StageCache(Path(sys.argv[1])).get_or_compute("slow", "k1", compute)
""")


def test_a_job_waiting_on_another_says_so(tmp_path):
    script = tmp_path / "w.py"
    script.write_text(_WAITER)
    flag, release, err = tmp_path / "started", tmp_path / "release", tmp_path / "second.err"
    first = procs.popen([sys.executable, str(script), str(tmp_path / "c"), str(flag), str(release)])
    second = None
    try:
        procs.wait_for_path(flag, proc=first)  # the first holds the lock, computing
        with open(err, "w") as f:
            second = procs.popen([sys.executable, str(script), str(tmp_path / "c"), str(tmp_path / "f2"), str(release)],
                                 stderr=f)
        procs.wait_for(lambda: "waiting for another job" in err.read_text(), "the second job to wait", proc=second)
        release.touch()
        assert second.wait(timeout=600) == 0 and first.wait(timeout=600) == 0
    finally:
        release.touch()
        for p in (first, second):
            if p is not None:
                p.kill()
                p.wait()
    assert "waiting for another job computing slow/k1" in err.read_text()
    assert not (tmp_path / "f2").exists()  # it waited and hit, not computed
