"""Shared pytest fixtures: one real local Ray head per test session.

``ray_cluster`` (session scope) starts a Ray head with
:func:`privcode.cluster.local.start_head` on free ports of 127.0.0.1 (never
6379/8265, so a developer's own head is left alone), with token auth on and
its own token file and temp dir.  Only sessions that run a test using the
fixture start Ray; such tests are marked ``ray`` automatically, so
``pytest -m "not ray"`` skips them.

Tiers (markers, applied here from the fixtures a test uses, or by hand):
``ray`` (the session Ray head), ``model`` (builds or trains a model: the
ci base and everything built on it), ``chart`` (renders the Helm chart with
the helm binary), and ``heavy`` (pure but seconds long; set by hand).
``make test-fast`` runs what is none of these (nor ``slow``/``gpu``): pure
unit tests, about a minute.

While the head is up the test process has, in its environment:

* ``RAY_AUTH_MODE=token`` and ``RAY_AUTH_TOKEN_PATH`` (the session token;
  a ``RAY_AUTH_TOKEN`` already set takes precedence and is used instead),
* ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` (the driver addresses 127.0.0.1),
* ``RAY_ADDRESS`` = the head's GCS address,

so ``ray.init()``, ``ray.init(address=cluster.address)``,
``privcode.cluster.local.connect()`` and ``privcode.cluster.jobs`` calls
without an address all reach this head.  It also has
``RAY_TRAIN_HEALTH_CHECK_INTERVAL_S=0.5`` (unless set; the head's tasks and
the bench/ subprocesses inherit it): Ray Train's controller polls its workers
every 0.5 s instead of 2 s, so the end of a run, and a checkpoint report
(which waits until the previous one is collected), is noticed sooner: a few
seconds less per Ray Train run.  A late answer is no failure (Ray Train waits
10 minutes for a hanging poll).  ``ray_connected`` calls ``connect``
once per session and yields its result.

At session end the driver is shut down, the head's processes are stopped
(only this head's: :func:`privcode.cluster.local.stop_head` by port), the
environment is restored and the temp dir removed; leftover processes fail
the run loudly.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

# The privcode process environment for the whole session, as its drivers set it (before
# torch loads): Ray telemetry off (Ray Data's driver-side poller would otherwise log a
# formatted traceback every 10 s from a thread) and passive OpenMP waits (fast beside a busy
# process). privcode.cluster.ray_env imports neither torch nor ray.
from privcode.cluster.ray_env import apply_process_env  # noqa: E402

apply_process_env()

RAY_FIXTURES = frozenset({"ray_cluster", "ray_connected"})
MODEL_FIXTURES = frozenset({"ci_base_cache", "embedding", "minilm"})  # + the embedding model
CHART_FIXTURES = frozenset({"helm"})
_TRAIN_POLL_ENV = "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"
_ENV_KEYS = (
    "RAY_ADDRESS",
    "RAY_AUTH_MODE",
    "RAY_AUTH_TOKEN_PATH",
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER",
    "RAY_API_SERVER_ADDRESS",
    _TRAIN_POLL_ENV,
)
# Ports a developer's own head uses by default; the session head avoids them.
_RESERVED_PORTS = frozenset({6379, 8265, 10001, 52365})


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        used = set(getattr(item, "fixturenames", ()))  # the transitive closure
        for fixtures, mark in (
            (RAY_FIXTURES, pytest.mark.ray),
            (MODEL_FIXTURES, pytest.mark.model),
            (CHART_FIXTURES, pytest.mark.chart),
        ):
            if fixtures & used:
                item.add_marker(mark)


@dataclass(frozen=True)
class RayCluster:
    """The session head.  Fields are also readable as ``cluster["address"]``."""

    address: str  # GCS, "127.0.0.1:PORT": for ray.init / connect
    dashboard_url: str  # "http://127.0.0.1:DPORT": the dashboard and Jobs API
    port: int
    dashboard_port: int
    temp_dir: str  # Ray's temp root for this head (short: socket paths)
    info: dict[str, Any]  # what start_head returned

    def __getitem__(self, key: str) -> Any:
        return getattr(self, key)


def _free_ports(count: int) -> list[int]:
    from privcode.cluster.local import free_port

    ports: list[int] = []
    while len(ports) < count:
        port = free_port()
        if port not in _RESERVED_PORTS and port not in ports:
            ports.append(port)
    return ports


# ----------------------------------------------------------------------- privacy stores
# A store is created only by `privcode budget init` (privcode.privacy.budget.init_store): a test
# that trains, ingests or serves PAC worlds names its own, initialised by ``init_store`` (or the
# ``privacy_store`` fixture). The session's default store location and store log (XDG dirs) are
# in a temporary directory, never the developer's home; PRIVCODE_PRIVACY_STORE and
# PRIVCODE_WIPE_LOG of the calling shell are set aside for the session.
_STORE_ENV = (
    "XDG_DATA_HOME",
    "XDG_STATE_HOME",
    "XDG_CONFIG_HOME",  # the stores' authority keys
    "PRIVCODE_PRIVACY_STORE",
    "PRIVCODE_WIPE_LOG",
)


def init_store(path: os.PathLike | str) -> Path:
    """An initialised privacy store at ``path`` (made if absent, as `make demo` does); its path."""
    from privcode.privacy.budget import init_store as init

    store, _ = init(path, if_absent=True)
    return store.root


@pytest.fixture(scope="session", autouse=True)
def _private_store_home(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The default store and the store log under a session temp dir (set before a Ray head
    starts, so its workers see the same)."""
    home = tmp_path_factory.mktemp("xdg")
    saved = {key: os.environ.pop(key, None) for key in _STORE_ENV}
    os.environ["XDG_DATA_HOME"] = str(home / "data")
    os.environ["XDG_STATE_HOME"] = str(home / "state")
    os.environ["XDG_CONFIG_HOME"] = str(home / "config")
    yield home
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture
def privacy_store(tmp_path: Path) -> Path:
    """An initialised privacy store of the test (``tmp_path/privacy-store``)."""
    return init_store(tmp_path / "privacy-store")


