"""The run directory (DESIGN §7): its object store, file names, lock and notices. JAX-free."""
