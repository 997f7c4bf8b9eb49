"""Our DPO loss against TRL's: ``rlhf_core.train.dpo.dpo_loss`` on the fixed summed log-probabilities of
``benchmarks/results/dpo_loss_vs_trl.json``, whose losses and rewards TRL's own
``DPOTrainer._compute_loss`` computed (``benchmarks/dpo_loss_vs_trl.py``, run in ``.venv-trl``;
TRL is not imported here).

The rewards are the same float32 operations on both sides, ``beta * (logps - ref_logps)``, and
must agree bit for bit. The losses are equal in exact arithmetic but not in operation order: TRL
takes ``-logsigmoid(beta * (lr_c - lr_r))``, ours ``-logsigmoid(beta * lr_c - beta * lr_r)``
(the implicit rewards' difference), so they may differ by a few float32 roundings of the margin
(at most 1.2e-6 relative in the recorded cases); the tolerance is torch's float32 ``rtol`` with
``atol`` 1e-6 instead of 1e-5.
"""

import json
import math
from pathlib import Path

import pytest
import torch
from torch.testing import assert_close

from rlhf_core.train.dpo import dpo_loss

RESULT = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "dpo_loss_vs_trl.json"
RECORD = json.loads(RESULT.read_text())
NAMES = ("policy_chosen_logps", "policy_rejected_logps", "ref_chosen_logps", "ref_rejected_logps")
LOSS_TOL = {"rtol": 1.3e-6, "atol": 1e-6}


def _inputs() -> dict[str, torch.Tensor]:
    return {name: torch.tensor(RECORD["inputs"][name], dtype=torch.float32) for name in NAMES}


def _f32(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


def test_the_record_covers_random_pairs_and_extremes():
    """16 seeded pairs and the extremes: a saturated sigmoid either way and a margin of 0."""
    assert RECORD["versions"]["trl"] == "1.12.0"
    assert RECORD["trl_code"]["sigmoid_loss_source"] == "per_sequence_loss = -F.logsigmoid(self.beta * delta_score)"
    n = len(RECORD["labels"])
    assert n >= 20 and sum(label.startswith("random") for label in RECORD["labels"]) == 16
    assert all(len(RECORD["inputs"][name]) == n for name in NAMES)
    losses = [loss for case in RECORD["cases"] for loss in case["losses"]]
    assert min(losses) == 0.0 and max(losses) > 100 and any(abs(x - math.log(2)) < 1e-6 for x in losses)
    assert 0.05 in [case["beta"] for case in RECORD["cases"]]  # Table 6's beta, ours by default


@pytest.mark.parametrize("case", RECORD["cases"], ids=lambda case: f"beta={case['beta']}")
def test_dpo_loss_and_rewards_equal_trl(case):
    losses, chosen_rewards, rejected_rewards = dpo_loss(**_inputs(), beta=case["beta"])
    assert_close(losses, _f32(case["losses"]), **LOSS_TOL)
    assert_close(chosen_rewards, _f32(case["chosen_rewards"]), rtol=0, atol=0)
    assert_close(rejected_rewards, _f32(case["rejected_rewards"]), rtol=0, atol=0)
    # TRL's batch loss is the mean of the per-pair losses, its logged rewards their means (float32
    # sums, whose order may vary with the CPU's vector width: the loss tolerance)
    batch = case["batch"]
    assert_close(losses.mean(), _f32(batch["loss"]), **LOSS_TOL)
    assert_close(chosen_rewards.mean(), _f32(batch["rewards/chosen"]), **LOSS_TOL)
    assert_close(rejected_rewards.mean(), _f32(batch["rewards/rejected"]), **LOSS_TOL)
    accuracy = (chosen_rewards > rejected_rewards).float().mean()
    assert_close(accuracy, _f32(batch["rewards/accuracies"]), rtol=0, atol=0)
