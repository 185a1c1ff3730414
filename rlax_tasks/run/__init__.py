"""`rlax run` and the other runners: supervisors, the commands that start a run's components,
and its report; what they launch is planned by ``rlax_tasks.plan``.

The package imports nothing itself: Airflow's light modules import ``run.progress`` without
the launch path (``run.cli`` registers the commands)."""
