"""The PAC ensemble app's ``args`` (:class:`EnsembleArgs`) and the curator they describe.

Defaults: the ``pac`` config section (mechanism: ``b``, ``top_k``, budgets) and the ``serve``
section (serving policy); ranges and choices: the serve section's
(:func:`privcode.serve.args.parse_app_args`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from privcode.config.pac import PacConfig
from privcode.errors import PrivcodeError
from privcode.privacy.store import resolve_store
from privcode.serve.args import SERVE_DEFAULTS, GuardArgs, parse_app_args

__all__ = ["DEFAULT_MODEL_NAME", "EnsembleArgs", "EnsembleError", "new_curator", "parse_args"]

DEFAULT_MODEL_NAME = "privcode-pac"


class EnsembleError(PrivcodeError, ValueError):
    """The PAC serving app cannot start: bad args, no key, or a state another process holds."""


#: The pac section's defaults: the mechanism the served worlds were evaluated with.
_PAC: dict[str, Any] = {f.name: f.default for f in fields(PacConfig)}


@dataclass(frozen=True, kw_only=True)
class EnsembleArgs(GuardArgs):
    """The app's ``args`` (serveConfigV2 ``applications[].args``); budgets in nats."""

    worlds: str
    top_k: int = _PAC["top_k"]
    b: float = _PAC["b"]
    decoder: str = SERVE_DEFAULTS["pac_decoder"]
    session_budget: float = _PAC["session_budget"]
    deployment_budget: float = _PAC["deployment_budget"]
    scope: str = SERVE_DEFAULTS["pac_scope"]
    acknowledge_session_scope: bool = SERVE_DEFAULTS["pac_acknowledge_session_scope"]
    session_ttl_s: float = SERVE_DEFAULTS["pac_session_ttl_s"]
    max_sessions: int = SERVE_DEFAULTS["pac_max_sessions"]
    max_sessions_per_key: int = SERVE_DEFAULTS["pac_max_sessions_per_key"]
    key_budget_share: float = SERVE_DEFAULTS["pac_key_budget_share"]
    on_exhausted: str = SERVE_DEFAULTS["pac_on_exhausted"]
    privacy_store: str | None = None
    #: The store's ledger actor (``privcode-store:<store id>``) or ledger service (an
    #: http(s) URL; token in ``PRIVCODE_LEDGER_TOKEN_FILE``): the server then holds no
    #: store, and its curator state is under ``pac_state`` (:mod:`privcode.serve.pac_ledger`).
    ledger: str | None = None
    #: The curator states' directory (``<pac_state>/<worlds id>/``), holding no store key;
    #: None: the privacy store's ``pac/`` (needs the store mounted).
    pac_state: str | None = None
    max_tokens_limit: int = SERVE_DEFAULTS["pac_max_tokens_limit"]
    max_batch: int = SERVE_DEFAULTS["pac_max_batch"]
    served_model_name: str = DEFAULT_MODEL_NAME

    @property
    def store_path(self) -> Path:
        """The privacy store holding the curator's state and the deployment budgets."""

        return resolve_store(self.privacy_store or "")


#: App arg -> the serve section's field whose range and choices it takes.
_CONFIG_NAMES = {
    "decoder": "pac_decoder",
    "scope": "pac_scope",
    "session_ttl_s": "pac_session_ttl_s",
    "max_sessions": "pac_max_sessions",
    "max_sessions_per_key": "pac_max_sessions_per_key",
    "key_budget_share": "pac_key_budget_share",
    "on_exhausted": "pac_on_exhausted",
    "max_tokens_limit": "pac_max_tokens_limit",
    "max_batch": "pac_max_batch",
}
_DEVICES = ("auto", "cpu", "cuda")


def parse_args(args: Mapping[str, Any] | None) -> EnsembleArgs:
    """Validate the app args; :class:`EnsembleError` names the bad (or unknown) key."""
    cfg = parse_app_args(
        args,
        EnsembleArgs,
        "ensemble args",
        EnsembleError,
        config_names=_CONFIG_NAMES,
        required=("worlds",),
    )

    def bad(key: str, why: str) -> EnsembleError:
        return EnsembleError(f"ensemble args: {key!r} {why}, got {getattr(cfg, key)!r}")

    if cfg.device not in _DEVICES:
        raise bad("device", f"must be one of {', '.join(_DEVICES)}")
    if not 1 <= cfg.top_k <= 1 << 20:
        raise bad("top_k", "must be an integer in [1, 1048576]")
    for key in ("b", "session_budget", "deployment_budget"):
        value = getattr(cfg, key)
        if not (value > 0 and value < float("inf")):
            raise bad(key, "must be a finite number of nats > 0 (e.g. 1.52587890625e-05 for 2^-16)")
    # Budgets that could never pay for a token are a misconfiguration, not a policy.
    if cfg.b > cfg.session_budget:
        raise bad("session_budget", f"must be at least b={cfg.b!r} (else no session can pay)")
    if cfg.session_budget > cfg.deployment_budget:
        raise bad("session_budget", f"must be at most deployment_budget={cfg.deployment_budget!r}")
    if cfg.b > cfg.key_budget_share * cfg.deployment_budget:
        raise bad("key_budget_share", "leaves a key less than b: no key could pay for a token")
    if cfg.ledger is not None:
        if not cfg.ledger.startswith(("privcode-store:", "http://", "https://")):
            raise bad(
                "ledger",
                "must be the store's ledger actor (privcode-store:<store id>) or its service URL",
            )
        if cfg.pac_state is None or cfg.privacy_store is not None:
            raise bad("ledger", "needs pac_state and no privacy_store (the server holds no store)")
    if cfg.scope == "session" and not cfg.acknowledge_session_scope:
        raise bad(
            "scope",
            "is 'session': its bound holds per session only, NOT against a client opening "
            "several sessions; set acknowledge_session_scope: true to accept that",
        )
    return cfg


def new_curator(
    cfg: EnsembleArgs, m: int, *, state_dir: Any = None, rng_seed: int | None = None
) -> Any:
    """The :class:`~privcode.pac.curator.Curator` these args describe."""
    from privcode.pac.curator import Curator

    return Curator(
        m,
        cfg.b,
        deployment_budget=cfg.deployment_budget,
        session_budget=cfg.session_budget,
        scope=cfg.scope,
        state_dir=state_dir,
        rng_seed=rng_seed,
        max_sessions=cfg.max_sessions,
        max_sessions_per_owner=cfg.max_sessions_per_key,
        owner_budget=cfg.key_budget_share * cfg.deployment_budget,
        session_ttl_s=cfg.session_ttl_s,
    )
