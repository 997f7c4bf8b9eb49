"""Training: SFT, the reward model and its normalisation, DPO, and what they share (the trainer
skeleton and its parts, sampling, the forward passes, the chunked language-model head, low-rank
adapters, data parallelism, offloading, an existing reward model, rule rewards).
"""
