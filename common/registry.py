"""Service registry and prefix index in Redis.

Redis is a hint, never a dependency of correctness: every method here catches Redis errors, and
after a failure the client skips Redis for a short back-off so a dead server costs nothing per call.

Keys (all under ``namespace``):
  ``{ns}:instance:{id}``         the instance's ``InstanceInfo`` as JSON, with a TTL; with a cluster
                                 key, ``{"entry": <that JSON>, "mac": <hex>}`` (see ``Registry``)
  ``{ns}:instances``             set of registered ids (members whose key expired are dead)
  ``{ns}:block:{hash hex}``      set of instance ids holding that block
  ``{ns}:instance_blocks:{id}``  set of block hashes an instance holds, for clearing it
"""

from __future__ import annotations

import contextlib
import enum
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import msgspec
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from common.kvcache.kv_cache_manager import out_of_window

if TYPE_CHECKING:
    from common.cluster_key import ClusterKey

logger = logging.getLogger(__name__)

REDIS_TIMEOUT_S = 0.5
BACKOFF_S = 1.0
_CHUNK = 256
# Block ends of a prompt, back from its last, where ``PrefixIndex.match`` looks for a windowed instance's hit.
WINDOW_PROBE_BLOCKS = 64


# ``InstanceInfo.kv_layout`` of a decode instance that takes no KV (a tensor-parallel engine on GPUs): no
# prefill's layout fits it, so routers send it whole requests.
NO_KV_TRANSFER = "none"

class InstanceInfo(msgspec.Struct, kw_only=True):
    """What an engine instance publishes about itself on every heartbeat."""

    instance_id: str
    role: str  # "prefill" | "decode"
    model: str  # model identity used in block hashes
    control_address: str
    kv_address: str = ""
    metrics_url: str = ""
    block_size: int = 16
    max_model_len: int = 0
    num_requests_running: int = 0
    num_requests_waiting: int = 0
    kv_cache_usage_perc: float = 0.0  # fraction in [0, 1], as vLLM reports it
    num_blocks: int = 0  # the KV pool's size
    num_blocks_in_use: int = 0  # held by requests or transfers (cached, evictable blocks are free)
    draining: bool = False  # SIGTERM received: finishing what it holds, taking nothing new
    started_at: float = 0.0
    # Its KV cache's layout (``KVLayout.fingerprint``: dtype, shapes, model, block hashing): a prefill
    # hands KV only to a decode of the same. "" where unknown (taken as fitting any); ``NO_KV_TRANSFER``
    # for a decode that takes none (it runs whole requests).
    kv_layout: str = ""
    # The LoRA adapters it serves (its ``--lora-modules`` names): a request with one goes only to those.
    lora_names: list[str] = msgspec.field(default_factory=list)
    # How far back its model's queries read keys where every layer has a window (``ModelArch.kv_window``), else 0:
    # its prefix hits then need only the blocks a query after them reads (``PrefixIndex.match``).
    kv_window: int = 0


class SignedEntry(msgspec.Struct):
    """A registry entry as written with a cluster key: the exact bytes the MAC covers, and the MAC."""

    entry: msgspec.Raw
    mac: str


_info_encoder = msgspec.json.Encoder()
_info_decoder = msgspec.json.Decoder(InstanceInfo)
_signed_decoder = msgspec.json.Decoder(SignedEntry)


def _sealed(payload: bytes, key: ClusterKey | None, name: bytes) -> bytes:
    """An entry as written: its JSON, or with a key that JSON and its MAC over ``name``, a newline and the JSON."""
    if key is None:
        return payload
    return _info_encoder.encode(SignedEntry(msgspec.Raw(payload), key.sign(name + b"\n" + payload)))


def _opened(raw: bytes, key: ClusterKey | None, name: bytes) -> tuple[bytes, str | None]:
    """An entry's JSON as written (``_sealed``), and why it does not pass ``key`` (None where it does; without a key
    every entry does)."""
    try:
        signed: SignedEntry | None = _signed_decoder.decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError):
        signed = None  # an unsigned entry (or garbage: the plain decode after this says which)
    entry = raw if signed is None else bytes(signed.entry)
    if key is not None and (signed is None or not key.verify(name + b"\n" + entry, signed.mac)):
        return entry, "unsigned" if signed is None else "its MAC does not verify"
    return entry, None
