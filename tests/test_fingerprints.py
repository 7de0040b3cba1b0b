"""Stage fingerprints cover exactly the config fields each stage declares it reads."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from privcode.artifacts import StageManifest
from privcode.config import load_config, section_to_dict
from privcode.pipeline.runner import fingerprint
from privcode.pipeline.stages import NONDP_TRAIN_FIELDS, STAGES, Stage

UPSTREAM = {name: StageManifest(name, f"fp-{name}", {}) for name in STAGES}


def _fps(*overrides: str) -> dict[str, str]:
    cfg = load_config(None, list(overrides))
    return {name: fingerprint(cfg, stage, UPSTREAM) for name, stage in STAGES.items()}


def _changed(*overrides: str) -> set[str]:
    base, other = _fps(), _fps(*overrides)
    return {name for name in STAGES if base[name] != other[name]}


def test_every_declaration_names_real_fields():
    cfg = load_config()
    for stage in STAGES.values():
        read = stage.config_read(cfg)
        assert read, stage.name
        for section, values in read.items():
            assert set(values) <= set(section_to_dict(cfg.section(section))), stage.name


def test_a_whole_section_reads_as_section_to_dict():
    cfg = load_config()
    read = STAGES["train"].config_read(cfg)
    assert read["train"] == section_to_dict(cfg.train)
    assert read["privacy"] == {"store_id": cfg.privacy.store_id}  # one field of a section


def test_a_typo_in_a_declaration_is_an_error():
    class Typo(Stage):
        name = "typo"
        sections = ("train.lerning_rate",)

    with pytest.raises(ValueError, match="train.lerning_rate.*names no field"):
        Typo.config_read(load_config())


def test_probe_settings_do_not_retrain_the_nondp_comparison():
    # audit.probe_questions is read by the audit stage only, not by the 6-minute comparison.
    assert _changed("audit.probe_questions=7") == {"audit"}


def test_the_junior_learning_rate_does_not_retrain_the_pac_worlds():
    changed = _changed("train.lr=0.003")
    assert "pac" not in changed
    # The comparison defaults to train.lr (audit.nondp_lr 0), so it does retrain.
    assert {"train", "nondp", "audit"} <= changed


def test_the_junior_method_retrains_neither_comparison_nor_worlds():
    assert _changed("train.method=dpft") == {"train"}


def test_the_comparison_settings_retrain_the_comparison():
    assert _changed("audit.nondp_steps=5") == {"nondp", "audit"}
    assert _changed("audit.nondp_cpus=1") == {"audit"}  # scheduling only: not the comparison
    assert _changed("pac.worlds=4") == {"pac"}


def test_the_report_reads_the_run_name_and_reports_dir_only():
    assert "report" in _changed("run.reports_dir=/tmp/elsewhere")
    assert "report" not in _changed("run.parallel=false")


def test_the_nondp_declaration_covers_what_its_code_reads():
    """Every ``cfg.train.X`` in train/nondp.py is declared (a new read cannot be missed)."""
    import privcode.train.nondp as nondp

    tree = ast.parse(Path(nondp.__file__).read_text(encoding="utf-8"))
    read = {
        node.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Attribute)
        and node.value.attr == "train"
        and isinstance(node.value.value, ast.Name)
        and node.value.value.id == "cfg"
    }
    assert read, "the scan found no cfg.train reads: has the module changed shape?"
    declared = {entry.split(".", 1)[1] for entry in NONDP_TRAIN_FIELDS}
    assert read <= declared, sorted(read - declared)
    # build_objective for nondpft reads the seed (replaced by audit.seed) and the LoRA shape.
    assert {"lora_r", "lora_alpha", "lora_dropout"} <= declared


def test_every_stage_comes_after_the_stages_it_reads_in_the_table():
    """`privcode report` finds its inputs current in table order: a stage listed before one
    of its optional inputs (eval before nondp) would get a fingerprint without it and drop
    out of the re-rendered report."""
    from privcode.pipeline.stages import STAGES

    order = list(STAGES)
    for name, stage in STAGES.items():
        for dep in (*stage.needs, *stage.after):
            assert order.index(dep) < order.index(name), (name, dep)
