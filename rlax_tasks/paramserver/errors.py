"""The errors a ``ParameterServerClient`` raises: each says which request failed and why."""

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
