"""Parameter server: versioned weights in host memory, streamed over HTTP, mirrored durably.

docs/design.md §6 is the contract: ``ParameterServerClient.push / pull / ack / latest_version``,
``rlax ps serve`` (``cli``); ``server`` runs it, ``protocol`` names its HTTP headers, ``wire`` the
byte format."""

from __future__ import annotations

from rlax_tasks.utils.lazy_exports import lazy_exports

__all__, __getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "AuthenticationError": ".errors",
        "CorruptedWeightsError": ".errors",
        "ParameterServer": ".server",
        "ParameterServerClient": ".client",
        "ParameterServerError": ".errors",
        "ReplicaClient": ".replicas",
        "PullTimeoutError": ".errors",
        "PushAssemblyTimeoutError": ".errors",
        "PushTimeoutError": ".errors",
        "ServerConfig": ".server_config",
        "ServerUnavailableError": ".errors",
        "VersionConflictError": ".errors",
        "assign_replica": ".assignment",
        "add_ps_parser": ".cli",
        "flatten_named": ".naming",
        "unflatten_named": ".naming",
    },
)
