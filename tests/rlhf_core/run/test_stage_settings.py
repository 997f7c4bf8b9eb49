"""Each stage's key holds the settings its code reads, and no other: every stage of the smoke
pipeline is run in this process with each read of a settings field recorded
(tests/settings_reads.py), under GAE, RLOO and GRPO, an imported reward model and an API judge,
and what it read is held against :func:`rlhf_core.run.pipeline.stage_settings`."""

import pytest

from rlhf_core.common.tracking import NullTracker
from rlhf_core.config.presets import load_config
from rlhf_core.run.pipeline import RUN_ONLY, STAGES, stage_config, stage_entry, stage_settings
from tests.chat_completions_api import ChatCompletionsAPI, completion_reply
from tests.settings_reads import recorded_reads

#: Read for how a stage runs, never for what it computes (:data:`RUN_ONLY`).
READ_FOR_DISPLAY = set(RUN_ONLY)
#: Settings that reach a stage's key through ``Stage.reads``, by what they name's contents:
#: ``rlhf evaluate``'s policies and reward model, by name and files; the existing reward model
#: the reward stage imports (``ppo.reward: model:SOURCE``), by its files and spec.
THROUGH_READS = {"policy_eval": {"eval.policies", "eval.reward_model"}, "reward": {"ppo.reward"}}


def upstream_settings(name: str, cfg) -> set[str]:
    """The settings of every stage ``name`` reads from, transitively: they reach its key through its inputs."""
    settings, todo = set(), list(stage_entry(name).inputs)
    while todo:
        upstream = todo.pop()
        settings |= stage_settings(upstream, cfg)
        todo += list(STAGES[upstream].inputs)
    return settings


def check_stage(name: str, cfg, root, out) -> None:
    """Run stage ``name`` on the outputs in ``root`` into ``out``, and hold what it read against its key."""
    stage = stage_entry(name)
    with recorded_reads(cfg) as reads:
        stage.run(cfg, [root / i for i in stage.inputs], out, NullTracker())
    own = stage_settings(name, cfg)
    unkeyed = reads - own - upstream_settings(name, cfg) - READ_FOR_DISPLAY - THROUGH_READS.get(name, set())
    assert not unkeyed, f"{name}: read but in no key: {sorted(unkeyed)}"
    assert not own - reads, f"{name}: in its key but not read: {sorted(own - reads)}"


@pytest.mark.heavy
def test_every_stage_reads_exactly_the_settings_of_its_key(tmp_path, monkeypatch):
    from transformers import LlamaForSequenceClassification

    from rlhf_core.data.prepared import load_data_tokenizer
    from tests.conftest import tiny_llama_config

    root = tmp_path / "run"
    cfg = load_config("smoke")
    for name in STAGES:  # GAE with a trained reward model and the offline judge
        check_stage(name, cfg, root, root / name)
    for estimator in ("rloo", "grpo"):  # critic-free: no value model, GRPO's own scaling
        critic_free = load_config("smoke", [f"ppo.advantage_estimator={estimator}", "ppo.samples_per_prompt=2"])
        check_stage("ppo", critic_free, root, tmp_path / f"ppo-{estimator}")
    # an existing reward model, imported untrained
    tokenizer = load_data_tokenizer(root / "data")
    config = tiny_llama_config(vocab_size=len(tokenizer), num_labels=1, pad_token_id=tokenizer.pad_token_id)
    LlamaForSequenceClassification(config).save_pretrained(tmp_path / "existing")
    tokenizer.save_pretrained(tmp_path / "existing")
    imported = load_config("smoke", [f"ppo.reward=model:{tmp_path / 'existing'}"])
    check_stage("reward", imported, root, tmp_path / "reward-imported")
    # `rlhf evaluate`: a policy from elsewhere, scored by the existing reward model
    policy = root / "sft" / "model"
    scored = load_config(
        "smoke", [f'eval.policies={{"mine": "{policy}"}}', f"eval.reward_model=model:{tmp_path / 'existing'}"]
    )
    check_stage("policy_eval", scored, root, tmp_path / "policy_eval")
    # an API judge on a local server
    monkeypatch.setenv("RLHF_JUDGE_CACHE", str(tmp_path / "judge_cache.jsonl"))
    with ChatCompletionsAPI(handler=lambda req: completion_reply("Comparison: A.\nPreferred: A")) as api:
        judged = load_config(
            "smoke", ["eval.judge=openai", "eval.judge_model=m", f"eval.judge_base_url={api.base_url}"]
        )
        check_stage("evaluation", judged, root, tmp_path / "evaluation-openai")


