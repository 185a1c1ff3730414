"""The DAG tests' paths; Airflow's environment is set up in tests/conftest.py (it must precede
the first import of airflow anywhere in the session)."""

from __future__ import annotations

import pytest

from tests.conftest import DAGS, PLUGINS, REPO

__all__ = ["DAGS", "PLUGINS", "REPO"]


@pytest.fixture
def airflow_db():
    """A fresh Airflow metadata database for a `dag.test()` run."""
    from airflow.utils import db

    db.resetdb()
    yield