_MAX_LOGGED_REJECTS = 1024


class Beat(enum.Enum):
    """What a heartbeat found: Redis down, the entry still there, or the entry gone (new or lost)."""

    UNREACHABLE = "unreachable"
    REFRESHED = "refreshed"
    REGISTERED = "registered"

    def __bool__(self) -> bool:
        return self is not Beat.UNREACHABLE


class RedisClient:
    """A Redis connection with short timeouts, no retries, and a back-off after each failure."""

    def __init__(self, redis_url: str, namespace: str) -> None:
        self.ns = namespace
        self.url = redis_url
        self._client = redis.Redis.from_url(
            redis_url,
            socket_timeout=REDIS_TIMEOUT_S,
            socket_connect_timeout=REDIS_TIMEOUT_S,
            retry=Retry(NoBackoff(), 0),
        )
        self._down_until = 0.0
        self._lock = threading.Lock()

    def key(self, *parts: str) -> str:
        return ":".join((self.ns, *parts))

    def run(self, what: str, fn: Callable[[redis.Redis], Any]) -> tuple[bool, Any]:
        """Call ``fn(client)``; ``(False, None)`` when Redis is unreachable or in back-off."""
        if time.monotonic() < self._down_until:
            return False, None
        try:
            return True, fn(self._client)
        except (redis.RedisError, OSError) as exc:
            with self._lock:
                if time.monotonic() >= self._down_until and isinstance(exc, redis.AuthenticationError):
                    # Not an outage: it will not heal by itself. (The URL is not logged: it holds the password.)
                    logger.error(
                        "redis %s failed: the server refused this service's credentials (%s); give them "
                        "in the redis URL: redis://[USER]:PASSWORD@HOST:PORT/DB (rediss:// for TLS)",
                        what, exc,
                    )
                elif time.monotonic() >= self._down_until:
                    logger.warning("redis %s failed (%s); retrying in %.1fs", what, exc, BACKOFF_S)
                self._down_until = time.monotonic() + BACKOFF_S
            return False, None

    def close(self) -> None:
        with contextlib.suppress(redis.RedisError, OSError):
            self._client.close()


def _chunks(items: Sequence[Any], size: int = _CHUNK) -> Iterator[Sequence[Any]]:
    for i in range(0, len(items), size):
        yield items[i : i + size]


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _clear_instance_blocks(rc: RedisClient, client: redis.Redis, instance_id: str) -> None:
    owned = rc.key("instance_blocks", instance_id)
    for batch in _chunks([_text(h) for h in client.smembers(owned)]):
        pipe = client.pipeline(transaction=False)
        for hex_hash in batch:
            pipe.srem(rc.key("block", hex_hash), instance_id)
        pipe.execute()
    client.delete(owned)


