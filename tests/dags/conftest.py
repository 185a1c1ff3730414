"""Airflow in a temporary AIRFLOW_HOME (SQLite), with the dags/ and
plugins/ folders on sys.path as Airflow puts them."""

from __future__ import annotations

import os
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DAGS = os.path.join(REPO, "dags")
PLUGINS = os.path.join(REPO, "plugins")

# must be set before airflow is imported anywhere in this session
_home = tempfile.mkdtemp(prefix="rlax-airflow-home-")
os.environ.setdefault("AIRFLOW_HOME", _home)
os.environ.setdefault("AIRFLOW__CORE__DAGS_FOLDER", DAGS)
os.environ.setdefault("AIRFLOW__CORE__PLUGINS_FOLDER", PLUGINS)
os.environ.setdefault("AIRFLOW__CORE__LOAD_EXAMPLES", "False")
os.environ.setdefault("AIRFLOW__CORE__UNIT_TEST_MODE", "True")
for path in (DAGS, PLUGINS):
    if path not in sys.path:
        sys.path.append(path)
