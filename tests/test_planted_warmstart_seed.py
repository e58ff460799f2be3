"""A world-tokenizer backbone's initial weights are part of the training seed (issue 42): ``backbone.planted.init_seed``
re-seeds them and moves the warm start's key; unset, the key is every earlier warm start's."""

from __future__ import annotations

import dataclasses

import pytest

from tracekit.llm.backbones import get_spec
from tracekit.planted.gain import init_seed
from tracekit.warmstart.planted import PlantedSpec, initial_base, planted_key


def _spec(**kw) -> PlantedSpec:
    return PlantedSpec(strong=["lookup_by_name"], weak=["refuse_locked"], family="micro", **kw)


def test_init_seed_reseeds_the_micro_backbone_and_moves_only_its_own_key():
    base = dataclasses.replace(get_spec("micro"), planted=None)
    unset, zero, one = _spec(), _spec(init_seed=0), _spec(init_seed=1)
    assert initial_base(unset, base).seed == base.seed == 0 and initial_base(one, base).seed == 1
    assert planted_key(unset, base) != planted_key(one, base)
    assert planted_key(zero, base) != planted_key(unset, base)  # set is set: the key says so, even at 0
    assert planted_key(_spec(seed=1), base) != planted_key(unset, base)


def test_init_seed_is_refused_for_a_backbone_with_its_own_weights():
    base = dataclasses.replace(get_spec("smollm2_135m"), planted=None)
    with pytest.raises(ValueError, match="only a world-tokenizer backbone is initialized by the warm start"):
        initial_base(_spec(init_seed=1), base)


def test_the_gain_runner_reseeds_initial_weights_of_world_backbones_only():
    assert init_seed(["experiment=micro"], 0) == []  # seed 0 keeps every earlier run's keys
    assert init_seed(["experiment=micro"], 2) == ["+backbone.planted.init_seed=2"]
    assert init_seed(["experiment=planted"], 2) == []  # SmolLM2 brings its own weights
