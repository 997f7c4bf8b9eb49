"""`rlhf evaluate` refuses a policy that is no causal LM in one line, before anything starts (the
whole command on a finished run: tests/flows/test_pipeline.py)."""

import pytest

from flows.cli import main


@pytest.mark.heavy
def test_a_policy_that_is_no_causal_lm_is_refused_in_one_line_before_anything_starts(tmp_path, capsys, smoke_stages):
    reward_model = smoke_stages / "rm"
    code = main(["evaluate", "--preset", "smoke", "--policy", str(reward_model), "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err[-1].startswith(f"rlhf evaluate: error: policy '{reward_model}': ")
    assert err[-1].endswith(
        "is not a causal language model (an architecture ending in ForCausalLM or LMHeadModel is needed)"
    )
    assert not list((tmp_path / "run").rglob("MANIFEST.json"))  # no stage ran
