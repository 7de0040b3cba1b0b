"""Serve PAC-private generation (the m-world ensemble) as an OpenAI-compatible Ray Serve app.

``import_path: privcode.serve.ensemble:app`` with ``args`` (see
:func:`parse_args`): ``worlds`` (the worlds artifact of the pac stage:
``pac.json`` + ``adapters/``; required), ``model`` (base-model override),
``device``, ``top_k`` (candidate set size, 50), ``b`` (nats per
non-unanimous token, 2^-16), ``decoder`` (``gumbel``: requests with
``temperature > 0`` use coupled Gumbel sampling; ``greedy``: every request
is greedy), ``session_budget`` (default and largest budget of a session,
2^-10 nats), ``deployment_budget`` (all sessions, all restarts, 2^-4 nats),
``scope`` (``deployment`` | ``session``, see
:mod:`privcode.pac.curator`), ``privacy_store`` (default
``PRIVCODE_PRIVACY_STORE``, else ``privacy-store/`` beside the worlds'
``runs/``: the curator's secret and charges live there, under
``pac/<worlds id>/``, keyed by the worlds' content, so a re-run of the pac
stage, a restart or a new replica never resets them; the store's ledger
grants the deployment budget, :mod:`privcode.dp.pac_budgets`),
``max_tokens_limit``, ``api_key_env``, ``served_model_name``.

Routes (``Authorization: Bearer`` on all but ``/healthz`` when a key is set):

* ``POST /v1/sessions`` (optional body ``{"budget_nats": x}``, capped at
  ``session_budget``) -> a ``pac.session``; ``GET`` / ``DELETE
  /v1/sessions/<id>``;
* ``POST /v1/completions``: the OpenAI body plus an optional ``"session"``
  id (without one, a one-shot session with the default budget is opened and
  closed around the request); ``temperature`` 0 or absent: greedy votes,
  ``> 0``: coupled Gumbel at that temperature (unless ``decoder`` is
  ``greedy``); ``seed`` seeds the PUBLIC Gumbel draws. The answer is an
  OpenAI completion plus a ``privacy`` object (charges and token counts);
* ``GET /v1/privacy``: the deployment's public accounting and the attacker
  bounds an auditor needs; ``GET /v1/models[/<id>]``, ``GET /healthz``.

Privacy assumptions (docs/methods.md, PAC-private generation):

* ONE replica. The curator (the secret realised world, the posterior(s)
  and the budgets) lives in the replica's memory and in the privacy store; a
  second replica would hold a second posterior and spend the deployment
  budget twice. ``num_replicas`` is fixed to 1 here (:func:`build_app`
  refuses more), and the replica takes an exclusive lock on the worlds' state
  so a second process using the same state waits and then fails instead of
  racing it. Scaling out would need the curator moved into one named Ray
  actor that every replica calls for each step.
* The secret and the posteriors never leave the server: no route returns,
  and no log line holds, them, the worlds' votes or log-probs; only
  released tokens, charges and counts are shown. Prompts and completions
  are never logged (sizes, counts and latency only); session ids are not
  logged either (they are bearer capabilities).
* Budgets fail closed: the curator charges ``b`` nats and persists the
  charge BEFORE a private token is released; once a session's or the
  deployment's budget cannot pay for a token, the public base model's token
  is emitted instead (a ``fallback`` token, free). A restart keeps the
  secret and the charges; an unreadable state refuses to start.
* A unanimous token (every world of positive posterior votes for it) is a
  function of the votes alone, not of the secret: it is released free.

:class:`PacService` is the API core, usable without Ray (tests, other
servers); :class:`Ensemble` is the thin Serve deployment around it.
Generation runs on one worker thread, so the curator sees the steps of all
requests in order.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import math
import os
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ray import serve

from privcode.errors import PrivcodeError
from privcode.serve.http import (
    CompletionRequest,
    RequestError,
    api_key_from_env,
    app_args,
    bearer_ok,
    check_common_args,
    load_json_body,
    parse_completion,
    read_body_capped,
    route_path,
)

log = logging.getLogger("privcode.serve")

__all__ = [
    "DEFAULT_MODEL_NAME",
    "Ensemble",
    "EnsembleArgs",
    "EnsembleError",
    "PacService",
    "app",
    "build_app",
    "parse_args",
]

DEFAULT_MODEL_NAME = "privcode-pac"
STATE_LOCK = "serve.lock"
#: How long a starting replica waits for a previous one to let go of ``state_dir``
#: (a redeploy can overlap the old replica's graceful shutdown).
STATE_LOCK_WAIT_S = 120.0

Response = tuple[int, dict[str, Any], dict[str, str]]


class EnsembleError(PrivcodeError, ValueError):
    """The PAC serving app cannot start: bad args, or a state another process holds."""


# --------------------------------------------------------------------------- args


@dataclass(frozen=True)
class EnsembleArgs:
    """The app's ``args`` (serveConfigV2 ``applications[].args``); budgets in nats."""

    worlds: str
    model: str | None = None
    device: str = "auto"
    top_k: int = 50
    b: float = 2.0**-16
    decoder: str = "gumbel"
    session_budget: float = 2.0**-10
    deployment_budget: float = 2.0**-4
    scope: str = "deployment"
    privacy_store: str | None = None
    max_tokens_limit: int = 256
    api_key_env: str = "PRIVCODE_API_KEY"
    served_model_name: str = DEFAULT_MODEL_NAME

    @property
    def store_path(self) -> Path:
        """The privacy store holding the curator's state and the deployment budgets."""
        from privcode.dp.store import resolve_store

        parents = Path(self.worlds).expanduser().resolve().parents  # <runs>/<run>/pac/worlds
        return resolve_store(self.privacy_store or "", parents[min(2, len(parents) - 1)])


