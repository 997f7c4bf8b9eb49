"""The evaluation stages: the reward model's evaluation, DPO's implicit reward model evaluated as
the explicit one, and the evaluation by an LLM judge (the judges in
:mod:`rlhf_core.evaluation.judging`).
"""