def test_a_setting_only_some_configurations_read_is_in_their_keys_only(tmp_path):
    """What the recorded runs found, pinned for the settings read under one configuration only:
    how many requests a judge gets at once and where its key is kept are in no key;
    ``ppo.scale_rewards`` in GRPO's; GAE's settings in GAE's; ``reward.external_append_eos`` in
    the reward stage's key when the model is imported, and in ``rlhf evaluate``'s when an existing
    model scores the policies."""
    base = load_config("smoke")

    def changed(overrides: list[str], setting: str) -> set[str]:
        one = load_config("smoke", overrides)
        other = load_config("smoke", [*overrides, setting])
        return {s for s in [*STAGES, "policy_eval"] if stage_config(one, s) != stage_config(other, s)}

    for setting in ("eval.concurrency=8", "eval.api_key_secret=my-block", "eval.api_key_variable=MY_KEY"):
        assert changed([], setting) == set(), setting
    assert changed([], "ppo.scale_rewards=batch") == set()
    assert changed(["ppo.advantage_estimator=grpo"], "ppo.scale_rewards=batch") == {"ppo"}
    assert changed([], "ppo.gamma=0.9") == {"ppo"}
    assert changed(["ppo.advantage_estimator=rloo"], "ppo.gamma=0.9") == set()
    assert changed([], "reward.external_append_eos=false") == set()
    existing = f"model:{tmp_path}"
    assert changed([f"ppo.reward={existing}"], "reward.external_append_eos=false") == {"reward"}
    assert changed([f"ppo.reward={existing}"], "reward.learning_rate=0.5") == set()
    assert changed([f"eval.reward_model={existing}"], "reward.external_append_eos=false") == {"policy_eval"}
    assert changed([], "dpo.eval_max_samples=3") == set()
    assert changed([], "eval.judge_max_tokens=64") == set()  # the offline judge has no token limit
    assert changed(["eval.judge=openai", "eval.judge_model=m"], "eval.judge_max_tokens=64") == {
        "evaluation",
        "policy_eval",
    }
    rule = "ppo.reward=python:rlhf_core.train.rule_rewards:word_count_12"
    assert changed([rule], "ppo.value_init=zero_head") == {"ppo"}  # the value model starts from the trained one
    assert changed([f"ppo.reward={existing}"], "ppo.value_init=zero_head") == set()  # it starts from SFT
    assert changed([], rule) == {"ppo"}  # the reward model is trained alike
    assert "name" in stage_settings("evaluation", base)  # the report's title


def test_a_setting_left_out_of_a_key_is_left_out_of_its_trainers_checkpoints_too(tmp_path):
    """A stage that a changed, unread setting leaves under the same key (the same work
    directory) resumes its checkpoints: their digest leaves out the same settings."""
    import torch

    from rlhf_core.common.tracking import NullTracker
    from rlhf_core.train.training import trainer_checkpoints

    def digest(overrides: list[str], section: str) -> str:
        cfg = getattr(load_config("smoke", overrides), section)
        return trainer_checkpoints(section, cfg, torch.device("cpu"), tmp_path, [], NullTracker()).config_digest

    assert digest([], "ppo") == digest(["ppo.scale_rewards=batch"], "ppo") != digest(["ppo.gamma=0.9"], "ppo")
    assert digest([], "dpo") == digest(["dpo.eval_max_samples=3"], "dpo") != digest(["dpo.beta=0.1"], "dpo")
