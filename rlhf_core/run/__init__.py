"""Running the pipeline: the ``rlhf`` stage commands and ``rlhf plan``, one stage run shared with
the Prefect tasks, ``torchrun`` jobs, the checks before the first stage, sweeps, and the stage
table with the stages' cache keys.
"""
