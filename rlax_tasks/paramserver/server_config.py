"""``ServerConfig``: one parameter server's validated settings, and their defaults' one owner.

Light to import: `rlax ps serve`'s flags take their defaults from here (docs/design.md §6)."""

from __future__ import annotations

import dataclasses

from rlax_tasks.services.http import TOKEN_ENV
from rlax_tasks.utils.validation import check_int, check_number, field_error


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    """Validated settings of one parameter server (errors name the field)."""

    token: str = dataclasses.field(repr=False)
    host: str = "127.0.0.1"
    port: int = 0
    run_root: str | None = None  # local dir or gs://...; None: no durable mirror
    keep_versions: int = 2
    keep_bytes: int | None = None  # array payload held in RAM (versions + pushes); None: no limit
    mirror_every: int = 1
    mirror_keep: int = 2
    worker_timeout_s: float = 60.0
    io_timeout_s: float = 30.0  # any socket read/write stalled longer aborts that request
    max_wait_s: float = 30.0  # longest server-side long poll of one pull request
    verify_push: bool = True  # check every pushed block's CRC32C before the version is visible
    hash_threads: int = 0  # ignored (CRC32C is checked inline); kept for existing configs
    assembly_timeout_s: float = 600.0  # every part of a multi-host push within this of the first
    # versions live in shared memory; pulls from this host copy them from there, not over TCP
    shared_memory: bool = True
    # a replica (docs/design.md §16): the servers it relays every version from, first live one
    # first (the trainer pushes to replica 0 only); empty: this server takes pushes itself
    upstreams: tuple[str, ...] = ()
    # this replica's id at its upstream, where it registers like a worker, so a version there is
    # collected only once every live replica has confirmed a newer one
    replica_id: str = ""
    # bytes per second this server sends at most (its link, modelled as one token bucket shared
    # by every puller); None: no limit
    egress_bytes_per_s: int | None = None

    def __post_init__(self) -> None:
        if not self.token:
            raise ValueError(f"token is empty: set {TOKEN_ENV} to a secret string")
        error = field_error(ValueError)
        check_int("port", self.port, error, minimum=0, maximum=65535)
        for name in ("keep_versions", "mirror_every", "mirror_keep"):
            check_int(name, getattr(self, name), error, minimum=1)
        check_int("keep_bytes", self.keep_bytes, error, minimum=1, optional=True)
        for name in ("worker_timeout_s", "io_timeout_s", "max_wait_s", "assembly_timeout_s"):
            check_number(name, getattr(self, name), error, low=0, open_low=True)
        check_int("hash_threads", self.hash_threads, error, minimum=0)
        check_int("egress_bytes_per_s", self.egress_bytes_per_s, error, minimum=1, optional=True)
        object.__setattr__(self, "upstreams", tuple(self.upstreams))
        if any(not isinstance(u, str) or not u for u in self.upstreams):
            raise ValueError(f"upstreams: every entry must be a URL, got {self.upstreams!r}")
        if self.upstreams and not self.replica_id:
            raise ValueError("replica_id: a replica (upstreams given) needs an id, e.g. ps-1")
