"""Process-level tuning for long-running host-compute processes: malloc and garbage collection."""