@pytest.fixture(scope="session")
def ray_cluster() -> RayCluster:
    from privcode.cluster import local, ray_env

    # /tmp, not pytest's tmp_path: Ray's Unix sockets live under the temp dir
    # and their paths must stay under ~107 bytes.
    base = tempfile.mkdtemp(prefix="pcray-", dir="/tmp")
    saved = {key: os.environ.get(key) for key in _ENV_KEYS}
    port, dashboard_port = _free_ports(2)
    try:
        if not os.environ.get(ray_env.TOKEN_ENV):
            os.environ[ray_env.TOKEN_PATH_ENV] = os.path.join(base, "auth_token")
        os.environ[ray_env.AUTH_MODE_ENV] = "token"
        # Before the head starts: its stage tasks inherit it, as do bench/ subprocesses;
        # Ray Train passes it from a driver to its controller and workers.
        os.environ.setdefault(_TRAIN_POLL_ENV, "0.5")
        for key in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS"):
            os.environ.pop(key, None)
        ray_env.ensure_token()
        cpus = int(os.environ.get("PRIVCODE_TEST_RAY_CPUS", "4"))
        info = local.start_head(
            port=port,
            dashboard_port=dashboard_port,
            num_cpus=cpus,
            temp_dir=os.path.join(base, "ray"),
            wait_s=120,
        )
        cluster = RayCluster(
            address=info["address"],
            dashboard_url=info["dashboard_url"],
            port=port,
            dashboard_port=dashboard_port,
            temp_dir=info["temp_dir"],
            info=info,
        )
        os.environ["RAY_ADDRESS"] = cluster.address
        ray_env.prepare_driver_env(loopback=True)
        yield cluster
    finally:
        _teardown(local, port, base, saved)


def _teardown(local: Any, port: int, base: str, saved: dict[str, str | None]) -> None:
    if "ray" in sys.modules:
        import ray

        if ray.is_initialized():
            ray.shutdown()
    before = local.head_processes(port)
    local.stop_head(port)
    leftovers = [p.pid for p in before if p.is_running()]
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    shutil.rmtree(base, ignore_errors=True)
    assert not leftovers, f"Ray head on port {port} left processes behind: {leftovers}"


@pytest.fixture(scope="session")
def ray_connected(ray_cluster: RayCluster) -> dict[str, Any]:
    """``privcode.cluster.local.connect`` to the session head, once per session."""
    import ray

    from privcode.cluster import local

    if ray.is_initialized() and ray.get_runtime_context().gcs_address != ray_cluster.address:
        ray.shutdown()  # an earlier test started its own cluster; join the session head
    info = local.connect(ray_cluster.address)
    yield info
    if ray.is_initialized():
        ray.shutdown()


