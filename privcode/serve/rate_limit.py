"""One rate limit per API key across an app's replicas: the token buckets in one Ray actor.

A :class:`~privcode.serve.guard.RateLimiter` in each replica would let N replicas take N
times the configured rate. :class:`SharedRateLimiter` keeps one bucket per key in a small
named actor (:class:`RateBuckets`, no CPU, detached so it outlives any one replica) that
every replica of the app finds by name; each request costs one actor call.

The actor's name holds the Serve app and deployment and the limits, so a redeploy with new
limits starts new buckets. If the actor cannot be reached, the replica falls back to a
bucket of its own (still a limit, per replica) and logs it once: the limit guards against
floods; it is not a privacy control.
"""

from __future__ import annotations

import logging
from typing import Any

import ray

from privcode.serve.guard import RateLimiter

__all__ = ["RateBuckets", "SharedRateLimiter", "shared_limiter_name"]

log = logging.getLogger("privcode.serve")
NAMESPACE = "privcode-serve"


@ray.remote(num_cpus=0, max_restarts=-1)
class RateBuckets:
    """The token buckets of one app: ``take(principal)`` as :meth:`RateLimiter.take`."""

    def __init__(self, rate: float, burst: int):
        self.limiter = RateLimiter(rate, burst)

    def take(self, principal: str) -> float:
        return self.limiter.take(principal)


def shared_limiter_name(rate: float, burst: int) -> str | None:
    """The buckets' actor name for this Serve replica's app and deployment; None outside
    a replica (tests, scripts: a per-process limiter)."""
    from ray import serve

    try:
        ctx = serve.get_replica_context()
    except Exception:  # noqa: BLE001 - RayServeException outside a replica
        return None
    if ctx is None:
        return None
    return f"rate:{ctx.app_name}:{ctx.deployment}:{float(rate):g}:{int(burst)}"


class SharedRateLimiter:
    """:class:`RateLimiter`'s interface (``rate``, ``burst``, ``take``), with ``take`` async,
    over the named :class:`RateBuckets` every replica shares."""

    def __init__(self, name: str, rate: float, burst: int):
        self.rate, self.burst, self.name = float(rate), int(burst), name
        self._local = RateLimiter(rate, burst)  # the fallback, and the arguments' check
        self._actor: Any = None
        self._warned = False

    def _buckets(self) -> Any:
        if self._actor is None:
            self._actor = RateBuckets.options(
                name=self.name, namespace=NAMESPACE, get_if_exists=True, lifetime="detached"
            ).remote(self.rate, self.burst)
        return self._actor

    async def take(self, principal: str) -> float:
        try:
            return float(await self._buckets().take.remote(principal))
        except Exception as exc:  # noqa: BLE001 - an actor that died or cannot start
            self._actor = None
            if not self._warned:
                self._warned = True
                log.warning(
                    "shared rate limit unavailable (%s): this replica limits on its own",
                    type(exc).__name__,
                )
            return self._local.take(principal)