_DEVICES = ("auto", "cpu", "cuda")
_DECODERS = ("greedy", "gumbel")
_SCOPES = ("deployment", "session")


def _bad(key: str, why: str, value: Any) -> EnsembleError:
    return EnsembleError(f"ensemble args: {key!r} {why}, got {value!r}")


def _is_number(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, int | float) and math.isfinite(value)


def parse_args(args: Mapping[str, Any] | None) -> EnsembleArgs:
    """Validate the app args; :class:`EnsembleError` names the bad (or unknown) key."""
    out = app_args(args, EnsembleArgs, "ensemble args", EnsembleError)
    if "worlds" not in out:
        raise EnsembleError(
            "ensemble args: 'worlds' is required (the worlds artifact dir of "
            "the pac stage, with pac.json and adapters/)"
        )
    for key in ("worlds", "api_key_env", "served_model_name"):
        if key in out and (not isinstance(out[key], str) or not out[key].strip()):
            raise _bad(key, "must be a non-empty string", out[key])
    for key in ("model", "privacy_store"):
        if out.get(key) is not None and (not isinstance(out[key], str) or not out[key].strip()):
            raise _bad(key, "must be a non-empty string (a directory) or null", out[key])
    for key, choices in (("device", _DEVICES), ("decoder", _DECODERS), ("scope", _SCOPES)):
        if key in out and out[key] not in choices:
            raise _bad(key, f"must be one of {', '.join(choices)}", out[key])
    check_common_args(out, (("top_k", 1, 1 << 20), ("max_tokens_limit", 1, 1 << 16)), _bad)
    for key in ("b", "session_budget", "deployment_budget"):
        if key in out and not (_is_number(out[key]) and out[key] > 0):
            raise _bad(
                key,
                "must be a finite number of nats > 0 (e.g. 1.52587890625e-05 for 2^-16)",
                out[key],
            )
    cfg = EnsembleArgs(**out)
    # Budgets that could never pay for a token are a misconfiguration, not a policy.
    if cfg.b > cfg.session_budget:
        raise _bad(
            "session_budget",
            f"must be at least b={cfg.b!r} (else no session can afford a single private token)",
            cfg.session_budget,
        )
    if cfg.session_budget > cfg.deployment_budget:
        raise _bad(
            "session_budget",
            f"must be at most deployment_budget={cfg.deployment_budget!r}",
            cfg.session_budget,
        )
    return cfg


# --------------------------------------------------------------------------- state lock


