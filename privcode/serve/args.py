"""The serving apps' ``args`` (serveConfigV2 ``applications[].args``): typed, validated, one source.

:class:`GuardArgs` holds what both apps share (keys, rate limit, body and prompt caps); each
app's args extend it. Their defaults are the ``serve`` config section's
(:class:`privcode.config.serve.ServeConfig`), and so are the ranges and choices every value is
checked against: ``privcode serve`` and the Helm chart pass the same section
(tests/test_serve_config.py compares the rendered chart with it).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any

from privcode.config.fields import _check_constraints
from privcode.config.serve import ServeConfig
from privcode.errors import ConfigError
from privcode.serve.api import Limits
from privcode.serve.guard import GuardError, KeyRing

__all__ = [
    "REPLICA_OPTIONS",
    "SERVE_DEFAULTS",
    "GuardArgs",
    "as_args",
    "ensemble_args",
    "guard_args",
    "guard_limits",
    "parse_app_args",
    "premium_args",
]

#: The serve section's defaults, by field name.
SERVE_DEFAULTS: dict[str, Any] = {f.name: f.default for f in fields(ServeConfig)}
_META: dict[str, Mapping[str, Any]] = {f.name: f.metadata for f in fields(ServeConfig)}
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")

#: ``serve.deployment`` options every privcode app's ingress shares: one replica of one CPU
#: (the ensemble's curator state must not be split; the others scale by config), health
#: checks, and a grace period that lets requests in flight finish.
REPLICA_OPTIONS: dict[str, Any] = {
    "num_replicas": 1,
    "ray_actor_options": {"num_cpus": 1},
    "health_check_period_s": 10,
    "health_check_timeout_s": 30,
    "graceful_shutdown_timeout_s": 20,
}


@dataclass(frozen=True, kw_only=True)
class GuardArgs:
    """What both apps share: the base-model override (``model``: the base lives elsewhere than
    at training time), the ``device``, and the keys and client limits (``serve.*``, see
    :mod:`privcode.serve.guard`)."""

    model: str | None = None
    device: str = "auto"
    api_keys_dir: str | None = None
    api_key_env: str = "PRIVCODE_API_KEY"
    insecure_no_auth: bool = False
    rate_limit_rps: float = SERVE_DEFAULTS["rate_limit_rps"]
    rate_limit_burst: int = SERVE_DEFAULTS["rate_limit_burst"]
    max_body_bytes: int = SERVE_DEFAULTS["max_body_bytes"]
    max_prompt_chars: int = SERVE_DEFAULTS["max_prompt_chars"]
    fallback_context: int = SERVE_DEFAULTS["fallback_context"]
    served_model_name: str = "privcode"


def _type_ok(kind: str, value: Any) -> bool:
    if value is None:
        return "None" in kind
    if "bool" in kind:
        return isinstance(value, bool)
    if isinstance(value, bool):
        return False
    if kind.startswith("int"):
        return isinstance(value, int)
    if kind.startswith("float"):
        return isinstance(value, int | float)
    if kind.startswith("str"):
        return isinstance(value, str) and bool(value.strip())
    return True


def parse_app_args(
    args: Any,
    shape: type,
    label: str,
    error: Callable[[str], Exception],
    *,
    config_names: Mapping[str, str] | None = None,
    required: tuple[str, ...] = (),
) -> Any:
    """``args`` as a ``shape`` instance; ``error(message)`` names the bad or unknown key.

    Types follow ``shape``'s annotations (booleans are not numbers, strings are not empty);
    a key that is a ``serve`` field (or is mapped to one by ``config_names``) gets that
    field's range and choices."""
    if args is None:
        args = {}
    if not isinstance(args, Mapping):
        raise error(f"{label} must be a mapping, got {type(args).__name__}")
    known = {f.name: f for f in fields(shape)}
    unknown = sorted(set(args) - set(known), key=str)
    if unknown:
        raise error(f"{label}: unknown key {unknown[0]!r} (known: {', '.join(known)})")
    for key in required:
        if key not in args:
            raise error(f"{label}: {key!r} is required")
    for key, value in args.items():
        kind = str(known[key].type)
        if not _type_ok(kind, value):
            want = kind.replace(" | None", " or null") + (" (non-empty)" if "str" in kind else "")
            raise error(f"{label}: {key!r} must be {want}, got {value!r}")
        name = (config_names or {}).get(key, key)
        if name in _META and value is not None:
            try:
                _check_constraints(value, dict(_META[name]), repr(key))
            except ConfigError as exc:
                raise error(f"{label}: {exc}") from None
    if "api_key_env" in args and not _ENV_NAME.match(args["api_key_env"]):
        raise error(f"{label}: 'api_key_env' must be an environment variable name")
    floats = {k for k, f in known.items() if str(f.type).startswith("float")}
    return shape(**{k: float(v) if k in floats and v is not None else v for k, v in args.items()})


