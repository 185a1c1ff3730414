"""The planner (docs/design.md §12): where each job runs, whether it fits, which slices it
needs, its addresses and command lines, and the checks before anything starts. It starts
nothing: `rlax run` (``rlax_tasks.run``) and the rlax_train DAG (``rlax_tasks.airflow``)
launch what it plans. The package imports nothing itself and no module here loads JAX."""
