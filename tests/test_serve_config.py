"""The chart's RayService against the ``serve`` config section: one source for both.

``privcode serve`` builds the serving apps' args from the pipeline config
(:func:`privcode.serve.args.guard_args`, :func:`~privcode.serve.args.premium_args`,
:func:`~privcode.serve.args.ensemble_args` over :class:`~privcode.config.serve.ServeConfig` and
:class:`~privcode.config.PacConfig`); the Helm chart renders its own copy of the same numbers in
``values.yaml`` (``serve.limits``, ``serve.premium.args``, ``serve.premium.vllm``,
``serve.ensemble.args``). These tests render the chart and hold the two together: routes, every
default arg of both premium engines (transformers, vllm), what the apps accept, the API keys
Secret, and the schema's ranges, choices and patterns against the config fields' own.
Helpers: tests/chart_support.py (the ``helm`` fixture marks every test ``chart``).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest
import yaml
from chart_support import (
    CHART,
    by_kind,
    cluster_specs,
    env_of,
    one,
    pod_templates,
    render,
    render_error,
    worker_group,
)

from privcode.config import PipelineConfig
from privcode.config.serve import ROUTE, ServeConfig
from privcode.serve.args import ensemble_args, guard_args, premium_args

SECRET = "x"
SERVING = (
    "--set",
    "serve.enabled=true",
    "--set",
    "serve.ensemble.enabled=true",
    "--set",
    f"apiKey.existingSecret={SECRET}",
)
#: Args that name paths or deployment choices, not defaults the chart shares with the config.
PATHS = frozenset(
    {
        "premium",
        "worlds",
        "privacy_store",
        "ledger",
        "pac_state",
        "api_keys_dir",
        "insecure_no_auth",
        "device",
        "model",
    }
)
KEYS_DIR = "/etc/privcode/api-keys"
#: The premium model on vLLM (Ray Serve LLM): serve.premium.vllm joins its args.
VLLM = ("--set", "serve.premium.args.engine=vllm")


def _apps(objects: list[dict]) -> dict[str, dict[str, Any]]:
    config = yaml.safe_load(one(objects, "RayService")["spec"]["serveConfigV2"])
    return {app["name"]: app for app in config["applications"]}


@pytest.fixture(scope="module")
def serving(helm: str) -> list[dict]:
    return render(helm, *SERVING)


@pytest.fixture(scope="module")
def apps(serving: list[dict]) -> dict[str, dict[str, Any]]:
    return _apps(serving)


def _expected() -> dict[str, dict[str, Any]]:
    """What ``privcode serve`` passes each app for the default config (paths aside)."""
    cfg = PipelineConfig()
    guard = guard_args(cfg.serve)
    return {
        "premium": {**guard, **premium_args(cfg.serve, "<premium>")},
        "ensemble": {**guard, **ensemble_args(cfg.serve, cfg.pac, "<worlds>")},
    }


def _same(a: Any, b: Any) -> bool:
    """Equal, and a boolean only where the other is one (False == 0 in Python)."""
    return a == b and isinstance(a, bool) == isinstance(b, bool)


# --------------------------------------------------------------------------- routes and names


def test_routes_are_the_serve_sections(apps):
    serve = ServeConfig()
    assert apps["premium"]["route_prefix"] == serve.premium_route
    assert apps["ensemble"]["route_prefix"] == serve.pac_route


def test_deployment_names_are_the_apps(apps):
    from privcode.serve import ensemble, premium

    assert [d["name"] for d in apps["premium"]["deployments"]] == ["PremiumServer"]
    assert [d["name"] for d in apps["ensemble"]["deployments"]] == ["Ensemble"]
    assert premium.PremiumServer.name == "PremiumServer"
    assert ensemble.Ensemble.name == "Ensemble"
    assert apps["ensemble"]["deployments"][0]["num_replicas"] == 1


# --------------------------------------------------------------------------- default args


@pytest.mark.parametrize("name", ["premium", "ensemble"])
def test_default_args_are_the_config_defaults(apps, name):
    rendered = {k: v for k, v in apps[name]["args"].items() if k not in PATHS}
    expected = {k: v for k, v in _expected()[name].items() if k not in PATHS}
    assert sorted(rendered) == sorted(expected), (
        f"{name}: the chart renders {sorted(set(rendered) - set(expected))} beyond "
        f"privcode serve's args and lacks {sorted(set(expected) - set(rendered))}"
    )
    wrong = {k: (rendered[k], expected[k]) for k in expected if not _same(rendered[k], expected[k])}
    assert not wrong, f"{name}: chart value != config default: {wrong}"


def test_rendered_args_parse_like_privcode_serves(apps):
    """The apps accept the rendered args and end up configured as ``privcode serve`` does."""
    from privcode.serve import ensemble, premium

    expected = _expected()
    for name, module, path_key in (
        ("premium", premium, "premium"),
        ("ensemble", ensemble, "worlds"),
    ):
        args = apps[name]["args"]
        parsed = module.parse_args(args)
        assert getattr(parsed, path_key) == args[path_key]
        # the ensemble's ledger service and curator state: the chart's (tests/test_chart_ledger.py)
        where = {k: args[k] for k in ("ledger", "pac_state") if k in args}
        same_paths = {**expected[name], path_key: args[path_key], **where}
        assert parsed == module.parse_args(same_paths), name
        assert dataclasses.asdict(parsed)["insecure_no_auth"] is False


# --------------------------------------------------------------------------- API keys


def test_api_keys_secret_is_mounted_on_the_serving_pods_only(serving):
    from privcode.serve.guard import KEY_ENV, KEYS_DIR_ENV

    service = one(serving, "RayService")
    owner = f"RayService/{service['metadata']['name']}"
    seen = 0
    for where, template in pod_templates(serving):
        spec = template["spec"]
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        for container in spec["containers"]:
            env = env_of(container)
            mounts = {m["name"]: m for m in container.get("volumeMounts", [])}
            assert KEY_ENV not in env, where
            if not where.startswith(owner):
                assert KEYS_DIR_ENV not in env and "api-keys" not in mounts, where
                assert "api-keys" not in volumes, where
                continue
            seen += 1
            assert env[KEYS_DIR_ENV] == KEYS_DIR, where
            assert mounts["api-keys"] == {
                "name": "api-keys",
                "mountPath": KEYS_DIR,
                "readOnly": True,
            }, where
            assert volumes["api-keys"]["secret"]["secretName"] == SECRET, where
    assert seen >= 2, "the RayService's head and worker containers"
    assert any(not w.startswith(owner) for w, _ in pod_templates(serving)), "no other cluster"
    secrets = [s["metadata"]["name"] for s in by_kind(serving, "Secret")]
    assert sorted(set(secrets)) == [
        "rel-privcode-executor-token",
        "rel-privcode-ledger-tokens",
    ], "the chart never creates the API keys"


def test_serving_without_api_keys_is_refused(helm):
    stderr = render_error(helm, "--set", "serve.enabled=true")
    assert "apiKey.existingSecret" in stderr, stderr
    assert "kubectl create secret generic privcode-api-keys" in stderr, stderr
    assert "--from-literal=<client>=$(openssl rand -hex 32)" in stderr, stderr


# --------------------------------------------------------------------------- the schema


def test_session_scope_needs_the_acknowledgement(helm):
    session = ("--set", "serve.ensemble.args.scope=session")
    stderr = render_error(helm, *SERVING, *session)
    assert "acknowledge_session_scope" in stderr, stderr
    objects = render(
        helm, *SERVING, *session, "--set", "serve.ensemble.args.acknowledge_session_scope=true"
    )
    args = _apps(objects)["ensemble"]["args"]
    assert args["scope"] == "session" and args["acknowledge_session_scope"] is True
    from privcode.serve import ensemble

    assert ensemble.parse_args(args).scope == "session"


def test_max_sessions_per_key_within_max_sessions(helm):
    stderr = render_error(helm, *SERVING, "--set", "serve.ensemble.args.max_sessions=4")
    assert "max_sessions_per_key (16) is larger than max_sessions (4)" in stderr, stderr


def _schema() -> dict[str, Any]:
    return json.loads((CHART / "values.schema.json").read_text())


def _schema_fields() -> dict[str, dict[str, Any]]:
    """ServeConfig field -> its values.schema.json entry (serve.limits, serve.premium.args with
    ``engine``, serve.premium.vllm with the ``vllm_*`` fields, serve.ensemble.args)."""
    schema = _schema()
    serve = schema["properties"]["serve"]["properties"]
    premium_app = schema["definitions"]["premiumApp"]["properties"]
    premium = premium_app["args"]["properties"]
    vllm = premium_app["vllm"]["properties"]
    pac = schema["definitions"]["ensembleApp"]["properties"]["args"]["properties"]
    found = {}
    for f in dataclasses.fields(ServeConfig):
        if f.name in serve["limits"]["properties"]:
            found[f.name] = serve["limits"]["properties"][f.name]
        elif f.name in premium:
            found[f.name] = premium[f.name]
        elif f.name in vllm:
            found[f.name] = vllm[f.name]
        elif f.name.startswith("pac_") and f.name[4:] in pac:
            found[f.name] = pac[f.name[4:]]
    return found


def _anchored(pattern: str) -> str:
    """A config pattern (``re.fullmatch``) as the schema writes it (JSON Schema searches)."""
    return f"^({pattern})$"


def test_schema_ranges_and_choices_are_the_serve_sections():
    found = _schema_fields()
    shared = {f.name for f in dataclasses.fields(ServeConfig)} - {
        "premium_route",  # serve.<app>.routePrefix (the ROUTE pattern, below)
        "pac_route",
        "api_keys_dir",  # apiKey.existingSecret
    }
    assert sorted(found) == sorted(shared), sorted(shared ^ set(found))
    for f in dataclasses.fields(ServeConfig):
        if f.name not in found:
            continue
        entry, meta = found[f.name], f.metadata
        kind = {bool: "boolean", int: "integer", float: "number", str: "string"}[type(f.default)]
        assert entry["type"] == kind, f.name
        assert entry.get("minimum") == meta.get("min"), f.name
        assert entry.get("maximum") == meta.get("max"), f.name
        if "choices" in meta:
            assert set(entry["enum"]) - {""} == set(meta["choices"]), f.name
        expected_pattern = _anchored(meta["pattern"]) if "pattern" in meta else None
        assert entry.get("pattern") == expected_pattern, f.name
    assert "UNSAFE" in found["pac_scope"]["description"]
    assert found["engine"]["enum"] == ["transformers", "vllm"]
    definitions = _schema()["definitions"]
    for app in ("premiumApp", "ensembleApp"):
        assert definitions[app]["properties"]["routePrefix"]["pattern"] == _anchored(ROUTE), app
    assert definitions["premiumApp"]["properties"]["vllm"]["additionalProperties"] is False


# --------------------------------------------------------------------------- engine: vllm


@pytest.fixture(scope="module")
def vllm_serving(helm: str) -> list[dict]:
    return render(helm, *SERVING, *VLLM)


def _vllm_expected() -> dict[str, Any]:
    """What ``privcode serve`` passes the premium app with ``serve.engine: vllm``."""
    serve = dataclasses.replace(ServeConfig(), engine="vllm")
    return {**guard_args(serve), **premium_args(serve, "<premium>")}


def test_vllm_engine_args_are_the_config_defaults(vllm_serving):
    """engine vllm: the same import path, ``engine`` and every ``vllm_*`` default in the args."""
    app = _apps(vllm_serving)["premium"]
    assert app["import_path"] == "privcode.serve.premium:app"
    rendered = {k: v for k, v in app["args"].items() if k not in PATHS}
    expected = {k: v for k, v in _vllm_expected().items() if k not in PATHS}
    assert sorted(rendered) == sorted(expected), (
        f"the chart renders {sorted(set(rendered) - set(expected))} beyond privcode serve's "
        f"args and lacks {sorted(set(expected) - set(rendered))}"
    )
    wrong = {k: (rendered[k], expected[k]) for k in expected if not _same(rendered[k], expected[k])}
    assert not wrong, f"chart value != config default: {wrong}"
    assert rendered["engine"] == "vllm"
    assert {k for k in rendered if k.startswith("vllm_")} >= {
        "vllm_tensor_parallel_size",
        "vllm_gpu_memory_utilization",
        "vllm_min_replicas",
        "vllm_max_replicas",
    }
    # the ingress keeps its name and stays a CPU replica: vLLM's GPUs come from the vllm_* args
    assert app["deployments"] == [
        {
            "name": "PremiumServer",
            "num_replicas": 1,
            "ray_actor_options": {"num_cpus": 1, "num_gpus": 0},
        }
    ]


def test_vllm_engine_args_parse_like_privcode_serves(vllm_serving):
    from privcode.serve import premium

    args = _apps(vllm_serving)["premium"]["args"]
    parsed = premium.parse_args(args)
    assert parsed.premium == args["premium"]
    assert parsed == premium.parse_args({**_vllm_expected(), "premium": args["premium"]})


def test_transformers_engine_leaves_vllm_out(apps, serving):
    args = apps["premium"]["args"]
    assert args["engine"] == "transformers"
    assert not [k for k in args if k.startswith("vllm_")], args
    service = f"RayService/{one(serving, 'RayService')['metadata']['name']}"
    groups = {g["groupName"] for g in dict(cluster_specs(serving))[service]["workerGroupSpecs"]}
    assert "gpu" not in groups, "workerGroups.gpu is off and nothing needs GPUs"


def test_vllm_engine_gives_the_serving_cluster_gpu_workers(vllm_serving):
    """The vLLM replicas land on the gpu worker group: the RayService's cluster has it even with
    workerGroups.gpu.enabled=false, which keeps it out of the pipeline's clusters."""
    specs = dict(cluster_specs(vllm_serving))
    service = f"RayService/{one(vllm_serving, 'RayService')['metadata']['name']}"
    gpu = worker_group(specs.pop(service), "gpu")
    assert gpu["rayStartParams"]["num-gpus"] == "1"
    resources = gpu["template"]["spec"]["containers"][0]["resources"]
    assert str(resources["limits"]["nvidia.com/gpu"]) == "1"
    assert str(resources["requests"]["nvidia.com/gpu"]) == "1"
    assert gpu["template"]["metadata"]["labels"]["privcode.io/role"] == "serving"
    # NCCL among a replica's GPUs (tensor parallelism) needs more than the runtime's 64 MiB shm.
    pod = gpu["template"]["spec"]
    shm = next(v for v in pod["volumes"] if v["name"] == "dshm")["emptyDir"]
    assert shm == {"medium": "Memory", "sizeLimit": "16Gi"}
    mounts = pod["containers"][0]["volumeMounts"]
    assert {"name": "dshm", "mountPath": "/dev/shm"} in mounts
    assert specs, "the pipeline's own cluster (RayJob) is rendered too"
    for owner, spec in specs.items():
        assert "gpu" not in {g["groupName"] for g in spec.get("workerGroupSpecs", [])}, owner


