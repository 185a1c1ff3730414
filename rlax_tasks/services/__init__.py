"""Plumbing every RLAX HTTP service shares: addresses, the guarded app and client, wire errors."""
