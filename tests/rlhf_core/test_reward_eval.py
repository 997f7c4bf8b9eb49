import math

import pytest
import torch

from rlhf_core.reward_eval import accuracy_by_group, calibration_table


def test_accuracy_by_group():
    chosen = torch.tensor([1.0, 2.0, 0.0, 5.0, -1.0])
    rejected = torch.tensor([0.0, 3.0, 1.0, 4.0, -2.0])  # correct: T F F T T
    out = accuracy_by_group(
        chosen, rejected, {"batch": ["b1", "b1", "b2", "b2", "b2"], "confidence": [9, 9, 1, 1, 9]}, "eval"
    )
    assert out["eval/accuracy"] == pytest.approx(0.6)
    assert out["eval/accuracy/batch/b1"] == pytest.approx(0.5)
    assert out["eval/accuracy/batch/b2"] == pytest.approx(2 / 3)
    assert out["eval/accuracy/confidence/9"] == pytest.approx(2 / 3)
    assert out["eval/accuracy/confidence/1"] == pytest.approx(0.5)
    assert out["eval/count/batch/b2"] == 3
    # 3 of 5: the 95% Wilson interval
    assert (out["eval/accuracy_ci_low"], out["eval/accuracy_ci_high"]) == pytest.approx((0.2307, 0.8824), abs=1e-4)


def test_calibration_table():
    chosen = torch.tensor([0.1, 0.2, -0.1, 3.0, 2.9])
    rejected = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0])
    rows = calibration_table(chosen, rejected, bins=3)
    assert [r["count"] for r in rows] == [3, 2]
    assert rows[0]["accuracy"] == pytest.approx(2 / 3) and rows[1]["accuracy"] == 1.0
    assert rows[1]["ideal"] == pytest.approx(1 / (1 + math.exp(-rows[1]["center"])))
