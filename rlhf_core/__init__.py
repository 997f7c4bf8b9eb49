"""RLHF with PPO for Reddit TL;DR summarization (Huang et al. 2024).

The pure core: configuration, data processing, models and the RLHF algorithm. Nothing
in this package imports Prefect or MLflow; orchestration and tracking wrap it from
``tasks/`` and ``flows/``.
"""

__version__ = "0.1.0"
