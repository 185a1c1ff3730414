"""Airflow integration: operators (provision, run `rlax` jobs, teardown) and their triggers.

``from rlax_tasks.airflow import ProvisionSliceOperator, RlaxJobOperator, TeardownSliceOperator``
(see ``operators`` for behaviour and error classes) and ``JobStateTrigger``,
``SliceReadyTrigger`` (see ``triggers``). Names are resolved lazily so that the triggerer, which
imports ``rlax_tasks.airflow.triggers``, never loads the operator module.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "ProvisionSliceOperator": "rlax_tasks.airflow.operators",
    "ProvisionSlicesOperator": "rlax_tasks.airflow.operators",
    "RlaxJobOperator": "rlax_tasks.airflow.operators",
    "TeardownSliceOperator": "rlax_tasks.airflow.operators",
    "JobPreemptedError": "rlax_tasks.airflow.operators",
    "JobFailedError": "rlax_tasks.airflow.operators",
    "SliceUnavailableError": "rlax_tasks.airflow.operators",
    "raise_for_job_event": "rlax_tasks.airflow.operators",
    "job_name_for": "rlax_tasks.airflow.operators",
    "start_jobs": "rlax_tasks.airflow.operators",
    "JobStateTrigger": "rlax_tasks.airflow.triggers",
    "SliceReadyTrigger": "rlax_tasks.airflow.triggers",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
