"""Config loading: errors name the key and the file; overrides; every field has help."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from privcode.cli import main
from privcode.config import SECTIONS, ConfigError, load_config

REPO = Path(__file__).resolve().parents[1]


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "cfg.yaml"
    path.write_text(text)
    return path


def test_shipped_configs_load():
    for path in sorted((REPO / "jobs" / "configs").glob("*.yaml")):
        cfg = load_config(path)
        assert cfg.run.stages, path
        assert cfg.source == str(path)


def test_defaults_and_values(tmp_path):
    cfg = load_config(write(tmp_path, "data:\n  size: 123\n  canary_repetitions: [1, 2]\n"))
    assert cfg.data.size == 123
    assert cfg.data.canary_repetitions == (1, 2)  # lists become tuples: frozen all the way
    assert cfg.base.preset == "demo"
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.data.size = 5  # type: ignore[misc]


def test_int_is_accepted_for_float(tmp_path):
    assert load_config(write(tmp_path, "data:\n  pii_fraction: 1\n")).data.pii_fraction == 1.0


@pytest.mark.parametrize(
    ("text", "needles"),
    [
        ("data:\n  sise: 10\n", ["data.sise", "unknown key", "cfg.yaml"]),
        ("dat:\n  size: 10\n", ["unknown section 'dat'", "cfg.yaml"]),
        ("data:\n  size: ten\n", ["data.size", "expected int", "cfg.yaml"]),
        ("data:\n  size: 1.5\n", ["data.size", "expected int"]),
        ("data:\n  include_humaneval: 1\n", ["data.include_humaneval", "expected bool"]),
        ("data:\n  size: -3\n", ["data.size", "below the minimum 10"]),
        ("data:\n  pii_fraction: 1.5\n", ["data.pii_fraction", "above the maximum 1.0"]),
        ("data:\n  canary_kinds: [email, phone]\n", ["data.canary_kinds", "'phone' is not one of"]),
        (
            "data:\n  canary_repetitions: [5, 0]\n",
            ["data.canary_repetitions", "below the minimum 1"],
        ),
        ("data:\n  canary_repetitions: 5\n", ["data.canary_repetitions", "expected list of int"]),
        ("base:\n  preset: huge\n", ["base.preset", "'huge' is not one of"]),
        ("run:\n  stages: [data, nope]\n", ["run.stages", "unknown stage 'nope'"]),
        ("run:\n  stages: []\n", ["run.stages", "at least 1"]),
        ("run:\n  name: 'a b/c'\n", ["run.name", "does not match"]),
        ("data: 5\n", ["section 'data' must be a mapping"]),
        ("- a\n- b\n", ["top level must be a mapping"]),
        ("data: [\n", ["invalid YAML"]),
        (
            "train:\n  num_workers: 0\n  use_gpu: true\n",
            ["train.use_gpu", "needs num_workers >= 1", "local mode"],
        ),
        (
            "premium:\n  num_workers: 0\n  deepspeed: zero2\n",
            ["premium.deepspeed", "needs num_workers >= 1"],
        ),
    ],
)
def test_errors_name_key_and_file(tmp_path, text, needles):
    with pytest.raises(ConfigError) as err:
        load_config(write(tmp_path, text))
    for needle in needles:
        assert needle in str(err.value), (needle, str(err.value))


def test_missing_file():
    with pytest.raises(ConfigError, match="nope.yaml: config file not found"):
        load_config("nope.yaml")


def test_overrides(tmp_path):
    path = write(tmp_path, "data:\n  size: 50\n")
    cfg = load_config(
        path, ["data.size=77", "base.preset=ci", "run.stages=[data]", "data.canary_repetitions=[3]"]
    )
    assert (cfg.data.size, cfg.base.preset, cfg.run.stages) == (77, "ci", ("data",))
    assert cfg.data.canary_repetitions == (3,)
    with pytest.raises(ConfigError, match=r"with --set overrides\): data.size: expected int"):
        load_config(path, ["data.size=abc"])
    with pytest.raises(ConfigError, match="expected SECTION.KEY=VALUE"):
        load_config(path, ["size=3"])
    with pytest.raises(ConfigError, match="unknown key 'data.nope'"):
        load_config(path, ["data.nope=1"])


def test_every_field_has_help():
    for name, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            assert len(f.metadata.get("help", "")) > 10, f"{name}.{f.name} has no help text"


def test_cli_reports_config_error(tmp_path, capsys):
    path = write(tmp_path, "data:\n  size: -1\n")
    assert main(["config", "show", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert "data.size" in err and "cfg.yaml" in err


def test_cli_config_show_lists_help(capsys):
    assert main(["config", "show"]) == 0
    out = capsys.readouterr().out
    for name in SECTIONS:
        assert f"[{name}]" in out
    assert "canary_repetitions" in out
