"""The registry's names are the implementations' names, and config validates against them."""

from __future__ import annotations

import subprocess
import sys

import pytest

from privcode import registry
from privcode.config import EvalConfig, TrainConfig, load_config
from privcode.errors import ConfigError


def test_every_implementation_table_is_keyed_by_the_registry_names():
    from privcode.artifacts.junior import METHOD_CONDITIONING
    from privcode.dp.accounting import ACCOUNTANTS
    from privcode.dp.dpsgd import GRAD_SAMPLE_MODES
    from privcode.eval.benchmarks import BENCHMARKS
    from privcode.pipeline.stages import STAGES
    from privcode.train import methods

    assert tuple(ACCOUNTANTS) == registry.ACCOUNTANTS
    assert GRAD_SAMPLE_MODES is registry.GRAD_SAMPLE_MODES
    assert tuple(BENCHMARKS) == registry.BENCHMARKS
    assert tuple(STAGES) == registry.STAGES
    from privcode.audit.probe.taxonomy import SCENARIOS, attributes_for_scenario

    assert SCENARIOS is registry.SCENARIOS and all(attributes_for_scenario(s) for s in SCENARIOS)
    assert methods.METHODS is registry.METHODS and methods.Method is registry.Method
    assert METHOD_CONDITIONING == {
        "privcode": "prompt",
        "privcode-nonast": "prompt",
        "privcode-stableast": "prompt",
        "dpft": "prompt",
        "nondpft": "prompt",
        "privcode++": "latent",
        "privcode++-noalign": "latent",
        "pc-promptemb": "latent",
        "pc-preemb": "latent",
        "pc-uncond": "none",
    }
    assert [m for m, e in registry.METHODS.items() if not e.dp] == ["nondpft"]


def test_config_choices_come_from_the_registry():
    for value in registry.METHODS:
        assert TrainConfig(method=value, allow_non_private=value == "nondpft").method == value
    for value in registry.ACCOUNTANTS:
        assert TrainConfig(accountant=value).accountant == value
    for value in registry.GRAD_SAMPLE_MODES:
        assert TrainConfig(grad_sample_mode=value).grad_sample_mode == value
    for value in registry.BENCHMARKS:
        assert EvalConfig(benchmark=value).benchmark == value
    with pytest.raises(ConfigError, match=r"train.method.*'privcode\+\+\+' is not one of"):
        load_config(overrides=["train.method=privcode+++"])
    with pytest.raises(ValueError, match="unknown training method 'x' .known: privcode, "):
        registry.get_method("x")


def test_the_registry_and_config_import_neither_torch_nor_ray_nor_the_pipeline():
    code = (
        "import sys, privcode.registry, privcode.config; "
        "bad = [m for m in ('torch', 'ray', 'privcode.pipeline.stages', 'transformers') "
        "if m in sys.modules]; print(bad)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert out == "[]"
