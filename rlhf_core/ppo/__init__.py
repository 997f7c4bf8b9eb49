"""PPO (Huang et al. 2024, Section 7, Details 20-25): its math, its four models, the rollout with
its steps 2-3, its evaluation during training, and the recipe that runs the steps in one loop.
"""
