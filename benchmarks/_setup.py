"""Imported first by a benchmark run as a script (``python benchmarks/X.py``): puts the
repository root on ``sys.path`` (for ``rlax_tasks`` and ``benchmarks.*``) and runs JAX on the
CPU unless ``JAX_PLATFORMS`` says otherwise, before anything imports JAX."""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
os.environ.setdefault("JAX_PLATFORMS", "cpu")
