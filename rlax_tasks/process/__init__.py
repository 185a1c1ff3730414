"""Process-level concerns of the long-running jobs: malloc and garbage-collection tuning, and the
check of the devices a JAX job found against its placement."""
