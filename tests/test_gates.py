"""CI gates that cannot hide a failure (issue 44 point 5, tests/gates.py).

Without its prerequisite a test skips on a developer's machine; with the matching
``PRIVCODE_REQUIRE_*=1`` (set by .ci/run) it fails instead, naming what is missing.
"""

from __future__ import annotations

from pathlib import Path

import chart_support
import pytest
from gates import REQUIRE_CRDS, REQUIRE_HELM, REQUIRE_SANDBOX, require_or_skip

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("env", [REQUIRE_SANDBOX, REQUIRE_CRDS, REQUIRE_HELM])
def test_skips_unless_required_then_fails_naming_the_variable(monkeypatch, env):
    for unset in ("0", None):
        if unset is None:
            monkeypatch.delenv(env, raising=False)
        else:
            monkeypatch.setenv(env, unset)
        with pytest.raises(pytest.skip.Exception, match="no sandbox here"):
            require_or_skip(env, "no sandbox here")
    monkeypatch.setenv(env, "1")
    with pytest.raises(pytest.fail.Exception, match=rf"no sandbox here \({env}=1: required here\)"):
        require_or_skip(env, "no sandbox here")


def test_missing_crds_fail_when_required(monkeypatch, tmp_path):
    monkeypatch.setattr(chart_support, "CRDS", tmp_path / "absent")
    monkeypatch.delenv(REQUIRE_CRDS, raising=False)
    with pytest.raises(pytest.skip.Exception, match="KubeRay CRDs not found at .*absent"):
        chart_support.require_crds()
    monkeypatch.setenv(REQUIRE_CRDS, "1")
    with pytest.raises(pytest.fail.Exception, match="KubeRay CRDs not found"):
        chart_support.require_crds()


def test_ci_requires_every_gate():
    text = (ROOT / ".ci" / "run").read_text()
    exports = text[: text.index("make test")]
    for env in (REQUIRE_HELM, REQUIRE_CRDS, REQUIRE_SANDBOX):
        assert f"export {env}=1\n" in exports, env