def test_vllm_settings_are_overridable(helm):
    objects = render(
        helm,
        *SERVING,
        *VLLM,
        "--set",
        "serve.premium.vllm.vllm_tensor_parallel_size=2",
        "--set",
        "serve.premium.vllm.vllm_max_replicas=4",
        "--set",
        "serve.premium.vllm.vllm_lora_store=s3://bucket/adapters",
        "--set",
        "serve.premium.vllm.vllm_accelerator_type=H100",
        "--set",
        "workerGroups.gpu.gpusPerWorker=2",
    )
    args = _apps(objects)["premium"]["args"]
    assert args["vllm_tensor_parallel_size"] == 2 and args["vllm_max_replicas"] == 4
    assert args["vllm_lora_store"] == "s3://bucket/adapters"
    assert args["vllm_accelerator_type"] == "H100"
    # the vllm block is ignored unless the engine is vllm
    objects = render(helm, *SERVING, "--set", "serve.premium.vllm.vllm_max_replicas=4")
    assert not [k for k in _apps(objects)["premium"]["args"] if k.startswith("vllm_")]


@pytest.mark.parametrize(
    "args, field, extra",
    [
        (("--set", "serve.premium.args.engine=foo"), "serve.premium.args.engine", "vllm"),
        (
            ("--set-json", "serve.premium.vllm.vllm_gpu_memory_utilization=1.5"),
            "serve.premium.vllm.vllm_gpu_memory_utilization",
            "0.99",
        ),
        (
            ("--set", "serve.premium.vllm.vllm_dtype=fp8"),
            "serve.premium.vllm.vllm_dtype",
            "bfloat16",
        ),
        (
            ("--set", "serve.premium.vllm.vllm_lora_store=/mnt/adapters"),
            "serve.premium.vllm.vllm_lora_store",
            "s3",
        ),
        (("--set", "serve.premium.vllm.vllm_max_replicas=0"), "serve.premium.vllm", "want 1"),
        (("--set", "serve.premium.vllm.typo=1"), "serve.premium.vllm", "typo"),
    ],
)
def test_schema_refuses_bad_engine_settings(helm, args, field, extra):
    stderr = render_error(helm, *SERVING, *args)
    assert "schema" in stderr, stderr
    assert field in stderr or "/" + field.replace(".", "/") in stderr, stderr
    assert extra in stderr, stderr


def test_vllm_min_replicas_within_max_replicas(helm):
    low = ("--set", "serve.premium.vllm.vllm_min_replicas=3")
    stderr = render_error(helm, *SERVING, *VLLM, *low)
    assert "vllm_min_replicas (3) is larger than vllm_max_replicas (1)" in stderr, stderr
    render(helm, *SERVING, *VLLM, *low, "--set", "serve.premium.vllm.vllm_max_replicas=3")


def test_vllm_ingress_takes_no_gpu(helm):
    stderr = render_error(
        helm, *SERVING, *VLLM, "--set", "serve.premium.rayActorOptions.num_gpus=1"
    )
    assert "serve.premium.rayActorOptions.num_gpus" in stderr and "num_gpus: 0" in stderr, stderr
