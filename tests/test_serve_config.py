"""The chart's RayService against the ``serve`` config section: one source for both.

``privcode serve`` builds the serving apps' args from the pipeline config
(:func:`privcode.serve.args.guard_args`, :func:`~privcode.serve.args.premium_args`,
:func:`~privcode.serve.args.ensemble_args` over :class:`~privcode.config.serve.ServeConfig` and
:class:`~privcode.config.PacConfig`); the Helm chart renders its own copy of the same numbers in
``values.yaml`` (``serve.limits``, ``serve.premium.args``, ``serve.ensemble.args``). These tests
render the chart and hold the two together: routes, every default arg, what the apps accept,
the API keys Secret, and the schema's ranges and choices against the config fields' own.
Helpers: tests/chart_support.py (the ``helm`` fixture marks every test ``chart``).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest
import yaml
from chart_support import CHART, by_kind, env_of, one, pod_templates, render, render_error

from privcode.config import PipelineConfig
from privcode.config.serve import ServeConfig
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
    {"premium", "worlds", "privacy_store", "api_keys_dir", "insecure_no_auth", "device", "model"}
)
KEYS_DIR = "/etc/privcode/api-keys"


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
        same_paths = {**expected[name], path_key: args[path_key]}
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
    assert not by_kind(serving, "Secret"), "the chart never creates the API keys"


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


def _schema_fields() -> dict[str, dict[str, Any]]:
    """ServeConfig field -> its values.schema.json entry."""
    schema = json.loads((CHART / "values.schema.json").read_text())
    serve = schema["properties"]["serve"]["properties"]
    premium = schema["definitions"]["premiumApp"]["properties"]["args"]["properties"]
    pac = schema["definitions"]["ensembleApp"]["properties"]["args"]["properties"]
    found = {}
    for f in dataclasses.fields(ServeConfig):
        if f.name in serve["limits"]["properties"]:
            found[f.name] = serve["limits"]["properties"][f.name]
        elif f.name in premium:
            found[f.name] = premium[f.name]
        elif f.name.startswith("pac_") and f.name[4:] in pac:
            found[f.name] = pac[f.name[4:]]
    return found


def test_schema_ranges_and_choices_are_the_serve_sections():
    found = _schema_fields()
    shared = {f.name for f in dataclasses.fields(ServeConfig)} - {
        "premium_route",  # serve.<app>.routePrefix (the ROUTE pattern)
        "pac_route",
        "engine",  # the chart serves the transformers engine (its import paths)
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
    assert "UNSAFE" in found["pac_scope"]["description"]
