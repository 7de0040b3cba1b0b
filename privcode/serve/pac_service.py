"""The PAC ensemble's API core: sessions, budgets per key and completions, without HTTP or Ray.

:class:`PacService` holds one :class:`~privcode.pac.ensemble.PacEnsemble` and its
:class:`~privcode.pac.curator.Curator`; every call names the calling key's principal
(:mod:`privcode.serve.guard`), whose sessions and budget share are its own. :meth:`PacService.load`
locks the worlds' curator state (its own directory, :mod:`privcode.serve.pac_ledger`; one
curator per state: one replica) and pays its private tokens from the store's ledger's leases
(:mod:`privcode.pac.leases`: a second replica, anywhere, is fenced by the ledger).
:func:`privcode.serve.ensemble.build_api` puts HTTP in front. Nothing here logs or returns a
prompt, a completion, a session id, the secret or a posterior.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import math
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from privcode.models.chat import render_chat
from privcode.pac.bounds import mia_success_bound, world_identification_bound
from privcode.pac.curator import STATE_FILE, SessionLimitError, UnknownSessionError
from privcode.pac.ensemble import MANIFEST, PacEnsemble, read_manifest, worlds_digest
from privcode.pac.leases import Leases, block_steps
from privcode.serve.api import (
    CompletionRequest,
    RequestError,
    check_model,
    fit_context,
)
from privcode.serve.formats import Answer, AnswerFormat
from privcode.serve.pac_args import EnsembleArgs, EnsembleError, new_curator
from privcode.serve.pac_ledger import PacLedger
from privcode.serve.pac_scheduler import DecodeScheduler, PacJob
from privcode.serve.streaming import TextStream, TokenSink, answer_events

log = logging.getLogger("privcode.serve")

__all__ = ["STATE_LOCK", "STATE_LOCK_WAIT_S", "PacService"]

STATE_LOCK = "serve.lock"
COMPLETION = "text_completion"
#: How long a starting replica waits for a previous one to let go of ``state_dir``
#: (a redeploy can overlap the old replica's graceful shutdown).
STATE_LOCK_WAIT_S = 120.0


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


def _not_found_session() -> RequestError:
    # The id is never echoed: it is a capability, and the message might be logged.
    return RequestError(
        "unknown, expired or closed PAC session (open one with POST /v1/sessions)",
        "session",
        status=404,
        code="session_not_found",
    )


_EXHAUSTED = {
    "session": "this session's privacy budget is spent (open a new session)",
    "key": "this API key's share of the deployment's privacy budget is spent",
    "deployment": "the deployment's privacy budget is spent",
}


def _exhausted(why: str) -> RequestError:
    if why == "ledger":
        return RequestError(
            "the privacy ledger grants this server no budget now (unreachable, or another "
            "replica took these worlds over): no private token can be released",
            status=503,
            type="service_unavailable",
            code="privacy_ledger_unavailable",
        )
    return RequestError(
        f"{_EXHAUSTED[why]}: no private token can be released",
        status=429,
        type="privacy_budget_exhausted",
        code="privacy_budget_exhausted",
    )


def _open_on_ledger(cfg: EnsembleArgs, curator: Any, ledger: Any, worlds: str, data: str) -> None:
    """Hold ``curator`` to the allowance the ledger grants ``worlds`` (of dataset ``data``;
    worlds of unknown data: a budget of their own) and pay its steps from leases."""

    grant = ledger.call(
        "pac_open", worlds, data, curator.m, cfg.b, cfg.scope, cfg.deployment_budget
    )
    curator.deployment_budget = float(grant["allowance"])
    curator.owner_budget = cfg.key_budget_share * curator.deployment_budget
    block = block_steps(cfg.b, cfg.session_budget, curator.deployment_budget)
    curator.use_leases(Leases(ledger.lease_fn(worlds), cfg.b, block))


#: The deployment's totals in ``GET /v1/privacy`` move in steps of 1/TOTAL_STEPS of its budget.
TOTAL_STEPS = 100
#: ... and its open sessions in steps of 1/SESSION_STEPS of ``max_sessions``.
SESSION_STEPS = 10


def _round_up(value: float, step: float) -> float:
    return math.ceil(value / step - 1e-9) * step if value > 0 else 0.0


def coarse_totals(info: Mapping[str, Any], max_sessions: int) -> dict[str, Any]:
    """The deployment's live totals as every key sees them: rounded UP to coarse steps.

    Exact totals would let one key learn another's usage by difference; rounded up, the
    charged nats still bound what was released (the attacker bounds stay valid) and the
    remaining nats never overstate what is left. ``totals_step`` names the steps.
    """
    nats = info["deployment_budget"] / TOTAL_STEPS
    tokens = max(1, math.ceil(nats / info["b"] - 1e-9))
    sessions = max(1, math.ceil(max_sessions / SESSION_STEPS))
    charged = min(_round_up(info["deployment_charged"], nats), info["deployment_budget"])
    return {
        "deployment_charged_nats": charged,
        "deployment_remaining_nats": max(info["deployment_budget"] - charged, 0.0),
        "private_tokens": int(_round_up(info["private_tokens"], tokens)),
        "sessions_open": int(_round_up(info["sessions_open"], sessions)),
        "totals_step": {"nats": nats, "private_tokens": tokens, "sessions": sessions},
    }


class PacService:
    """The PAC ensemble's API over an ensemble and a curator, independent of HTTP and Ray.

    ``ensemble``: a :class:`privcode.pac.ensemble.PacEnsemble` (or anything with ``m``,
    ``context``, ``encode(prompt)``, ``decode(...)``, ``step_logprobs`` and ``step_batch``:
    :class:`~privcode.serve.pac_scheduler.DecodeScheduler` runs its completions together);
    ``curator``: a :class:`privcode.pac.curator.Curator` of the same ``m``. Every method takes
    the calling key's principal: sessions and budget shares are per key. :meth:`load` builds
    both from :class:`EnsembleArgs`; :func:`build_api` puts HTTP in front.
    """

    def __init__(
        self,
        ensemble: Any,
        curator: Any,
        cfg: EnsembleArgs,
        *,
        logger: logging.Logger | None = None,
        created: int | None = None,
        state_lock: _StateLock | None = None,
        chat_template: str | None = None,
    ):
        if getattr(ensemble, "m", None) != getattr(curator, "m", None):
            raise EnsembleError(
                f"the ensemble has m={getattr(ensemble, 'm', None)!r} worlds, "
                f"the curator m={getattr(curator, 'm', None)!r}"
            )
        self.ensemble, self.curator, self.cfg = ensemble, curator, cfg
        self.log = logger or log
        self.name = cfg.served_model_name
        self.created = int(time.time()) if created is None else int(created)
        self._state_lock = state_lock
        self.chat_template = chat_template  #: the worlds' (None: the kit's, privcode.models.chat)
        # One decode thread: completions of different sessions share each forward; one
        # session's requests (and its delete) reach the curator in arrival order.
        self._decoder = DecodeScheduler(ensemble, cfg.max_batch)
        #: A :class:`PacMetrics` (set by the Serve deployment), or None.
        self.metrics: Any = None

    @classmethod
    def load(
        cls,
        cfg: EnsembleArgs,
        *,
        logger: logging.Logger | None = None,
        rng_seed: int | None = None,
        lock_wait_s: float = STATE_LOCK_WAIT_S,
    ) -> PacService:
        """Lock the worlds' curator state, load the worlds, restore the curator on leases.

        The state is ``<pac_state or store's pac>/<worlds id>/`` (the id: the ledger's keyed
        digest of the worlds' files; :mod:`privcode.serve.pac_ledger`). Worlds the store's
        ledger knows were served but whose state is gone are refused (fail closed: a fresh
        secret with a full budget is never drawn for them); the curator is held to the
        allowance the ledger grants (:mod:`privcode.privacy.pac_budgets`), logged after its
        state exists, so a crash in between cannot lock the worlds out, and pays every private
        step from ledger leases (:mod:`privcode.pac.leases`). ``rng_seed`` seeds the curator's
        NOISE only (tests); the secret is always drawn with ``secrets``.
        """

        worlds = Path(cfg.worlds).expanduser()
        info = read_manifest(worlds, model=cfg.model)
        ledger = PacLedger(cfg)
        worlds_id = ledger.worlds_id(worlds_digest(worlds))
        state = ledger.state_dir(worlds_id)
        lock = _StateLock(state, lock_wait_s)
        try:
            if ledger.call("pac_served", worlds_id) and not (state / STATE_FILE).exists():
                raise EnsembleError(
                    f"the privacy store knows these PAC worlds ({worlds_id}) were served, but "
                    f"their curator state in {state} is gone; refusing to start (a new secret "
                    "with a full budget would reset what was spent). Restore the state"
                )
            ensemble = PacEnsemble(worlds, model=cfg.model, device=cfg.device, top_k=cfg.top_k)
            curator = new_curator(cfg, ensemble.m, state_dir=state, rng_seed=rng_seed)
            _open_on_ledger(cfg, curator, ledger, worlds_id, info.dataset_id or worlds_id)
            created = int((worlds / MANIFEST).stat().st_mtime)
            return cls(
                ensemble,
                curator,
                cfg,
                logger=logger,
                created=created,
                state_lock=lock,
                chat_template=info.chat_template,
            )
        except BaseException:
            lock.release()
            raise

    def close(self) -> None:
        """Stop the decode thread (after the queued requests) and release the curator's state."""
        self._decoder.close()
        if self._state_lock is not None:
            self._state_lock.release()

    # -- sessions

    def model_card(self) -> dict[str, Any]:
        return {"id": self.name, "object": "model", "created": self.created, "owned_by": "privcode"}

    async def _in_order(self, job: PacJob) -> Any:
        """``job``'s value, from the decode thread (after the requests of its session queued
        before it)."""
        return await asyncio.wrap_future(self._decoder.submit(job))

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
            "key_charged_nats": info["owner_charged"],
            "key_remaining_nats": info["owner_remaining"],
            "idle_ttl_s": self.cfg.session_ttl_s,
        }

    def _info(self, sid: str, principal: str) -> dict[str, Any]:

        try:
            return self.curator.session_info(sid, principal)
        except UnknownSessionError:
            raise _not_found_session() from None

    async def open_session(self, principal: str, budget: float | None) -> dict[str, Any]:

        try:
            sid = await asyncio.to_thread(self.curator.open_session, budget, principal)
        except SessionLimitError as exc:
            raise RequestError(
                str(exc), status=429, type="rate_limit_error", code="too_many_sessions"
            ) from None
        info = await asyncio.to_thread(self._info, sid, principal)
        self.log.info("pac session opened: budget_nats=%.6g", info["budget"])
        return self._session_body(info)

    async def session(self, principal: str, sid: str) -> dict[str, Any]:
        return self._session_body(await asyncio.to_thread(self._info, sid, principal))

    async def close_session(self, principal: str, sid: str) -> dict[str, Any]:
        return await self._in_order(PacJob(sid, lambda: self._close(sid, principal)))

    def _close(self, sid: str, principal: str) -> dict[str, Any]:
        info = self._info(sid, principal)
        self.curator.close_session(sid, principal)
        self.log.info(
            "pac session closed: charged_nats=%.6g private=%d free=%d fallback=%d",
            info["charged"],
            info["private_tokens"],
            info["free_tokens"],
            info["fallback_tokens"],
        )
        return {**self._session_body(info), "deleted": True}

    def chat_prompt(self, messages: Any) -> str:
        """``messages`` rendered with the worlds' chat template (their training format)."""

        return render_chat(self.ensemble.tokenizer, messages, self.chat_template)

    # -- privacy

    def privacy(self, principal: str) -> dict[str, Any]:
        """Public accounting and attacker bounds for ``principal`` (an API key): its own figures
        exactly (``key_*``), the deployment's live totals only coarsely (:func:`coarse_totals`),
        so one key cannot follow another's usage. Never the secret or posterior."""

        info = self.curator.deployment_info()
        m = info["m"]
        totals = coarse_totals(info, self.cfg.max_sessions)

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
            current = bounds(totals["deployment_charged_nats"])  # rounded up: still a bound
            at_budget = bounds(info["deployment_budget"])
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
            **self._key_figures(principal),
            **totals,
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

    def _key_figures(self, principal: str) -> dict[str, Any]:
        """The calling key's own budget, charge, private tokens and open sessions, exactly."""
        mine = self.curator.owner_info(principal)
        charged = self.curator.b * mine["owner_private_tokens"]
        budget = self.curator.owner_budget
        return {
            "key_budget_nats": budget,
            "key_charged_nats": charged,
            "key_remaining_nats": max(budget - charged, 0.0),
            "key_private_tokens": mine["owner_private_tokens"],
            "key_sessions_open": mine["owner_sessions_open"],
        }

    # -- completions

    def _decoding(self, request: CompletionRequest) -> tuple[str, float]:
        if request.greedy or self.cfg.decoder == "greedy":
            return "greedy", 1.0  # the temperature only scales Gumbel votes
        return "gumbel", request.temperature

    async def complete(
        self, principal: str, request: CompletionRequest, sid: str | None, kind: str = COMPLETION
    ) -> Any:
        """A PAC completion for ``principal`` (in its session ``sid``, or one-shot): the answer
        of ``kind`` (``text_completion`` or ``chat.completion``) with a ``privacy`` object, or,
        for ``request.stream``, its server-sent events (each token charged as it is released;
        the last chunk carries ``privacy``; a client that goes away ends the decode there)."""
        check_model(request, self.name)
        if request.top_p != 1.0:
            raise RequestError(
                "'top_p' is not supported by the PAC ensemble (its candidates "
                "are the public model's top_k tokens); only 1 is accepted",
                "top_p",
            )
        if sid is not None:
            await asyncio.to_thread(self._info, sid, principal)  # 404 before queueing
        tokenizer = getattr(self.ensemble, "tokenizer", None)
        fmt = AnswerFormat(kind, self.name, tokenizer, include_usage=request.include_usage)
        if not request.stream:
            answer, prompt_tokens = await self._answer(principal, request, sid, None)
            return {**fmt.body([answer], prompt_tokens), **(answer.extra or {})}
        context = getattr(self.ensemble, "context", None) or self.cfg.fallback_context
        ids = fit_context(request, self.cfg.max_prompt_chars, self.ensemble.encode, context)
        sink = TokenSink(lockstep=True)  # each token charged is sent before the next step
        text = TextStream(tokenizer, request.stop, getattr(self.ensemble, "eos_ids", ()))
        answer = self._answer(principal, request, sid, sink)
        return answer_events(fmt, [(sink, _first(answer), text)], len(ids))

    async def _answer(
        self, principal: str, request: CompletionRequest, sid: str | None, sink: Any
    ) -> tuple[Answer, int]:
        """Generate on the decode thread; the answer (``extra``: its ``privacy``)."""
        start = time.perf_counter()
        decoder, temperature = self._decoding(request)
        out, info = await self._in_order(
            self._completion(principal, sid, request, decoder, temperature, sink)
        )
        tokens = len(out.token_ids)
        if self.metrics is not None:
            with contextlib.suppress(Exception):  # metrics never fail a completion
                self.metrics.update(out, self.curator.deployment_info())
        self.log.info(
            "pac completion: prompt_tokens=%d completion_tokens=%d private=%d free=%d "
            "fallback=%d charged_nats=%.6g decoder=%s one_shot=%s exhausted=%s streamed=%s "
            "latency_ms=%.1f",
            out.prompt_tokens,
            tokens,
            out.private_tokens,
            out.free_tokens,
            out.fallback_tokens,
            out.charged_nats,
            decoder,
            sid is None,
            out.exhausted,
            sink is not None,
            1000 * (time.perf_counter() - start),
        )
        privacy = {
            "session": sid,
            "one_shot": sid is None,
            "decoder": decoder,
            "charged_nats": out.charged_nats,
            "private_tokens": out.private_tokens,
            "free_tokens": out.free_tokens,
            "fallback_tokens": out.fallback_tokens,
            "public_fallback": out.fallback_tokens > 0,
            "budget_exhausted": bool(out.exhausted or out.fallback_tokens),
            "session_charged_nats": info["charged"],
            "remaining_nats": info["remaining"],
            "key_remaining_nats": info["owner_remaining"],
            "per_token_budget_nats": self.curator.b,
        }
        answer = Answer(out.text, out.finish_reason, tokens, extra={"privacy": privacy})
        return answer, out.prompt_tokens

    def _completion(
        self,
        principal: str,
        sid: str | None,
        request: CompletionRequest,
        decoder: str,
        temperature: float,
        sink: Any = None,
    ) -> PacJob:
        """The decode thread's job for one completion: checks and (one-shot) a session of its
        own at its start, then its steps beside the others'; the value is ``(completion,
        session info)``. ``sink`` (a :class:`~privcode.serve.streaming.TokenSink`) gets each
        released token; once cancelled, the decode ends before its next step."""
        one_shot = {"sid": None}

        def start() -> Any:

            context = getattr(self.ensemble, "context", None) or self.cfg.fallback_context
            fit_context(request, self.cfg.max_prompt_chars, self.ensemble.encode, context)
            stop_when_spent = self.cfg.on_exhausted == "error"
            if stop_when_spent:
                why = (
                    self.curator.owner_can_pay(principal)
                    if sid is None
                    else self.curator.can_pay(sid, principal)
                )
                if why is not None:
                    raise _exhausted(why)
            session = sid
            if session is None:
                try:
                    session = one_shot["sid"] = self.curator.open_session(None, principal)
                except SessionLimitError as exc:
                    raise RequestError(
                        str(exc), status=429, type="rate_limit_error", code="too_many_sessions"
                    ) from None
            # numpy's generators take seeds >= 0; OpenAI seeds may be negative.
            seed = None if request.seed is None else request.seed % (1 << 64)
            return self.ensemble.decode(
                self.curator,
                session,
                request.prompt,
                request.max_tokens,
                decoder=decoder,
                temperature=temperature,
                seed=seed,
                stop=request.stop,
                on_exhausted="stop" if stop_when_spent else "fallback",
                sink=sink,
            )

        def finish(decode: Any) -> tuple[Any, dict[str, Any]]:
            return decode.result(), self.curator.session_info(decode.session_id)

        def cleanup() -> None:
            if one_shot["sid"] is not None:
                self.curator.close_session(one_shot["sid"])

        return PacJob(sid, start, finish, cleanup)


async def _first(pair: Any) -> Answer:
    return (await pair)[0]
