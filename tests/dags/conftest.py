"""The DAG tests' paths; Airflow's environment is set up in tests/conftest.py (it must precede
the first import of airflow anywhere in the session)."""

from __future__ import annotations

import json

import pytest

from tests.conftest import DAGS, PLUGINS, REPO

__all__ = ["DAGS", "PLUGINS", "REPO"]


@pytest.fixture
def airflow_db():
    """A fresh Airflow metadata database for a `dag.test()` run."""
    from airflow.utils import db

    db.resetdb()
    yield


def read_jsonl(path: str) -> list[dict]:
    """The rows of a run's JSONL file (metrics, lineage); [] while it does not exist."""
    try:
        with open(path) as f:
            return [json.loads(line) for line in f if line.strip()]
    except FileNotFoundError:
        return []
