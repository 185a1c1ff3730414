"""Workers over several parameter-server replicas: each has a home replica, and fails over to
the next live one when its home is gone or sends a corrupted version (docs/design.md §16).

``ReplicaClient`` answers the calls a worker makes of ``ParameterServerClient`` (register, pull,
ack, heartbeats); workers are spread evenly by ``assign_replica``. After a failover the client
goes back to its home replica once that answers again, so a restarted replica gets its workers
back and the load stays even. The host copy a delta pull builds on moves with the worker, so a
pull from another replica holding the same version (same digest) is still a delta."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from rlax_tasks.paramserver.assignment import failover_order
from rlax_tasks.paramserver.client import ParameterServerClient, heartbeats
from rlax_tasks.paramserver.errors import (
    CorruptedWeightsError,
    ParameterServerError,
    ServerUnavailableError,
)
from rlax_tasks.services.http import TRANSPORT_ERRORS

log = logging.getLogger(__name__)

T = TypeVar("T")

# what moves a worker to the next replica: its replica is gone, or sent a corrupted version
FAILOVER_ERRORS = (ServerUnavailableError, CorruptedWeightsError, *TRANSPORT_ERRORS)


class ReplicaClient:
    """A worker's client over replicas ``urls``: pulls from ``urls[home]``, fails over to the
    next live one; thread-safe like ``ParameterServerClient``."""

    def __init__(
        self,
        urls: Sequence[str],
        home: int = 0,
        token: str | None = None,
        worker_id: str | None = None,
        home_retry_s: float = 30.0,
        **client_kwargs: Any,
    ) -> None:
        """``client_kwargs``: each replica's ``ParameterServerClient`` settings (timeouts,
        retries, delta). ``home_retry_s``: how often a failed-over worker asks its home."""
        urls = list(urls)
        if not urls:
            raise ValueError("urls: give at least one parameter-server URL")
        if not 0 <= home < len(urls):
            raise ValueError(f"home must be in [0, {len(urls)}), got {home}")
        self.urls, self.home, self.worker_id = urls, home, worker_id
        self.home_retry_s = home_retry_s
        self._clients = [
            ParameterServerClient(u, token, worker_id=worker_id, **client_kwargs) for u in urls
        ]
        self._active = home
        self._lock = threading.RLock()
        self._registered = False
        self._last_home_try = 0.0
        self.failovers = 0
        self._heartbeat_stop: threading.Event | None = None

    # ------------------------------------------------------------------ where it pulls
    @property
    def current(self) -> str:
        """The URL of the replica in use."""
        return self.urls[self._active]

    @property
    def url(self) -> str:
        return self.current

    @property
    def last_pull(self) -> Any:
        """The last pull's ``PullStats`` (of the replica in use)."""
        return self._clients[self._active].last_pull

    def _use(self, index: int, why: str) -> None:
        """Moves this worker to replica ``index``: registered there first, the delta base moved,
        then deregistered from the one it leaves (best effort: it may be dead)."""
        old = self._active
        if index == old:
            return
        new = self._clients[index]
        if self._registered:
            new.register()  # raises when that one is down too: the caller tries the next
        self._clients[old].hand_over_base(new)
        self._active = index
        if index == self.home:
            log.info("worker %s back on its home replica %s", self.worker_id, new.url)
        else:
            self.failovers += 1
            log.warning(
                "worker %s: replica %s %s; now on %s",
                self.worker_id, self._clients[old].url, why, new.url,
            )  # fmt: skip
        if self._registered:
            with contextlib.suppress(ParameterServerError, *TRANSPORT_ERRORS):
                self._clients[old].deregister()

    def _try_home(self) -> None:
        """Away from home for a while: back as soon as the home replica answers again."""
        if self._active == self.home:
            return
        now = time.monotonic()
        if now - self._last_home_try < self.home_retry_s:
            return
        self._last_home_try = now
        try:
            self._clients[self.home].latest_version()
            self._use(self.home, "answers again")
        except FAILOVER_ERRORS:
            return

    def _with_failover(self, what: str, call: Callable[[ParameterServerClient], T]) -> T:
        """``call`` on the replica in use; on a failover error, on the next live one, in
        ``failover_order``; the last error when every replica failed."""
        with self._lock:
            self._try_home()
            order = failover_order(self._active, len(self._clients))
        error: Exception | None = None
        for index in order:
            with self._lock:
                try:
                    self._use(index, f"failed ({error!r})" if error else "")
                except FAILOVER_ERRORS as e:
                    error = e
                    continue
                client = self._clients[index]
            try:
                return call(client)
            except FAILOVER_ERRORS as e:
                log.info("worker %s: %s on %s failed: %r", self.worker_id, what, client.url, e)
                error = e
        assert error is not None
        raise error

    # ------------------------------------------------------------------ the worker's calls
    def register(self) -> None:
        """Registers at the replica in use (the next live one when it is down)."""
        self._registered = True
        self._with_failover("register", lambda c: c.register())

    def deregister(self) -> None:
        self._registered = False
        self._clients[self._active].deregister()

    def heartbeat(self) -> None:
        self._with_failover("heartbeat", lambda c: c.heartbeat())

    def ack(self, version: int) -> None:
        """Acks ``version`` at the replica in use (the one it was pulled from)."""
        self._clients[self._active].ack(version)

    def latest_version(self) -> int | None:
        return self._with_failover("latest", lambda c: c.latest_version())

    def status(self) -> dict[str, Any]:
        return self._with_failover("status", lambda c: c.status())

    def pull(self, min_version: int | None = None, **kwargs: Any) -> tuple[int, Any]:
        """The newest version >= ``min_version`` from the replica in use, failing over as
        above (``ParameterServerClient.pull``'s keywords)."""
        return self._with_failover("pull", lambda c: c.pull(min_version, **kwargs))

    def pull_version(self, version: int, **kwargs: Any) -> tuple[int, Any]:
        return self._with_failover("pull", lambda c: c.pull_version(version, **kwargs))

    def start_heartbeats(self, interval_s: float = 10.0) -> None:
        """A heartbeat every ``interval_s`` to the replica in use, until ``close()``."""
        if self._heartbeat_stop is None:
            where = f"of {self.worker_id} (every replica)"
            self._heartbeat_stop = heartbeats(self.heartbeat, interval_s, where)

    def close(self) -> None:
        if self._heartbeat_stop is not None:
            self._heartbeat_stop.set()
            self._heartbeat_stop = None
        for c in self._clients:
            c.close()

    def __enter__(self) -> ReplicaClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
