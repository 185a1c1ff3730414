"""Small JAX-free utilities: config field checks, lazy package exports, progress lines."""
