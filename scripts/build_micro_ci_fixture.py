"""Write the micro backbone's warm start into ``tests/assets/micro_warmstart/`` for the CI learning test (issue 42).

The CI learning test (``tests/test_micro_learning.py``) must run in <= 90 s on 2 cores, and the micro backbone's
warm start takes ~5-6 minutes there, so the test starts from this copy of it: the ``experiment=micro`` warm start
(built by the planted warm-start stage, or taken from its cache), its weights stored in bfloat16 (8.9 MB) and read
back as float32, with its tokenizer and ``identity.json`` (the warm start's cache key and the sha256 of the weights
file). The test refuses a copy whose key is not the current ``experiment=micro`` warm start's, naming this script,
so the fixture cannot drift from the world and backbone it stands for.

    python scripts/build_micro_ci_fixture.py            # ~6 min on 2 cores when the warm start is not cached
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

FIXTURE = ROOT / "tests" / "assets" / "micro_warmstart"
KEEP = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def current_key(overrides: list[str] | None = None) -> tuple[object, str]:
    """(backbone spec, planted key) of the ``experiment=micro`` warm start."""
    from tracekit.cli import compose_config
    from tracekit.llm.backbones import get_spec
    from tracekit.warmstart.planted import PlantedSpec, planted_key
    from tracekit.wiring import backbone_dict

    cfg = compose_config(["experiment=micro", *(overrides or [])])
    spec = get_spec(backbone_dict(cfg))
    return spec, planted_key(PlantedSpec.from_config(spec.planted), dataclasses.replace(spec, planted=None))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=FIXTURE)
    a = p.parse_args(argv)
    import torch
    from safetensors.torch import load_file, save_file

    from tracekit.artifacts import atomic_write_json, file_sha256
    from tracekit.warmstart.planted import planted_dir

    spec, key = current_key()
    src = planted_dir(spec, "cpu") / "model"
    tmp = a.out.with_name(a.out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for name in KEEP:
        if (src / name).is_file():
            shutil.copy2(src / name, tmp / name)
    weights = {k: v.to(torch.bfloat16).contiguous() for k, v in load_file(src / "model.safetensors").items()}
    save_file(weights, tmp / "model.safetensors", metadata={"format": "pt"})
    atomic_write_json(tmp / "identity.json", {"planted_key": key,
                                              "weights_sha256": file_sha256(tmp / "model.safetensors"),
                                              "dtype": "bfloat16"})
    shutil.rmtree(a.out, ignore_errors=True)
    tmp.rename(a.out)
    print(f"wrote {a.out} (warm start {key}, {(a.out / 'model.safetensors').stat().st_size / 1e6:.1f} MB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
