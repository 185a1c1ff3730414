"""The parameter server's HTTP protocol names: headers, media types and limits (docs/design.md §6).

One owner for what the client and the server both spell; the routes are listed above
``http_handler.PSHandler.route``."""

from __future__ import annotations

MAX_JSON_BYTES = 65536  # a JSON request body (reserve, ack)
WORKER_HEADER = "X-RLAX-Worker"
RELAY_HEADER = "X-RLAX-Relay"  # "1": a replica's relay pulling (its bytes go first)
VERSION_HEADER = "X-RLAX-Version"
PART_HEADER = "X-RLAX-Push-Part"  # this push is part i (0-based) ...
PARTS_HEADER = "X-RLAX-Push-Parts"  # ... of n parts of a multi-host version
MAX_PARTS = 65536
# a pull answered with where the version lies in shared memory (the puller is on this host)
SHARED_MEMORY_TYPE = "application/vnd.rlax.shared-memory+json"
# a pull answered with the changes since the version the puller holds (its ``have`` and
# ``have_digest``): rlax_tasks/paramserver/delta.py, sent chunked
DELTA_TYPE = "application/vnd.rlax.weights-delta"
