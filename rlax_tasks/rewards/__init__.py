"""Reward verifiers: math answers (math.py), sandboxed code (sandbox.py, judge.py),
synthetic tasks (tasks/), and an HTTP service exposing them (service.py)."""
