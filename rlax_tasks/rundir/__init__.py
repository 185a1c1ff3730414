"""The run directory (docs/design.md §7): its object store, file names, lock and notices.
JAX-free."""
