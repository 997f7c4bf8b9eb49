"""Prefect flows composing the ``tasks`` stages into the RLHF pipeline."""