class Registry:
    """Instances register with a TTL and refresh it by heartbeat; readers see only live ones.

    With a ``cluster_key`` every entry written carries an HMAC-SHA256 over its key name and its
    exact JSON, and reading drops (and counts in ``num_rejected_entries``, logging each instance
    once) every entry that is unsigned or does not verify: whoever can write to Redis but lacks
    the key cannot add an instance or change one. Without a key entries are written unsigned and
    all are accepted (loopback development).
    """

    def __init__(
        self, redis_url: str, namespace: str = "pdserve", ttl_s: float = 3.0, cluster_key: ClusterKey | None = None
    ) -> None:
        self._rc = RedisClient(redis_url, namespace)
        self.ttl_ms = max(1, int(ttl_s * 1000))
        self._key = cluster_key
        self.num_rejected_entries = 0
        self._logged_rejects: set[str] = set()

    def heartbeat(self, info: InstanceInfo) -> Beat:
        """Register or refresh ``info``. Safe to call any time.

        ``Beat.REGISTERED`` means the entry was missing: the first beat, or Redis lost it (a restart,
        a flush, an expiry while this process stalled), so whatever else the instance published is
        likely gone too.
        """
        key = self._rc.key("instance", info.instance_id)
        payload = _sealed(_info_encoder.encode(info), self._key, key.encode())

        def op(client: redis.Redis) -> bool:
            pipe = client.pipeline(transaction=False)
            pipe.exists(key)
            pipe.set(key, payload, px=self.ttl_ms)
            pipe.sadd(self._rc.key("instances"), info.instance_id)
            return bool(pipe.execute()[0])

        ok, existed = self._rc.run("heartbeat", op)
        if not ok:
            return Beat.UNREACHABLE
        return Beat.REFRESHED if existed else Beat.REGISTERED

    def deregister(self, info: InstanceInfo) -> None:
        """Remove the instance and its prefix-index entries now instead of waiting for the TTL."""

        def op(client: redis.Redis) -> None:
            client.delete(self._rc.key("instance", info.instance_id))
            client.srem(self._rc.key("instances"), info.instance_id)
            _clear_instance_blocks(self._rc, client, info.instance_id)

        self._rc.run("deregister", op)

    def instances(self, role: str | None = None) -> list[InstanceInfo]:
        """Live instances (optionally of one role); [] when Redis is down."""
        found = self.try_instances(role)
        return [] if found is None else found

    def try_instances(self, role: str | None = None) -> list[InstanceInfo] | None:
        """Like ``instances`` but None when Redis is unreachable, so callers can keep what they knew.

        Instances whose key expired are dropped from the set and their prefix entries cleared.
        """
        ok, found = self._rc.run("instances", self._read_live)
        if not ok:
            return None
        return [info for info in found if role is None or info.role == role]

    def _read_live(self, client: redis.Redis) -> list[InstanceInfo]:
        ids = sorted(_text(i) for i in client.smembers(self._rc.key("instances")))
        if not ids:
            return []
        raws = client.mget([self._rc.key("instance", i) for i in ids])
        live: list[InstanceInfo] = []
        for instance_id, raw in zip(ids, raws, strict=True):
            if raw is None:
                # Expired: reap it so the prefix index does not grow with dead instances.
                client.srem(self._rc.key("instances"), instance_id)
                _clear_instance_blocks(self._rc, client, instance_id)
                continue
            try:
                info = self._open(instance_id, raw)
            except (msgspec.DecodeError, msgspec.ValidationError):
                logger.warning("ignoring malformed registry entry for %s", instance_id)
                continue
            if info is not None:
                live.append(info)
        return live

    def _open(self, instance_id: str, raw: bytes | str) -> InstanceInfo | None:
        """The entry if it passes this reader's key (any well-formed one without a key), else None."""
        raw = raw.encode() if isinstance(raw, str) else raw
        entry, refused = _opened(raw, self._key, self._rc.key("instance", instance_id).encode())
        if refused is not None:
            self._reject(instance_id, refused)
            return None
        info = _info_decoder.decode(entry)
        if info.instance_id != instance_id:
            raise msgspec.ValidationError(f"entry names instance {info.instance_id!r}")
        return info

    def _reject(self, instance_id: str, why: str) -> None:
        self.num_rejected_entries += 1
        if instance_id not in self._logged_rejects and len(self._logged_rejects) < _MAX_LOGGED_REJECTS:
            self._logged_rejects.add(instance_id)
            logger.warning(
                "ignoring registry entry of %r: %s (not written with this cluster's key)", instance_id, why
            )

    def close(self) -> None:
        self._rc.close()


class RuntimeAdapter(msgspec.Struct, kw_only=True):
    """A LoRA adapter loaded at run time (vLLM's ``/v1/load_lora_adapter``), as the cluster keeps it."""

    name: str
    path: str


_adapter_decoder = msgspec.json.Decoder(RuntimeAdapter)


