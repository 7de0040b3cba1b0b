"""One store per run, resolved once by the driver (issue 41, point 3).

* the environment and the config naming two different stores is an error;
* the driver pins the absolute paths, the store and its keyed id into the config every
  task gets, and a task that finds another store refuses to charge it;
* the store id enters the fingerprints of the stages that charge the store (its path
  does not), the ingested corpus's manifest and the release;
* a corpus ingested under one store is refused under another.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import init_store

from privcode.config import load_config
from privcode.data.ingest.corpus import IngestSpec, build_ingested_corpus
from privcode.errors import BudgetRefused
from privcode.pipeline.runner import fingerprint, pin_locations
from privcode.pipeline.stages import STAGES
from privcode.privacy.admission import check_corpus_store
from privcode.privacy.store import (
    ENV_VAR,
    PrivacyStore,
    StoreError,
    StoreIntegrityError,
    open_pinned,
    resolve_store,
)

DEMO = Path(__file__).resolve().parents[1] / "jobs" / "configs" / "demo.yaml"


def test_env_and_config_naming_two_stores_is_an_error(tmp_path, monkeypatch):
    a, b = tmp_path / "a", tmp_path / "b"
    monkeypatch.setenv(ENV_VAR, str(a))
    assert resolve_store("") == a and resolve_store(str(a)) == a
    with pytest.raises(StoreError, match="two privacy stores named"):
        resolve_store(str(b))
    monkeypatch.delenv(ENV_VAR)
    assert resolve_store(str(b)) == b


def test_the_driver_pins_paths_and_the_store_id(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    store = PrivacyStore(init_store(tmp_path / "store"))
    cfg = load_config(DEMO, ["run.out_dir=runs", "privacy.store=store"])
    pinned = pin_locations(cfg)
    assert pinned.run.out_dir == str(tmp_path / "runs")
    assert Path(pinned.base.cache_dir).is_absolute()
    assert pinned.privacy.store == str(store.root.resolve())
    assert pinned.privacy.store_id == store.store_id
    # A task whose environment names another store (exported after the cluster started)
    # refuses to charge it; the pinned store opens.
    other = PrivacyStore(init_store(tmp_path / "other"))
    monkeypatch.setenv(ENV_VAR, str(other.root))
    with pytest.raises(StoreError):
        open_pinned(pinned.privacy.store, pinned.privacy.store_id)
    monkeypatch.delenv(ENV_VAR)
    assert open_pinned(pinned.privacy.store, pinned.privacy.store_id).store_id == store.store_id
    # Another store at the pinned path (wiped and made again): another id, refused.
    with pytest.raises(StoreIntegrityError, match="admitted against store"):
        open_pinned(other.root, store.store_id)
    with pytest.raises(StoreIntegrityError):
        pin_locations(
            load_config(DEMO, [f"privacy.store={other.root}", f"privacy.store_id={store.store_id}"])
        )
    # No store yet: pinned by path only; the stages that charge it say `budget init`.
    bare = pin_locations(load_config(DEMO, [f"privacy.store={tmp_path / 'none'}"]))
    assert bare.privacy.store_id == "" and bare.privacy.store == str(tmp_path / "none")


def test_store_id_enters_the_charging_stages_fingerprints_not_its_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)

    def chain(*overrides):
        cfg = load_config(DEMO, list(overrides))
        known = {}
        for name, stage in STAGES.items():
            from privcode.artifacts import StageManifest

            known[name] = StageManifest(name, fingerprint(cfg, stage, known), {})
        return {n: m.fingerprint for n, m in known.items()}

    here = chain("privacy.store_id=aaaa", "privacy.store=one")
    moved = chain("privacy.store_id=aaaa", f"privacy.store={tmp_path}/elsewhere")
    other = chain("privacy.store_id=bbbb", "privacy.store=one")
    assert here == moved  # the path alone changes nothing
    changed = {n for n in here if here[n] != other[n]}
    assert {"data", "train", "audit", "pac"} <= changed
    assert "base" not in changed  # the public base has nothing of the store


def _repo(root: Path) -> Path:
    root.mkdir()
    for i in range(12):
        (root / f"m{i}.py").write_text(
            "".join(
                f"def f{i}_{j}(x):\n    y = x * {j} + {i}\n    z = y - {j}\n    return z + y\n\n"
                for j in range(3)
            )
        )
    return root


def test_a_corpus_ingested_under_one_store_is_refused_under_another(tmp_path):
    from privcode.config import PrivacyConfig
    from privcode.data.ingest.cli import split_key

    one = PrivacyStore(init_store(tmp_path / "one"))
    two = PrivacyStore(init_store(tmp_path / "two"))
    key, sid = split_key(PrivacyConfig(store=str(one.root)))
    assert sid == one.store_id
    spec = IngestSpec(inputs=(str(_repo(tmp_path / "repo")),), min_lines=1)
    manifest = build_ingested_corpus(spec, tmp_path / "c", split_key=key, store_id=sid)
    assert manifest["store_id"] == one.store_id
    data = tmp_path / "c" / "train.parquet"
    check_corpus_store(data, one)  # its own store: fine
    with pytest.raises(BudgetRefused, match=f"ingested under privacy store {one.store_id}"):
        check_corpus_store(data, two)
    loose = tmp_path / "loose" / "train.jsonl"  # a file without a manifest: nothing to check
    loose.parent.mkdir()
    loose.write_text('{"id": "1", "prompt": "p", "code": "c"}\n')
    check_corpus_store(loose, two)
