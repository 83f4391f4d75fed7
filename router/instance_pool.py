"""The router's view of the engine instances: discovered from the registry, kept when Redis is down.

An instance missing from a registry read is kept for ``REMOVAL_GRACE_S`` more: a Redis that restarted
empty lists nobody until the next heartbeats, and that must not look like every instance died. It is
also kept while its own progress messages keep arriving (a Redis that refuses writes).
(A dead instance is found sooner anyway: sends to it fail with EAGAIN and mark it unavailable.)

Besides what instances report in their heartbeats, the pool counts the requests this router has in
flight on each instance, so a burst spreads out before the next heartbeat shows the new load.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter

from common.model.loader import same_model_config
from common.registry import InstanceInfo, Registry
from router.engine_client import EngineClient

logger = logging.getLogger(__name__)

UNAVAILABLE_S = 5.0
REMOVAL_GRACE_S = 3.0


class InstancePool:
    """Live instances by id. ``refresh`` replaces them from Redis; a failed read keeps the old ones."""

    def __init__(
        self, registry: Registry | None, client: EngineClient, refresh_interval_s: float = 0.5,
        model_identity: str | None = None,
    ) -> None:
        """``model_identity``: the router's model; instances registered with another config are left out
        (None: every instance)."""
        self._registry = registry
        self._model_identity = model_identity
        self._foreign: set[str] = set()  # instances left out for their model, each logged once
        self._client = client
        self.refresh_interval_s = refresh_interval_s
        self._instances: dict[str, InstanceInfo] = {}
        self._last_seen: dict[str, float] = {}
        self._unavailable_until: dict[str, float] = {}
        self.inflight: Counter[str] = Counter()
        self.registry_ok = registry is not None
        self._refreshed_at = float("-inf")
        self._refreshing: asyncio.Future[None] | None = None
        self._task: asyncio.Task[None] | None = None
        self._lease_task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        if self._registry is None:
            return
        await self.refresh()
        self._task = asyncio.create_task(self._refresh_loop(), name="instance-refresh")
        self._lease_task = asyncio.create_task(self._lease_loop(), name="engine-leases")

    async def stop(self) -> None:
        for task in (self._task, self._lease_task):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    async def _refresh_loop(self) -> None:
        while True:
            await asyncio.sleep(self.refresh_interval_s)
            await self._refresh_logged()  # the loop survives anything a refresh throws

    async def _lease_loop(self) -> None:
        """Renew this router's lease on every known engine, on its own clock: a slow or hung Redis
        read in ``refresh`` must not let the engines drop this router's requests."""
        while True:
            await asyncio.sleep(self.refresh_interval_s)
            try:
                self._client.renew_leases([info.control_address for info in self._instances.values()])
            except Exception:
                logger.exception("lease renewal failed")

    async def refresh_soon(self, max_age_s: float = 0.05, max_wait_s: float = 0.5) -> None:
        """A fresh view for a request about to be sent again after a refusal or a loss: an instance
        that began draining (and said so in the registry) is then passed over, instead of being
        tried again until the next periodic refresh. One read serves the requests that ask at once;
        a view younger than ``max_age_s`` is kept; a Redis slower than ``max_wait_s`` is not waited
        for (the read goes on, and the request with the view it has)."""
        if self._registry is None:
            return
        if self._refreshing is None:
            if time.monotonic() - self._refreshed_at < max_age_s:
                return
            self._refreshing = asyncio.ensure_future(self._refresh_logged())
            self._refreshing.add_done_callback(lambda _: setattr(self, "_refreshing", None))
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.shield(self._refreshing), max_wait_s)

    async def _refresh_logged(self) -> None:
        try:
            await self.refresh()
        except Exception:
            logger.exception("instance refresh failed")

    async def refresh(self) -> None:
        assert self._registry is not None
        found = await asyncio.to_thread(self._registry.try_instances)
        self._refreshed_at = time.monotonic()
        was_ok, self.registry_ok = self.registry_ok, found is not None
        if found is None:
            return
        found = self._own_model(found)
        now = time.monotonic()
        if not was_ok:  # the grace period of instances missing from the registry starts now
            self._last_seen = dict.fromkeys(self._last_seen, now)
        self._last_seen.update((info.instance_id, now) for info in found)
        fresh = {info.instance_id for info in found}
        # An instance whose progress messages still arrive is alive whatever Redis says: a Redis at
        # maxmemory refuses the heartbeat writes, and the entries expire while the engines serve.
        heard = self._client.last_heard
        kept = [
            info
            for instance_id, info in self._instances.items()
            if instance_id not in fresh
            and (now - self._last_seen.get(instance_id, 0.0) <= REMOVAL_GRACE_S
                 or now - heard.get(instance_id, -REMOVAL_GRACE_S) <= REMOVAL_GRACE_S)
        ]
        self.set_instances([*found, *kept])

    def _own_model(self, found: list[InstanceInfo]) -> list[InstanceInfo]:
        """``found`` without the instances that serve another model (a deployment of another model under
        the same Redis namespace): they would answer this model's requests with theirs."""
        if self._model_identity is None:
            return found
        own = [info for info in found if same_model_config(info.model, self._model_identity)]
        for info in found:
            if not same_model_config(info.model, self._model_identity) and info.instance_id not in self._foreign:
                self._foreign.add(info.instance_id)
                logger.warning("instance %s serves model %s, not this router's %s: left out (another "
                               "deployment in this Redis namespace?)", info.instance_id, info.model,
                               self._model_identity)
        return own

    def set_instances(self, infos: list[InstanceInfo]) -> None:
        """Replace the known instances (also used directly when running without a registry)."""
        previous = set(self._instances)
        self._instances = {info.instance_id: info for info in infos}
        self._last_seen = {i: t for i, t in self._last_seen.items() if i in self._instances}
        for info in infos:
            self._client.connect(info.control_address)  # connect early: the first send finds it up
            if info.instance_id not in previous:
                logger.info(
                    "instance %s (%s) joined at %s", info.instance_id, info.role, info.control_address
                )
        for gone in previous - set(self._instances):
            logger.info("instance %s left", gone)
        self._client.prune({info.control_address for info in infos})

    # -- queries -------------------------------------------------------------------------------
    def alive(self, role: str) -> list[InstanceInfo]:
        """Instances of ``role`` that are registered, not draining and not marked unavailable."""
        now = time.monotonic()
        return [
            info
            for info in self._instances.values()
            if info.role == role
            and not info.draining
            and self._unavailable_until.get(info.instance_id, 0.0) <= now
        ]

    def instances(self) -> list[InstanceInfo]:
        """Every known instance, as last heartbeated (a new list; the infos must not be mutated)."""
        return list(self._instances.values())

    def get(self, instance_id: str) -> InstanceInfo | None:
        return self._instances.get(instance_id)

    def restarted(self, holder: InstanceInfo) -> bool:
        """True when the registry lists another process under ``holder``'s id than the one ``holder``
        describes (another ``started_at``): the instance restarted, and what its last process held is
        gone, however alive the id looks (the new process heartbeats and sends progress under it)."""
        current = self.get(holder.instance_id)
        return current is not None and holder.started_at > 0 and current.started_at != holder.started_at

    def vanished(self, instance_id: str) -> bool:
        """True only when the registry has not listed the instance for the grace period."""
        return self.registry_ok and instance_id not in self._instances

    def ready(self) -> bool:
        """Requests can be served: a decode instance is alive (without a prefill one it prefills too)."""
        return bool(self.alive("decode"))

    def max_model_len(self) -> int | None:
        lengths = [info.max_model_len for info in self._instances.values() if info.max_model_len > 0]
        return min(lengths) if lengths else None

    def num_instances(self, role: str) -> int:
        return sum(1 for info in self._instances.values() if info.role == role)

    # -- bookkeeping ---------------------------------------------------------------------------
    def mark_unavailable(self, instance_id: str, seconds: float = UNAVAILABLE_S) -> None:
        logger.warning("instance %s unreachable; skipping it for %.0fs", instance_id, seconds)
        self._unavailable_until[instance_id] = time.monotonic() + seconds

    def acquire(self, instance_id: str) -> None:
        self.inflight[instance_id] += 1

    def release(self, instance_id: str) -> None:
        self.inflight[instance_id] -= 1
        if self.inflight[instance_id] <= 0:
            del self.inflight[instance_id]
