"""RLAX tasks package."""

import os

# transformers advises at import when PyTorch is missing; RLAX needs PyTorch only for its
# reference tests and the TRL benchmark, so the line would only alarm (a caller's own setting wins)
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
