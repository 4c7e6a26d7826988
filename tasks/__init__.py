"""Thin Prefect @task wrappers over trak_core (tasks.attribution, tasks.training) and the plain
functions they wrap (tasks.core, tasks.report, tasks.trainer: no Prefect import there)."""
