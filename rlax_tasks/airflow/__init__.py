"""Airflow integration: operators (provision, run `rlax` jobs, teardown) and their triggers.

Names resolve lazily (``operators``, ``triggers``), so the triggerer, which imports
``rlax_tasks.airflow.triggers``, never loads the operator module."""

from __future__ import annotations

from rlax_tasks.utils.lazy_exports import lazy_exports

__all__, __getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "ProvisionSliceOperator": ".operators",
        "ProvisionSlicesOperator": ".operators",
        "RlaxJobOperator": ".operators",
        "TeardownSliceOperator": ".operators",
        "JobPreemptedError": ".job_outcome",
        "JobFailedError": ".job_outcome",
        "SliceUnavailableError": ".job_outcome",
        "raise_for_job_event": ".job_outcome",
        "job_name_for": ".job_outcome",
        "start_jobs": ".operators",
        "JobStateTrigger": ".triggers",
        "SliceReadyTrigger": ".triggers",
    },
)