class RuntimeAdapters:
    """The LoRA adapters loaded at run time, kept in Redis for the whole cluster (one hash, a field per adapter):
    a router writes one before it asks the engines to load it and deletes it before they unload it, and an engine
    that starts later (restarted after a crash, or added) loads them too (``common.service``).

    With a ``cluster_key`` each entry carries an HMAC-SHA256 over the hash's name, the adapter's name and its exact
    JSON, as registry entries do, and reading drops every entry that does not verify: whoever can write to Redis
    but lacks the key cannot make the engines load weights of their choosing."""

    def __init__(self, redis_url: str, namespace: str = "pdserve", cluster_key: ClusterKey | None = None) -> None:
        self._rc = RedisClient(redis_url, namespace)
        self._key = cluster_key
        self._hash = self._rc.key("lora_adapters")

    def put(self, name: str, path: str) -> bool:
        """Keep the adapter (replacing one of that name); False where Redis is unreachable."""
        payload = _sealed(_info_encoder.encode(RuntimeAdapter(name=name, path=path)), self._key, self._entry_name(name))
        return self._rc.run("lora adapter put", lambda client: client.hset(self._hash, name, payload))[0]

    def remove(self, name: str) -> bool:
        """Forget the adapter; False where Redis is unreachable."""
        return self._rc.run("lora adapter remove", lambda client: client.hdel(self._hash, name))[0]

    def all(self) -> dict[str, str] | None:
        """Each adapter's path by name (those that verify); None where Redis is unreachable."""
        ok, raw = self._rc.run("lora adapters", lambda client: client.hgetall(self._hash))
        if not ok:
            return None
        adapters: dict[str, str] = {}
        for field, value in raw.items():
            name = _text(field)
            adapter = self._open(name, value)
            if adapter is not None:
                adapters[name] = adapter.path
        return adapters

    def _entry_name(self, name: str) -> bytes:
        """What an entry's MAC covers before its JSON: the hash's name and the adapter's."""
        return self._hash.encode() + b"\n" + name.encode()

    def _open(self, name: str, raw: bytes) -> RuntimeAdapter | None:
        entry, refused = _opened(raw, self._key, self._entry_name(name))
        if refused is not None:
            logger.warning("ignoring runtime LoRA adapter %r: %s (not written with this cluster's key)", name, refused)
            return None
        try:
            adapter = _adapter_decoder.decode(entry)
        except (msgspec.DecodeError, msgspec.ValidationError):
            logger.warning("ignoring malformed runtime LoRA adapter entry %r", name)
            return None
        return adapter if adapter.name == name else None

    def close(self) -> None:
        self._rc.close()


class PrefixIndex:
    """Which instances hold which block hashes; used by the router to find cached prefixes."""

    def __init__(self, redis_url: str, namespace: str = "pdserve") -> None:
        self._rc = RedisClient(redis_url, namespace)

    def add(self, instance_id: str, block_hashes: Sequence[bytes]) -> bool:
        """Publish that ``instance_id`` holds these blocks; False if Redis is unreachable."""
        return self._update(instance_id, block_hashes, add=True)

    def remove(self, instance_id: str, block_hashes: Sequence[bytes]) -> bool:
        """Withdraw blocks (e.g. on eviction); False if Redis is unreachable."""
        return self._update(instance_id, block_hashes, add=False)

    def _update(self, instance_id: str, block_hashes: Sequence[bytes], add: bool) -> bool:
        if not block_hashes:
            return True
        owned = self._rc.key("instance_blocks", instance_id)

        def op(client: redis.Redis) -> None:
            for batch in _chunks([h.hex() for h in block_hashes]):
                pipe = client.pipeline(transaction=False)
                for hex_hash in batch:
                    if add:
                        pipe.sadd(self._rc.key("block", hex_hash), instance_id)
                    else:
                        pipe.srem(self._rc.key("block", hex_hash), instance_id)
                if add:
                    pipe.sadd(owned, *batch)
                else:
                    pipe.srem(owned, *batch)
                pipe.execute()

        return self._rc.run("prefix update", op)[0]

    def clear_instance(self, instance_id: str) -> bool:
        """Forget everything ``instance_id`` published (call it when an instance starts empty)."""
        return self._rc.run("clear instance", lambda c: _clear_instance_blocks(self._rc, c, instance_id))[0]

    def match(self, block_hashes: Sequence[bytes], block_size: int = 16, kv_window: int = 0) -> dict[str, int]:
        """instance_id -> number of leading blocks of ``block_hashes`` it holds, live instances only.

        Lookups are pipelined in chunks and stop once no instance still matches; {} when Redis is down.

        For instances whose queries read ``kv_window`` keys back at most (``InstanceInfo.kv_window``), a hit needs
        only the blocks a query after it reads, as their engines count hits (``KVCacheManager.get_computed_blocks``):
        the longest prefix whose last window of blocks an instance holds counts, whether or not it holds the ones
        before. That is looked for among the prompt's last ``WINDOW_PROBE_BLOCKS`` block ends, in one more round
        trip: where a conversation's next turn ends the earlier turns' blocks, whose first blocks went back first.
        """
        def lookup(client: redis.Redis) -> dict[str, int]:
            counts = self._match(client, block_hashes)
            if kv_window > 0 and block_hashes:
                for instance_id, k in self._window_match(client, block_hashes, block_size, kv_window).items():
                    counts[instance_id] = max(counts.get(instance_id, 0), k)
            return self._only_live(client, counts)

        ok, result = self._rc.run("prefix match", lookup)
        return result if ok else {}

    def _window_match(self, client: redis.Redis, block_hashes: Sequence[bytes], block_size: int,
                      kv_window: int) -> dict[str, int]:
        num = len(block_hashes)
        first_end = max(1, num - WINDOW_PROBE_BLOCKS)
        start = out_of_window(first_end * block_size, block_size, kv_window)  # the first block any end reads
        pipe = client.pipeline(transaction=False)
        for block_hash in block_hashes[start:]:
            pipe.smembers(self._rc.key("block", block_hash.hex()))
        runs: dict[str, int] = {}  # per instance, how many blocks up to here it holds in a row
        best: dict[str, int] = {}
        for end, members in enumerate(pipe.execute(), start + 1):
            runs = {instance_id: runs.get(instance_id, 0) + 1 for instance_id in map(_text, members)}
            if end >= first_end:
                needed = end - out_of_window(end * block_size, block_size, kv_window)
                best.update({instance_id: end for instance_id, run in runs.items() if run >= needed})
        return best

    def _match(self, client: redis.Redis, block_hashes: Sequence[bytes]) -> dict[str, int]:
        counts: dict[str, int] = {}
        running: set[str] | None = None
        position = 0
        for batch in _chunks(block_hashes, 64):
            pipe = client.pipeline(transaction=False)
            for block_hash in batch:
                pipe.smembers(self._rc.key("block", block_hash.hex()))
            for members in pipe.execute():
                holders = {_text(m) for m in members}
                running = holders if running is None else running & holders
                if not running:
                    return counts
                position += 1
                for instance_id in running:
                    counts[instance_id] = position
        return counts

    def _only_live(self, client: redis.Redis, counts: dict[str, int]) -> dict[str, int]:
        if not counts:
            return {}
        ids = list(counts)
        pipe = client.pipeline(transaction=False)
        for instance_id in ids:
            pipe.exists(self._rc.key("instance", instance_id))
        return {i: counts[i] for i, live in zip(ids, pipe.execute(), strict=True) if live}

    def close(self) -> None:
        self._rc.close()


