"""The private corpus and the public pretraining corpus never overlap.

If they did, a canary or a private function that the DP model reproduces
could have come from pretraining, and the privacy audits would be void.
"""

from __future__ import annotations

import json
import re

import pytest

from privcode.config import DataConfig
from privcode.data.demo import build_demo_corpus, collect_candidates
from privcode.data.stdlib import (
    PRIVATE_MODULES,
    iter_stdlib_files,
    private_source_files,
    public_source_files,
    stdlib_dir,
)


def _norm(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip()


@pytest.fixture(scope="module")
def public_text() -> str:
    return "\n".join(
        _norm(p.read_text(encoding="utf-8", errors="replace")) for p in public_source_files()
    )


def _top(path) -> str:
    head = path.relative_to(stdlib_dir()).parts[0]
    return head.removesuffix(".py")


def test_files_and_modules_are_disjoint():
    private, public = private_source_files(), public_source_files()
    assert len(private) > 50 and len(public) > 200
    assert set(private).isdisjoint(public)
    private_mods = {_top(p) for p in private}
    public_mods = {_top(p) for p in public}
    assert private_mods.isdisjoint(public_mods)
    assert private_mods == set(PRIVATE_MODULES)
    # together they are every eligible stdlib file: nothing is silently dropped
    assert set(private) | set(public) == {p for _, p in iter_stdlib_files()}


@pytest.mark.heavy
def test_no_private_function_appears_in_public_code(public_text):
    candidates = collect_candidates(DataConfig().max_record_bytes, include_humaneval=True)
    assert len(candidates) >= 1000
    leaked = [c.source + ":" + c.name for c in candidates if _norm(c.code) in public_text]
    assert leaked == []


def test_no_canary_value_appears_in_public_code(public_text, tmp_path):
    cfg = DataConfig()  # all 30 default canaries (45 rows: 5% of the 900 members)
    build_demo_corpus(tmp_path / "d", cfg, progress=False)
    canaries = json.loads((tmp_path / "d" / "canaries.json").read_text())["canaries"]
    assert len(canaries) == 30
    raw_public = "\n".join(
        p.read_text(encoding="utf-8", errors="replace") for p in public_source_files()
    )
    for c in canaries:
        assert c["value"] not in raw_public, c["id"]
        assert _norm(c["value"]) not in public_text, c["id"]
