"""`rlax run`: the whole system as local processes under a supervisor, and its report.

The package imports nothing itself: Airflow's light modules import ``run.progress`` without
the launch path (``run.cli`` registers the commands)."""
