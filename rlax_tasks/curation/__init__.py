"""Dataset curation: read any supported layout (rlax_tasks.data) with a quarantine, normalize,
filter, deduplicate (exact + MinHash), split by date, decontaminate, and keep prompts of
partial pass rate."""

from rlax_tasks.curation.dedup import MinHashConfig, minhash_signatures, near_duplicates
from rlax_tasks.curation.pipeline import CurationConfig, CurationResult, run_curation
from rlax_tasks.curation.report import write_outputs
from rlax_tasks.data.readers import Rejected

__all__ = [
    "CurationConfig",
    "CurationResult",
    "MinHashConfig",
    "Rejected",
    "minhash_signatures",
    "near_duplicates",
    "run_curation",
    "write_outputs",
]
