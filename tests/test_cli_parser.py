"""The ``privcode`` parser: one ``add_<command>_parser`` per command, every option kept.

Issue 44 point 4 split ``build_parser`` into one function per command. These tests
pin what users see: the commands in help order, each command's options and
defaults, a handler on every leaf, and a parser built without torch or Ray.
"""

from __future__ import annotations

import argparse
import inspect
import subprocess
import sys

import pytest

from privcode import cli

COMMANDS = (
    "run plan config data base train synthesize premium serve audit pac report study "
    "sandbox eval dp budget operator cluster submit"
).split()

#: The commands privcode/cli.py defines itself: each has its own add_<command>_parser.
OWN = ("run plan config data base train synthesize premium audit pac report study "
       "cluster submit").split()  # fmt: skip

#: (command path) -> option strings of that parser, --help excluded.
OPTIONS = {
    ("run",): {"--config", "--set", "--stages", "--json"},
    ("plan",): {"--config", "--set", "--stages", "--records", "--node", "--address", "--json"},
    ("config", "show"): {"--config", "--set"},
    ("data", "demo"): {"--out", "--seed", "--size", "--json", "--config", "--set"},
    ("data", "validate"): {"--max-record-bytes"},
    ("base", "build"): {"--preset", "--seed", "--out", "--json", "--config", "--set"},
    ("train",): {"--config", "--set", "--method", "--json"},
    ("synthesize",): {"--config", "--set", "--release", "--num-samples", "--json"},
    ("premium",): {"--config", "--set", "--model", "--data", "--json"},
    ("audit",): {"--config", "--set", "--json"},
    ("pac",): {"--config", "--set", "--json"},
    ("report",): {"--config", "--set", "--json"},
    ("study",): {"--config", "--set", "--runs", "--out", "--notes", "--reference"},
    ("cluster",): {"--port", "--dashboard-port", "--num-cpus", "--json"},
    ("submit",): {
        "--config", "--set", "--target", "--address", "--stages", "--namespace", "--release",
        "--values", "--context", "--crds", "--data-claim", "--data-path", "--no-wait", "--json",
    },
}  # fmt: skip


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _walk(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    yield path, parser
    for name, child in _subparsers(parser).items():
        yield from _walk(child, (*path, name))


@pytest.fixture(scope="module")
def parsers() -> dict[tuple[str, ...], argparse.ArgumentParser]:
    return dict(_walk(cli.build_parser()))


def _options(parser: argparse.ArgumentParser) -> set[str]:
    return {o for a in parser._actions for o in a.option_strings} - {"-h", "--help"}


def test_every_command_in_help_order(parsers):
    assert list(_subparsers(parsers[()])) == COMMANDS
    assert list(_subparsers(parsers[("audit",)])) == ["probe"]
    assert list(_subparsers(parsers[("data",)])) == ["demo", "ingest", "validate"]


def test_each_command_keeps_its_options(parsers):
    for path, expected in OPTIONS.items():
        assert _options(parsers[path]) == expected, path


def test_defaults_are_unchanged(parsers):
    def defaults(path, *argv):
        return vars(parsers[()].parse_args([*path, *argv]))

    assert defaults(("run",))["config"] == "jobs/configs/demo.yaml"
    assert defaults(("config", "show"))["config"] is None
    assert defaults(("data", "validate"), "f.jsonl")["max_record_bytes"] == 65_536
    c = defaults(("cluster",), "up")
    assert (c["port"], c["dashboard_port"], c["num_cpus"]) == (6379, 8265, None)
    s = defaults(("submit",))
    assert (s["target"], s["release"], s["values"], s["no_wait"]) == (
        "local",
        "privcode",
        [],
        False,
    )
    st = defaults(("study",), "--runs", "a", "b")
    assert (st["runs"], st["out"], st["notes"]) == (["a", "b"], "docs/results.md", "")
    assert defaults(("synthesize",), "--num-samples", "7")["num_samples"] == 7
    assert defaults(("plan",), "--node", "CPU=8", "--node", "GPU=1")["node"] == ["CPU=8", "GPU=1"]
    with pytest.raises(SystemExit):
        parsers[()].parse_args(["base", "build", "--preset", "huge"])


def test_every_leaf_has_a_handler(parsers):
    for path, parser in parsers.items():
        if (path and not _subparsers(parser)) or path == ("audit",):
            assert callable(parser.get_default("func")), path
    assert parsers[("run",)].get_default("func") is cli.cmd_run
    assert parsers[("audit",)].get_default("func") is cli.cmd_audit
    assert parsers[("audit", "probe")].get_default("func").__name__ == "cmd_audit_probe"


def test_build_parser_only_wires_one_function_per_command():
    for name in OWN:
        add = getattr(cli, f"add_{name}_parser")
        sub = argparse.ArgumentParser().add_subparsers()
        add(sub)
        assert list(sub.choices) == [name], name
        assert len(inspect.getsource(add).splitlines()) <= 50, name
    assert len(inspect.getsource(cli.build_parser).splitlines()) <= 40


def test_help_imports_neither_torch_nor_ray():
    code = (
        "import sys\nfrom privcode.cli import build_parser\nbuild_parser().format_help()\n"
        "print(sorted(m for m in ('torch', 'ray', 'transformers', 'pyarrow', 'requests') "
        "if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
