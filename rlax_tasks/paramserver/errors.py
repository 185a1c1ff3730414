"""The parameter server's errors: what its store refuses (answered as 4xx/5xx, raised again by
the client for a 409) and what a ``ParameterServerClient`` raises (each says which request failed
and why)."""

from __future__ import annotations


class ParameterServerError(RuntimeError):
    """The parameter server refused or failed a request."""


class AuthenticationError(ParameterServerError):
    """401 (no token sent) or 403 (wrong token)."""


class ServerUnavailableError(ParameterServerError, ConnectionError):
    """The server could not be reached (or died mid-transfer) after the retries."""


class CorruptedWeightsError(ParameterServerError):
    """A pulled version kept failing verification (a block's CRC32C, a malformed or
    inconsistent stream) after the retries."""


class PullTimeoutError(ParameterServerError, TimeoutError):
    """No version >= min_version appeared within the timeout."""


class PushTimeoutError(ParameterServerError, TimeoutError):
    """The server had no room for a pushed version within ``push_wait_s`` (workers held it)."""


class PushAssemblyTimeoutError(PushTimeoutError):
    """A multi-host push: not every host's part reached the server within its
    ``assembly_timeout_s`` (HTTP 408); the partial version was discarded."""


# --------------------------------------------------------------------------- the store
class VersionConflictError(ValueError):
    """A pushed version is not newer than the newest one (versions strictly increase)."""


class UnknownVersionError(KeyError):
    """The version asked for is not (or no longer) held in memory."""


class VersionGoneError(UnknownVersionError):
    """The version was garbage-collected and its shared memory reused before it could be read."""


class VersionTooLargeError(ValueError):
    """A pushed version can never fit in ``keep_bytes`` (the message names both numbers)."""


class NoRoomError(RuntimeError):
    """A push does not fit in ``keep_bytes`` yet: workers still hold the older versions."""


class PartsMissingError(RuntimeError):
    """Not every part of a multi-host version arrived within ``assembly_timeout_s`` of the first
    (the message names the version and the parts received and missing); it was discarded."""
