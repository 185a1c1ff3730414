"""RLAX tasks package."""