class _StateLock:
    """An exclusive ``flock`` on ``<state_dir>/serve.lock``: one curator per state at a time."""

    def __init__(self, state_dir: Path, wait_s: float):
        state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        path = state_dir / STATE_LOCK
        self._fd: int | None = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    self.release()
                    raise EnsembleError(
                        f"{path}: another process holds this PAC curator state (waited "
                        f"{wait_s:g} s); the PAC ensemble must run as ONE replica per set of worlds "
                        "(a second one would spend the budget twice)"
                    ) from None
                time.sleep(0.5)

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor drops the lock
            self._fd = None


# --------------------------------------------------------------------------- API core

_EXACT: dict[str, frozenset[str]] = {
    "/v1/completions": frozenset({"POST"}),
    "/v1/sessions": frozenset({"POST"}),
    "/v1/privacy": frozenset({"GET"}),
    "/v1/models": frozenset({"GET"}),
    "/healthz": frozenset({"GET"}),
}
_PREFIX: dict[str, frozenset[str]] = {
    "/v1/sessions/": frozenset({"GET", "DELETE"}),
    "/v1/models/": frozenset({"GET"}),
}
_SESSION_FIELDS = ("budget_nats",)


def _not_found_session() -> RequestError:
    # The id is never echoed: it is a capability, and the message might be logged.
    return RequestError(
        "unknown or closed PAC session (open one with POST /v1/sessions)",
        "session",
        status=404,
        code="session_not_found",
    )


