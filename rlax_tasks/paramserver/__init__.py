"""Parameter server: versioned weights in host memory, streamed over HTTP, mirrored durably.

DESIGN §6 is the contract: ``ParameterServerClient.push / pull / ack / latest_version``,
``rlax ps serve``; see ``server`` for the protocol and ``wire`` for the byte format.
"""

from rlax_tasks.paramserver.client import (
    AuthenticationError,
    CorruptedWeightsError,
    ParameterServerClient,
    ParameterServerError,
    PullTimeoutError,
    PushAssemblyTimeoutError,
    PushTimeoutError,
    ServerUnavailableError,
)
from rlax_tasks.paramserver.naming import flatten_named, unflatten_named
from rlax_tasks.paramserver.server import ParameterServer, ServerConfig, add_ps_parser
from rlax_tasks.paramserver.store import VersionConflictError

__all__ = [
    "AuthenticationError",
    "CorruptedWeightsError",
    "ParameterServer",
    "ParameterServerClient",
    "ParameterServerError",
    "PullTimeoutError",
    "PushAssemblyTimeoutError",
    "PushTimeoutError",
    "ServerConfig",
    "ServerUnavailableError",
    "VersionConflictError",
    "add_ps_parser",
    "flatten_named",
    "unflatten_named",
]