def guard_limits(cfg: GuardArgs, error: Callable[[str], Exception]) -> Limits:
    """The keys (no key is an error unless ``insecure_no_auth``) and the client limits; in a
    Serve replica the rate limit is the app's, shared by its replicas
    (:mod:`privcode.serve.rate_limit`)."""
    try:
        keys = KeyRing.load(
            cfg.api_keys_dir, insecure=cfg.insecure_no_auth, key_env=cfg.api_key_env
        )
    except GuardError as exc:
        raise error(str(exc)) from None
    rate, burst = cfg.rate_limit_rps, cfg.rate_limit_burst
    limits = Limits(keys, rate, burst, cfg.max_body_bytes)
    from privcode.serve.rate_limit import SharedRateLimiter, shared_limiter_name

    name = shared_limiter_name(rate, burst)
    if name is None:
        return limits
    return dataclasses.replace(limits, limiter=SharedRateLimiter(name, rate, burst))


def as_args(instance: Any) -> dict[str, Any]:
    """A parsed args instance back as the plain mapping Serve's ``bind`` takes."""
    return dataclasses.asdict(instance)


def guard_args(serve: ServeConfig, *, insecure_no_auth: bool = False) -> dict[str, Any]:
    """The :class:`GuardArgs` part of both apps' args, from the ``serve`` section."""
    return {
        "api_keys_dir": serve.api_keys_dir or None,
        "insecure_no_auth": insecure_no_auth,
        "rate_limit_rps": serve.rate_limit_rps,
        "rate_limit_burst": serve.rate_limit_burst,
        "max_body_bytes": serve.max_body_bytes,
        "max_prompt_chars": serve.max_prompt_chars,
        "fallback_context": serve.fallback_context,
    }


def premium_args(serve: ServeConfig, premium: str, **more: Any) -> dict[str, Any]:
    """The premium app's args for ``privcode serve`` (the chart renders the same values):
    ``engine``, and with ``vllm`` its ``vllm_*`` settings (empty strings left out)."""
    vllm = {}
    if serve.engine == "vllm":
        vllm = {
            f.name: getattr(serve, f.name)
            for f in fields(ServeConfig)
            if f.name.startswith("vllm_") and getattr(serve, f.name) != ""
        }
    return {
        "premium": premium,
        "max_tokens_limit": serve.max_tokens_limit,
        "max_batch_size": serve.max_batch_size,
        "engine": serve.engine,
        **vllm,
        **more,
    }


def ensemble_args(serve: ServeConfig, pac: Any, worlds: str, **more: Any) -> dict[str, Any]:
    """The PAC app's args from the ``serve`` and ``pac`` sections (``pac``: a PacConfig)."""
    return {
        "worlds": worlds,
        "top_k": pac.top_k,
        "b": pac.b,
        "session_budget": pac.session_budget,
        "deployment_budget": pac.deployment_budget,
        "decoder": serve.pac_decoder,
        "scope": serve.pac_scope,
        "acknowledge_session_scope": serve.pac_acknowledge_session_scope,
        "session_ttl_s": serve.pac_session_ttl_s,
        "max_sessions": serve.pac_max_sessions,
        "max_sessions_per_key": serve.pac_max_sessions_per_key,
        "key_budget_share": serve.pac_key_budget_share,
        "on_exhausted": serve.pac_on_exhausted,
        "max_tokens_limit": serve.pac_max_tokens_limit,
        "max_batch": serve.pac_max_batch,
        **more,
    }