class HeartbeatThread(threading.Thread):
    """Daemon thread that calls ``registry.heartbeat(info_fn())`` every ``interval_s`` seconds.

    ``info_fn`` is called from this thread, so it must be cheap and thread-safe (read counters).
    ``stop()`` may be called twice; it deregisters the last published info unless told not to.
    ``on_reconnect`` is called (from this thread) when a later heartbeat finds the entry gone, so
    the instance can republish the state a restarted or flushed Redis lost. Whether a beat failed
    in between does not matter: a restart can fall between two beats.
    """

    def __init__(
        self,
        registry: Registry,
        info_fn: Callable[[], InstanceInfo],
        interval_s: float = 1.0,
        on_reconnect: Callable[[], None] | None = None,
    ) -> None:
        super().__init__(name="registry-heartbeat", daemon=True)
        self.registry = registry
        self.info_fn = info_fn
        self.interval_s = interval_s
        self.on_reconnect = on_reconnect
        self._beats = 0
        self._stop_event = threading.Event()
        self._wake = threading.Event()
        self._last: InstanceInfo | None = None

    def run(self) -> None:
        while not self._stop_event.is_set():
            try:
                self._last = self.info_fn()
                beat = self.registry.heartbeat(self._last)
                if beat is Beat.REGISTERED and self._beats > 0 and self.on_reconnect is not None:
                    self.on_reconnect()
                if beat:
                    self._beats += 1
            except Exception:  # a bad info_fn must not kill the heartbeat
                logger.exception("heartbeat failed")
            self._wake.wait(self.interval_s)
            self._wake.clear()

    def beat_now(self) -> None:
        """Publish fresh info without waiting for the interval (e.g. the instance began draining)."""
        self._wake.set()

    def stop(self, deregister: bool = True, timeout_s: float = 2.0) -> None:
        self._stop_event.set()
        self._wake.set()
        if self.is_alive() and threading.current_thread() is not self:
            self.join(timeout_s)
        if deregister and self._last is not None:
            self.registry.deregister(self._last)
