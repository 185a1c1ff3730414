"""Dataset curation: read any supported layout (rlax_tasks.data) with a quarantine, normalize,
filter, deduplicate (exact + MinHash), split by date, decontaminate, and keep prompts of partial
pass rate."""

from __future__ import annotations

from rlax_tasks.utils.lazy_exports import lazy_exports

__all__, __getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "CurationConfig": ".pipeline",
        "CurationResult": ".pipeline",
        "MinHashConfig": ".dedup",
        "Rejected": "rlax_tasks.data.readers",
        "minhash_signatures": ".dedup",
        "near_duplicates": ".dedup",
        "run_curation": ".pipeline",
        "write_outputs": ".report",
    },
)