class PacService:
    """The PAC ensemble's HTTP API over an ensemble and a curator, independent of the server.

    ``ensemble``: a :class:`privcode.pac.ensemble.PacEnsemble` (or anything
    with ``m``, ``context``, ``encode(prompt)`` and ``generate(...)``);
    ``curator``: a :class:`privcode.pac.curator.Curator` of the same ``m``.
    :meth:`load` builds both from :class:`EnsembleArgs`.
    """

    def __init__(
        self,
        ensemble: Any,
        curator: Any,
        cfg: EnsembleArgs,
        *,
        api_key: str | None = None,
        logger: logging.Logger | None = None,
        created: int | None = None,
        state_lock: _StateLock | None = None,
    ):
        if getattr(ensemble, "m", None) != getattr(curator, "m", None):
            raise EnsembleError(
                f"the ensemble has m={getattr(ensemble, 'm', None)!r} worlds, "
                f"the curator m={getattr(curator, 'm', None)!r}"
            )
        self.ensemble, self.curator, self.cfg = ensemble, curator, cfg
        self.api_key = api_key or None
        self.log = logger or log
        self.name = cfg.served_model_name
        self.created = int(time.time()) if created is None else int(created)
        self._state_lock = state_lock
        # One worker: completions (and session deletes) reach the curator in arrival order,
        # and a request cancelled by its client cannot let the next one overlap it.
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pac-generate")
        self._lock = threading.Lock()
        #: A :class:`PacMetrics` (set by the Serve deployment), or None.
        self.metrics: Any = None

    @classmethod
    def load(
        cls,
        cfg: EnsembleArgs,
        *,
        api_key: str | None = None,
        logger: logging.Logger | None = None,
        rng_seed: int | None = None,
        lock_wait_s: float = STATE_LOCK_WAIT_S,
    ) -> PacService:
        """Lock the worlds' curator state in the privacy store, load the worlds, restore the curator.

        The state is ``<store>/pac/<worlds id>/`` (the id: a keyed digest of
        the worlds' files). Worlds the store's ledger knows were served but
        whose state is gone are refused (fail closed: a fresh secret with a
        full budget is never drawn for them); the curator is held to the
        allowance the ledger grants (:mod:`privcode.dp.pac_budgets`), logged
        after its state exists, so a crash in between cannot lock the worlds out.
        ``rng_seed`` seeds the curator's NOISE only (tests); the secret is
        always drawn with ``secrets``.
        """
        from privcode.dp.budget import call as store_call
        from privcode.dp.store import PrivacyStore
        from privcode.pac.curator import STATE_FILE, Curator
        from privcode.pac.ensemble import MANIFEST, PacEnsemble, read_manifest, worlds_digest

        worlds = Path(cfg.worlds).expanduser()
        info = read_manifest(worlds, model=cfg.model)
        store = PrivacyStore(cfg.store_path)
        worlds_id = "pw-" + store.opaque("pac-worlds", worlds_digest(worlds), 16)
        state = store.pac_state_dir(worlds_id)
        lock = _StateLock(state, lock_wait_s)
        try:
            if (
                store_call(store.root, "pac_served", worlds_id)
                and not (state / STATE_FILE).exists()
            ):
                raise EnsembleError(
                    f"the privacy store knows these PAC worlds ({worlds_id}) were served, but "
                    f"their curator state in {state} is gone; refusing to start (a new secret "
                    "with a full budget would reset what was spent). Restore the state"
                )
            ensemble = PacEnsemble(worlds, model=cfg.model, device=cfg.device, top_k=cfg.top_k)
            curator = Curator(
                ensemble.m,
                cfg.b,
                deployment_budget=cfg.deployment_budget,
                session_budget=cfg.session_budget,
                scope=cfg.scope,
                state_dir=state,
                rng_seed=rng_seed,
            )
            grant = store_call(
                store.root,
                "pac_open",
                worlds_id,
                info.dataset_id or worlds_id,  # worlds of unknown data: a budget of their own
                ensemble.m,
                cfg.b,
                cfg.scope,
                cfg.deployment_budget,
            )
            curator.deployment_budget = float(grant["allowance"])
            created = int((worlds / MANIFEST).stat().st_mtime)
            return cls(
                ensemble,
                curator,
                cfg,
                api_key=api_key,
                logger=logger,
                created=created,
                state_lock=lock,
            )
        except BaseException:
            lock.release()
            raise

    def close(self) -> None:
        """Stop the worker (after the running request) and release the curator's state."""
        self._worker.shutdown(wait=True)
        if self._state_lock is not None:
            self._state_lock.release()

    # -- routing

    async def handle(
        self,
        method: str,
        path: str,
        headers: Mapping[str, str],
        read_body: Callable[[], Awaitable[bytes]],
    ) -> Response:
        """(status, JSON body, extra headers) for one request; never raises for bad input."""
        from privcode.pac.curator import UnknownSessionError
        from privcode.pac.ensemble import PacEnsembleError

        try:
            return await self._handle(method.upper(), path, headers, read_body)
        except RequestError as exc:
            return _error(exc)
        except UnknownSessionError:
            return _error(_not_found_session())
        except PacEnsembleError as exc:  # request-shaped values only: no prompt text
            return _error(RequestError(str(exc)))

    async def _handle(
        self,
        method: str,
        path: str,
        headers: Mapping[str, str],
        read_body: Callable[[], Awaitable[bytes]],
    ) -> Response:
        if (
            path != "/healthz"
            and self.api_key is not None
            and not bearer_ok(headers.get("authorization"), self.api_key)
        ):
            raise RequestError(
                "missing or invalid API key (send 'Authorization: Bearer <key>')",
                status=401,
                code="invalid_api_key",
            )
        allowed, rest = _EXACT.get(path), None
        if allowed is None:
            for prefix, methods in _PREFIX.items():
                if path.startswith(prefix) and "/" not in path[len(prefix) :]:
                    allowed, rest = methods, path[len(prefix) :]
        if allowed is None:
            routes = [*_EXACT, *(p + "<id>" for p in _PREFIX)]
            raise RequestError(
                f"no route {path[:200]!r} (routes: {', '.join(routes)})",
                status=404,
                code="not_found",
            )
        if method not in allowed:
            status, body, _ = _error(
                RequestError(
                    f"method {method} not allowed on {path[:200]} (use "
                    f"{', '.join(sorted(allowed))})",
                    status=405,
                    code="method_not_allowed",
                )
            )
            return status, body, {"Allow": ", ".join(sorted(allowed))}
        if path == "/healthz":
            return 200, {"status": "ok"}, {}
        if path == "/v1/models":
            return 200, {"object": "list", "data": [self._model_card()]}, {}
        if path.startswith("/v1/models/"):
            if rest != self.name:
                raise RequestError(
                    f"model not found (this endpoint serves {self.name!r})",
                    "model",
                    status=404,
                    code="model_not_found",
                )
            return 200, self._model_card(), {}
        if path == "/v1/privacy":
            return 200, await asyncio.to_thread(self.privacy), {}
        if path == "/v1/sessions":
            return 200, await self._open_session(await read_body()), {}
        if rest is not None:  # /v1/sessions/<id>
            if method == "DELETE":
                return 200, await self._in_order(self._close_session, rest), {}
            return (
                200,
                self._session_body(await asyncio.to_thread(self.curator.session_info, rest)),
                {},
            )
        return 200, await self._complete(await read_body()), {}

    async def _in_order(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` on the worker thread, after every request queued before it."""
        return await asyncio.get_running_loop().run_in_executor(self._worker, fn, *args)

    # -- sessions

    def _model_card(self) -> dict[str, Any]:
        return {"id": self.name, "object": "model", "created": self.created, "owned_by": "privcode"}

    def _session_body(self, info: Mapping[str, Any]) -> dict[str, Any]:
        return {
            "id": info["session"],
            "object": "pac.session",
            "scope": self.curator.scope,
            "budget_nats": info["budget"],
            "charged_nats": info["charged"],
            "remaining_nats": info["remaining"],
            "private_tokens": info["private_tokens"],
            "free_tokens": info["free_tokens"],
            "fallback_tokens": info["fallback_tokens"],
            "per_token_budget_nats": self.curator.b,
        }

    async def _open_session(self, raw: bytes) -> dict[str, Any]:
        from privcode.pac.curator import CuratorError

        data = load_json_body(raw) if raw.strip() else {}
        if not isinstance(data, dict):
            raise RequestError("request body must be a JSON object (or empty)")
        for key in data:
            if key not in _SESSION_FIELDS:
                name = key if len(key) <= 64 else key[:64] + "..."
                raise RequestError(
                    f"unknown field {name!r} (supported: {', '.join(_SESSION_FIELDS)})", name
                )
        budget = data.get("budget_nats")
        if budget is not None and not (_is_number(budget) and budget > 0):
            raise RequestError(
                "'budget_nats' must be a finite number > 0 (it is capped at "
                f"the session budget, {self.curator.session_budget!r} nats)",
                "budget_nats",
            )
        try:
            sid = await asyncio.to_thread(self.curator.open_session, budget)
        except CuratorError as exc:  # too many open sessions
            raise RequestError(
                str(exc), status=429, type="rate_limit_error", code="too_many_sessions"
            ) from None
        info = await asyncio.to_thread(self.curator.session_info, sid)
        self.log.info("pac session opened: budget_nats=%.6g", info["budget"])
        return self._session_body(info)

    def _close_session(self, sid: str) -> dict[str, Any]:
        info = self.curator.session_info(sid)
        self.curator.close_session(sid)
        self.log.info(
            "pac session closed: charged_nats=%.6g private=%d free=%d fallback=%d",
            info["charged"],
            info["private_tokens"],
            info["free_tokens"],
            info["fallback_tokens"],
        )
        return {**self._session_body(info), "deleted": True}

    # -- privacy

    def privacy(self) -> dict[str, Any]:
        """Deployment-wide public accounting and attacker bounds (never the secret or posterior)."""
        from privcode.pac.bounds import mia_success_bound, world_identification_bound

        info = self.curator.deployment_info()
        m = info["m"]

        def bounds(mi: float) -> dict[str, float]:
            return {
                "mutual_information_nats": mi,
                "membership_inference_success": mia_success_bound(mi),
                "world_identification_success": world_identification_bound(mi, m),
            }

        if info["scope"] == "deployment":
            guarantee = (
                "I(S; every release of every session) <= deployment_charged_nats: "
                "one posterior over the worlds is shared by all sessions, so the "
                "bound holds against an attacker who sees all of them"
            )
            current, at_budget = (
                bounds(info["deployment_charged"]),
                bounds(info["deployment_budget"]),
            )
        else:
            guarantee = (
                "PER SESSION ONLY: each session has its own posterior, so "
                "I(S; one session) <= its charged nats <= session_budget_nats; "
                "NOTHING bounds an attacker who sees several sessions"
            )
            current, at_budget = None, bounds(info["session_budget"])
        return {
            "object": "pac.privacy",
            "model": self.name,
            "mechanism": "pac",
            "m": m,
            "top_k": self.cfg.top_k,
            "decoder": self.cfg.decoder,
            "scope": info["scope"],
            "per_token_budget_nats": info["b"],
            "session_budget_nats": info["session_budget"],
            "deployment_budget_nats": info["deployment_budget"],
            "deployment_charged_nats": info["deployment_charged"],
            "deployment_remaining_nats": info["deployment_remaining"],
            "private_tokens": info["private_tokens"],
            "sessions_open": info["sessions_open"],
            "guarantee": guarantee,
            "bounds": {
                "current": current,
                (
                    "at_deployment_budget"
                    if info["scope"] == "deployment"
                    else "per_session_at_budget"
                ): at_budget,
                "membership_prior": 0.5,
                "world_prior": 1.0 / m,
            },
        }

    # -- completions

    def _decoder(self, request: CompletionRequest) -> tuple[str, float]:
        if request.greedy or self.cfg.decoder == "greedy":
            return "greedy", 1.0  # the temperature only scales Gumbel votes
        return "gumbel", request.temperature

    async def _complete(self, raw: bytes) -> dict[str, Any]:
        start = time.perf_counter()
        data = load_json_body(raw)
        if not isinstance(data, dict):
            raise RequestError("request body must be a JSON object")
        data = dict(data)
        sid = data.pop("session", None)
        if sid is not None and (not isinstance(sid, str) or not sid):
            raise RequestError(
                "'session' must be a session id string (from POST /v1/sessions) or null", "session"
            )
        request = parse_completion(data, self.cfg.max_tokens_limit)
        if request.model is not None and request.model != self.name:
            raise RequestError(
                f"model not found (this endpoint serves {self.name!r})",
                "model",
                status=404,
                code="model_not_found",
            )
        if request.top_p != 1.0:
            raise RequestError(
                "'top_p' is not supported by the PAC ensemble (its candidates "
                "are the public model's top_k tokens); only 1 is accepted",
                "top_p",
            )
        decoder, temperature = self._decoder(request)
        if sid is not None:
            await asyncio.to_thread(self.curator.session_info, sid)  # 404 before queueing
        out, info = await self._in_order(self._generate, sid, request, decoder, temperature)
        tokens = len(out.token_ids)
        if self.metrics is not None:
            with contextlib.suppress(Exception):  # metrics never fail a completion
                self.metrics.update(out, self.curator.deployment_info())
        self.log.info(
            "pac completion: prompt_tokens=%d completion_tokens=%d private=%d free=%d "
            "fallback=%d charged_nats=%.6g decoder=%s one_shot=%s latency_ms=%.1f",
            out.prompt_tokens,
            tokens,
            out.private_tokens,
            out.free_tokens,
            out.fallback_tokens,
            out.charged_nats,
            decoder,
            sid is None,
            1000 * (time.perf_counter() - start),
        )
        return {
            "id": f"cmpl-{uuid.uuid4().hex}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": self.name,
            "choices": [
                {"index": 0, "text": out.text, "logprobs": None, "finish_reason": out.finish_reason}
            ],
            "usage": {
                "prompt_tokens": out.prompt_tokens,
                "completion_tokens": tokens,
                "total_tokens": out.prompt_tokens + tokens,
            },
            "privacy": {
                "session": sid,
                "one_shot": sid is None,
                "decoder": decoder,
                "charged_nats": out.charged_nats,
                "private_tokens": out.private_tokens,
                "free_tokens": out.free_tokens,
                "fallback_tokens": out.fallback_tokens,
                "session_charged_nats": info["charged"],
                "remaining_nats": info["remaining"],
                "per_token_budget_nats": self.curator.b,
            },
        }

    def _generate(
        self, sid: str | None, request: CompletionRequest, decoder: str, temperature: float
    ) -> tuple[Any, dict[str, Any]]:
        """One completion on the worker thread; a one-shot session lives only around it."""
        from privcode.pac.curator import CuratorError

        with self._lock:
            context = getattr(self.ensemble, "context", None)
            if context is not None:
                n = len(self.ensemble.encode(request.prompt))
                if n >= context:
                    raise RequestError(
                        f"'prompt' is {n} tokens; this model's context is {context} tokens",
                        "prompt",
                    )
                if n + request.max_tokens > context:
                    raise RequestError(
                        f"this model's context is {context} tokens, but "
                        f"{n + request.max_tokens} were requested ({n} in the "
                        f"prompt, {request.max_tokens} for the completion): "
                        "lower 'max_tokens'",
                        "max_tokens",
                    )
            one_shot = sid is None
            if one_shot:
                try:
                    sid = self.curator.open_session()
                except CuratorError as exc:  # too many open sessions
                    raise RequestError(
                        str(exc), status=429, type="rate_limit_error", code="too_many_sessions"
                    ) from None
            try:
                # numpy's generators take seeds >= 0; OpenAI seeds may be negative.
                seed = None if request.seed is None else request.seed % (1 << 64)
                out = self.ensemble.generate(
                    self.curator,
                    sid,
                    request.prompt,
                    request.max_tokens,
                    decoder=decoder,
                    temperature=temperature,
                    seed=seed,
                    stop=request.stop,
                )
                info = self.curator.session_info(sid)
            finally:
                if one_shot:
                    self.curator.close_session(sid)
            return out, info


def _error(exc: RequestError) -> Response:
    headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else {}
    return exc.status, exc.body(), headers


# --------------------------------------------------------------------------- Ray Serve

_serve_log = logging.getLogger("ray.serve")


# num_replicas is 1 by design (see the module docstring): build_app refuses more.
@serve.deployment(
    name="Ensemble",
    num_replicas=1,
    max_ongoing_requests=64,
    ray_actor_options={"num_cpus": 1},
    health_check_period_s=10,
    health_check_timeout_s=30,
    graceful_shutdown_timeout_s=20,
)
class Ensemble:
    """Ray Serve deployment: the HTTP API of :class:`PacService`, in ONE replica.

    The curator's secret and posterior live in this replica. A second
    replica would need the curator moved into a named Ray actor shared by
    all replicas; until then the state lock refuses a second curator.
    """

    def __init__(self, args: dict[str, Any]):
        cfg = parse_args(args)
        key = api_key_from_env(cfg.api_key_env, _serve_log, endpoint="PAC ensemble")
        self.service = PacService.load(cfg, api_key=key, logger=_serve_log)
        try:
            from privcode.serve.metrics import PacMetrics

            self.service.metrics = PacMetrics(cfg.served_model_name)
            self.service.metrics.update(None, self.service.curator.deployment_info())
        except Exception as exc:  # noqa: BLE001 - metrics are optional; the curator is not
            _serve_log.warning("PAC ensemble: metrics unavailable (%s)", type(exc).__name__)

    async def __call__(self, request: Any) -> Any:
        from starlette.responses import JSONResponse

        try:
            status, body, headers = await self.service.handle(
                request.method,
                route_path(request.scope),
                request.headers,
                lambda: read_body_capped(request),
            )
        except Exception as exc:  # noqa: BLE001 - the message may hold request data: not echoed
            _serve_log.error("request failed: %s", type(exc).__name__)
            status, headers = 500, {}
            body = {
                "error": {
                    "message": "internal error while generating",
                    "type": "server_error",
                    "param": None,
                    "code": None,
                }
            }
        return JSONResponse(body, status_code=status, headers=headers)

    def __del__(self) -> None:
        service = getattr(self, "service", None)
        if service is not None:
            service.close()


def build_app(args: Mapping[str, Any], **deployment_options: Any) -> serve.Application:
    """The app for ``args``; ``deployment_options`` go to ``Ensemble.options`` (one replica only)."""
    cfg = parse_args(args)
    if (
        deployment_options.get("num_replicas", 1) != 1
        or deployment_options.get("autoscaling_config") is not None
    ):
        raise EnsembleError(
            "the PAC ensemble runs as exactly one replica (num_replicas=1, no "
            "autoscaling): the curator's secret and posterior live in it"
        )
    return Ensemble.options(**deployment_options).bind(asdict(cfg))


def app(args: dict[str, Any]) -> serve.Application:
    """App builder for ``serve run`` / serveConfigV2: ``import_path: privcode.serve.ensemble:app``."""
    return build_app(args)
