"""The RLAX dashboard: runs under the configured run roots, their state and plots.

Loaded by ``plugins/rlax_plugin.py`` (Airflow imports every .py file of the plugins folder on its
own, so this package is listed in plugins/.airflowignore and imported as a package instead).
"""

from rlax_dashboard.app import create_app
from rlax_dashboard.runs import list_runs, read_series, run_roots_from_env

__all__ = ["create_app", "list_runs", "read_series", "run_roots_from_env"]