@pytest.fixture(autouse=True)
def _stop_store_ledgers(request: pytest.FixtureRequest) -> Any:
    """After a Ray test, stop the privacy-store ledger actors it started (one process each).

    Safe: a ledger rebuilds from its store on the next open, and each pytest worker has
    its own Ray head.
    """
    yield
    if "ray_connected" not in request.fixturenames or "ray" not in sys.modules:
        return
    import ray

    if not ray.is_initialized():
        return
    for actor in ray.util.list_named_actors(all_namespaces=True):
        if actor["name"].startswith("privcode-store:"):
            with contextlib.suppress(Exception):
                ray.kill(ray.get_actor(actor["name"], namespace=actor["namespace"]))


@pytest.fixture(scope="session")
def serve_http(ray_connected: dict[str, Any]) -> str:
    """Ray Serve on the session head, once per session: its HTTP proxy's base URL
    (``http://127.0.0.1:PORT``). Tests ``serve.run`` their app under their own name and
    route prefix and ``serve.delete`` it when done; Serve is shut down at session end."""
    from ray import serve

    from privcode.cluster.local import free_port

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()


@pytest.fixture(scope="session")
def ci_base_cache(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A base-model cache dir holding the ``ci`` preset, built once per session.

    Tests that need a trained public base model point ``base.cache_dir`` here
    (``build_base`` then answers from the cache) instead of training again.
    """
    from privcode.config import BaseConfig
    from privcode.models.base import build_base

    cache = tmp_path_factory.mktemp("base-cache")
    build_base(BaseConfig(preset="ci", cache_dir=str(cache)), progress=False)
    return str(cache)


@pytest.fixture(scope="session")
def ci_model(ci_base_cache: str) -> str:
    """The ci base model's directory (from ``ci_base_cache``)."""
    from privcode.config import BaseConfig
    from privcode.models.base import build_base

    return build_base(BaseConfig(preset="ci", cache_dir=ci_base_cache), progress=False)["path"]


@pytest.fixture(scope="session")
def ci_release(ci_model: str, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A privcode++-format release of the ci base: LoRA r=2 + a prefix decoder (dz 8, K 2)."""
    import torch

    from privcode.models.loading import attach_lora, load_causal_lm
    from privcode.train.release import write_release

    work = tmp_path_factory.mktemp("release")
    torch.manual_seed(0)
    lm = attach_lora(load_causal_lm(ci_model), r=2, alpha=4)
    lm.save_pretrained(str(work / "adapter"))
    hidden = lm.get_input_embeddings().weight.shape[1]
    decoder = {"weight": torch.randn(2 * hidden, 8) * 0.02, "bias": torch.zeros(2 * hidden)}
    out = work / "release"
    write_release(
        out,
        adapter_dir=work / "adapter",
        prefix_decoder=decoder,
        meta={
            "method": "privcode++",
            "conditioning": "latent",
            "dp": True,
            "base_model": ci_model,
            "alignment": "public bank",
            "prefix": {"dz": 8, "num_virtual_tokens": 2, "hidden_size": hidden},
        },
        privacy=privacy_record(epsilon=4.0),
    )
    return out


# The tiny run of the whole pipeline: 60 records (54 members, 2 of them carrying a canary:
# canaries take at most 5% of the training records), the ci base, 4 DP steps (with the public
# held-out loss curve), then eval, audit (with the non-DP comparison), pac (4 worlds) and
# report. tests/test_audit_stage.py checks its eval, audit, pac and report stages,
# tests/test_train.py its train stage's release: one run (about a minute on 2 CPUs) for both.
TINY_PIPELINE = [
    "run.name=t",
    "run.stages=[data, base, train, eval, audit, pac, report]",
    "data.size=60",
    "data.canary_repetitions=[1]",
    "data.canary_kinds=[email, password]",
    "data.canary_placements=[joint]",
    "base.preset=ci",
    "train.steps=4",
    "train.expected_batch_size=8",
    "train.max_length=48",
    "train.checkpoint_every=2",
    "train.eval_tokens=256",
    "train.latent_dim=16",
    "train.num_virtual_tokens=4",
    "train.align_bank_size=8",
    "eval.limit=3",
    "eval.max_new_tokens=32",
    "eval.models=[base, junior]",
    # leak probing has its own end-to-end tests (tests/test_probe.py); left out for CI time
    "audit.audits=[canaries, exposure, mia]",
    "audit.compare_nondp=true",
    "audit.nondp_steps=6",
    "audit.canary_samples=2",
    "audit.canary_max_new_tokens=12",
    "audit.exposure_candidates=20",
    "audit.mia_records=20",
    "pac.worlds=4",
    "pac.steps=4",
    "pac.batch_size=2",
    "pac.max_length=32",
    "pac.eval_sessions=3",
    "pac.eval_tokens=8",
    "pac.eval_positions=24",
    "pac.eval_canaries=2",
    "pac.eval_canary_tokens=8",
]


def tiny_pipeline_overrides(root: os.PathLike, ci_base_cache: str) -> list[str]:
    """The ``--set`` overrides of the ``tiny_pipeline`` run (on jobs/configs/demo.yaml)."""
    return [
        f"run.out_dir={os.path.join(root, 'runs')}",
        f"run.reports_dir={os.path.join(root, 'reports')}",
        f"base.cache_dir={ci_base_cache}",
        f"privacy.store={os.path.join(root, 'privacy-store')}",
        *TINY_PIPELINE,
    ]


@pytest.fixture(scope="session")
def tiny_pipeline(
    ray_connected: dict[str, Any], tmp_path_factory: pytest.TempPathFactory, ci_base_cache: str
) -> tuple[Any, dict[str, Any]]:
    """``(root, result)``: ``run_pipeline``'s result of the ``TINY_PIPELINE`` run, once per
    session; its runs are under ``root/runs/t``, its reports under ``root/reports/t``."""
    from privcode.config import load_config
    from privcode.pipeline.runner import run_pipeline

    root = tmp_path_factory.mktemp("tiny-run")
    init_store(root / "privacy-store")
    result = run_pipeline(
        load_config("jobs/configs/demo.yaml", tiny_pipeline_overrides(root, ci_base_cache))
    )
    return root, result


@pytest.fixture(scope="module")
def one_torch_thread():
    """One intra-op torch thread for the module: the ci model is tiny, so one thread is
    faster and robust to a busy machine. Use: ``pytest.mark.usefixtures("one_torch_thread")``."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# --------------------------------------------------------------------------- chart tests
# Fixtures of tests/test_chart_*.py and tests/test_k8s_submit.py; the helpers are in
# tests/chart_support.py. Each values set is rendered once per module (helm itself runs
# once per distinct command line).

from chart_support import CI_VALUES, VALUE_SETS, render, require_crds, require_helm  # noqa: E402
from model_fixtures import pac_ensemble, pac_unanimous, pac_worlds, premium_release  # noqa: E402, F401


@pytest.fixture(scope="module")
def helm() -> str:
    """The helm binary: skips without one, fails instead with ``PRIVCODE_REQUIRE_HELM=1``."""
    return require_helm()


@pytest.fixture(scope="module")
def crds() -> os.PathLike:
    """The KubeRay CRD folder (``PRIVCODE_KUBERAY_CRDS``): skips when it is absent, fails
    instead with ``PRIVCODE_REQUIRE_CRDS=1`` (tests/gates.py)."""
    return require_crds()


@pytest.fixture(scope="module")
def default_objects(helm: str) -> list[dict]:
    return render(helm)


@pytest.fixture(scope="module")
def ci_objects(helm: str) -> list[dict]:
    return render(helm, "-f", str(CI_VALUES))


@pytest.fixture(scope="module", params=sorted(VALUE_SETS))
def rendering(request: pytest.FixtureRequest, helm: str) -> tuple[str, list[dict]]:
    """(name, objects) for each of ``chart_support.VALUE_SETS``."""
    return request.param, render(helm, *VALUE_SETS[request.param])


def forbid_calls(monkeypatch: pytest.MonkeyPatch, why: str, *targets: tuple[Any, str]) -> None:
    """Make each ``(object, attribute)`` fail the test when called: a refusal must come first."""

    def boom(*args: Any, **kwargs: Any) -> None:
        raise AssertionError(why)

    for obj, name in targets:
        monkeypatch.setattr(obj, name, boom)


def privacy_record(dp=True, epsilon=4.0, delta=1e-5, history=(), method=None, **fields):
    """A complete :class:`~privcode.artifacts.PrivacyRecord` for a hand-written test release."""
    from privcode.artifacts import PrivacyRecord
    from privcode.dp.accounting import DPEvent

    settings = dict(
        training_mode={"mode": "dp-sgd"} if dp else {"mode": "non-private", "reason": "test"},
        method=method or ("privcode" if dp else "nondpft"),
        epsilon_rdp=epsilon,
        epsilon_prv=None,
        epsilon_budget=epsilon if epsilon is not None else 1.0,
        accountant="rdp",
        noise_multiplier=1.0,
        noise_calibrated=False,
        max_grad_norm=1.0,
        sample_rate=0.01,
        expected_batch_size=4,
        num_records=400,
        steps_requested=5,
        steps_taken=5,
        num_workers=0,
        grad_sample_mode="hooks",
        lora={"r": 4, "alpha": 8, "dropout": 0.0},
        dataset_id="test-dataset",
        rng="standard",
        base_model="unused",
        objective={"method": method or "privcode"},
    )
    settings.update(fields)
    return PrivacyRecord(
        dp=dp,
        epsilon=epsilon if dp else None,
        delta=delta,
        history=tuple(DPEvent.from_dict(e) for e in history),
        **settings,
    )


def as_manifest(obj, stage="stage"):
    """A hand-written manifest dict (``{"summary": ...}`` at least) as a StageManifest."""
    from privcode.artifacts import StageManifest

    return StageManifest.from_json({"stage": stage, "fingerprint": "fp", **obj})


def as_manifests(obj):
    """``{stage: manifest dict}`` as ``{stage: StageManifest}``."""
    return {name: as_manifest(m, name) for name, m in obj.items()}


def full_train_summary(summary):
    """A hand-written train summary completed with defaults to a valid TrainSummary."""
    defaults = dict(
        dp=True,
        method="privcode++",
        conditioning="latent",
        epsilon=None,
        epsilon_rdp=None,
        epsilon_prv=None,
        epsilon_budget=4.0,
        delta=1e-5,
        accountant="rdp",
        ledger_steps=30,
        noise_multiplier=1.0,
        noise_calibrated=True,
        max_grad_norm=1.0,
        sample_rate=0.006,
        expected_batch_size=16,
        num_records=2625,
        steps_requested=30,
        steps_taken=30,
        stop_reason="steps",
        num_workers=0,
        dataset_id="test-dataset",
        rng="secure",
        base_model="base",
        adjacency="add/remove one record (N public)",
        adapter="adapter",
        train_seconds=1.0,
        data_path="train.parquet",
        privacy_store="privacy-store",
    )
    return {**defaults, **summary}


def premium_json(model, dp=True, **fields):
    """A complete premium.json (:class:`~privcode.artifacts.premium.PremiumRecord`) as text."""
    import json

    privacy = {
        "dp": dp,
        "dp_training": False,
        "epsilon": 4.0 if dp else None,
        "delta": 1e-5 if dp else None,
        "guarantee": "(4.0, 1e-05)-DP, inherited by post-processing" if dp else "NONE: test",
        "no_dp_guarantee": not dp,
        "privacy_warning": None if dp else "NO differential-privacy guarantee: test",
        "post_processing_of": {"release_sha256": "x", "dp": dp},
        "statement": "test",
    }
    record = {
        "model": str(model),
        "data": "synthetic.parquet",
        "data_sha256": "0" * 64,
        "records": 10,
        "curve": [],
        "config": {},
        "train_seconds": 1.0,
        "privacy": privacy,
        **fields,
    }
    return json.dumps(record)


def base_summary(path, heldout_loss=4.2, untrained_heldout_loss=9.0, **overrides):
    """A hand-written base stage summary: a valid BaseRecord of a trained preset."""
    from privcode.artifacts.base import BaseRecord

    values = dict(
        version=2,
        path=str(path),
        preset="ci",
        seed=0,
        config_hash="0" * 16,
        external=False,
        heldout_loss=heldout_loss,
        untrained_heldout_loss=untrained_heldout_loss,
        heldout_bits_per_byte=1.5,
        untrained_heldout_bits_per_byte=3.0,
        heldout_tokens=4096,
        params=1_000_000,
        vocab_size=1024,
        tokens_seen=65_536,
        train_seconds=10.0,
        tokens_per_second=6553.6,
        build_seconds=12.0,
        num_threads=2,
        cached=True,
        preset_spec={"steps": 100},
        steps=100,
        loss_history=[[0, 7.0], [100, 4.0]],
    )
    values.update(overrides)
    return BaseRecord.from_json(values).to_json()
