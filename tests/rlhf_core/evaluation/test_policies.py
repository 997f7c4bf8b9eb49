"""`rlhf evaluate`'s stage, policy_eval: any policy (local directories, a hub id read from the hub
cache offline) judged and measured as the pipeline's are, checked against direct computations from
its own rows; the refusals of what is no causal LM of the preset's tokenizer; its cache key."""

import json
import shutil

import huggingface_hub
import pytest
import torch

from rlhf_core.common.errors import ConfigError, ModelSourceError
from rlhf_core.common.tracking import NullTracker
from rlhf_core.config.presets import load_config
from rlhf_core.config.settings import EvalConfig, policy_key
from rlhf_core.data.prepared import load_data_tokenizer
from rlhf_core.evaluation.policies import check_policy, policy_directory
from rlhf_core.metrics.statistics import agreement, win_rate
from rlhf_core.models.saved import load_causal_lm, save_pretrained_atomic
from rlhf_core.run.pipeline import ON_DEMAND, stage_key
from rlhf_core.train.reward import reward_model_from_causal_lm
from tests.stages import link_stages

COMMIT = "89abcdef0123456789abcdef0123456789abcdef"
HUB_ID = "acme/tldr-policy"


def _policy(base, out, seed, tokenizer):
    model = load_causal_lm(base)
    torch.manual_seed(seed)
    with torch.no_grad():  # a different policy each: perturbed weights
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    save_pretrained_atomic(model, out, tokenizer)
    return out


@pytest.fixture(scope="module")
def policies(smoke_stages, tmp_path_factory):
    """Smoke data and base model; two local policies, a third in the hub cache's layout as
    ``acme/tldr-policy`` at :data:`COMMIT`; a reward model."""
    root = link_stages(smoke_stages, tmp_path_factory.mktemp("policy-eval"), data="data", base="base")
    tokenizer = load_data_tokenizer(root / "data")
    first = _policy(root / "base", root / "first", 1, tokenizer)
    second = _policy(root / "base", root / "second", 2, tokenizer)
    hub = root / "hub" / f"models--{HUB_ID.replace('/', '--')}"
    shutil.copytree(_policy(root / "base", root / "third", 3, tokenizer), hub / "snapshots" / COMMIT)
    (hub / "refs").mkdir()
    (hub / "refs" / "main").write_text(COMMIT)
    reward_model_from_causal_lm(root / "base", seed=1).save_pretrained(root / "rm")
    return root, {"first": str(first), "second": str(second), HUB_ID: f"{HUB_ID}@{COMMIT}"}


def evaluate(root, policies, out, *overrides):
    cfg = load_config(
        "smoke",
        [
            "eval.max_samples=4",
            "eval.diversity_prompts=1",
            "eval.diversity_samples=2",
            "eval.judge_human_comparisons=4",
            *overrides,
        ],
    )
    cfg.eval.policies = policies
    return cfg, ON_DEMAND["policy_eval"].run(cfg, [root / "data", root / "base"], out, NullTracker())


@pytest.mark.heavy
def test_any_policy_is_judged_and_measured_from_its_own_rows(policies, tmp_path, monkeypatch):
    root, sources = policies
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(root / "hub"))
    monkeypatch.setenv("RLHF_JUDGE_CACHE", str(tmp_path / "cache.jsonl"))
    cfg, metrics = evaluate(root, sources, tmp_path / "out", f"eval.reward_model={root / 'rm'}")
    rows = [json.loads(line) for line in (tmp_path / "out" / "summaries.jsonl").read_text().splitlines()]
    assert len(rows) == 4
    rm_prefers, wins = [], []
    for name in sources:
        key = policy_key(name)
        won = [r[f"{key}_wins"] for r in rows]
        assert metrics[f"eval/{key}/win_rate"] == pytest.approx(win_rate(won)["win_rate"])
        assert metrics[f"eval/{key}/response_tokens"] == pytest.approx(sum(r[f"{key}_tokens"] for r in rows) / 4)
        assert metrics[f"eval/{key}/score"] == pytest.approx(sum(r[f"{key}_score"] for r in rows) / 4)
        rm_prefers += [r[f"{key}_score"] > r["reference_score"] for r in rows]
        wins += won
    # Detail 17 for any policy: the reward model's agreement with the judge on the same pairs
    assert metrics["eval/agreement"] == pytest.approx(agreement(rm_prefers, wins)["agreement"])
    assert metrics["eval/agreement_n"] == 12
    # the three policies are three different models: not one set of summaries under three names
    assert len({tuple(r[policy_key(n)] for r in rows) for n in sources}) == 3
    md = (tmp_path / "out" / "report.md").read_text()
    for name, source in sources.items():
        assert f"| {name} | {source} | eval/{policy_key(name)}/... |" in md
        assert md.count(f"| {name} | ") >= 2  # its headline row too
    assert "![Win rate by mean summary length](win_rate_by_length.png)" in md
    assert (tmp_path / "out" / "win_rate_by_length.png").stat().st_size > 1000
    assert "Reward model: " in md and "RM-judge agreement" in md


def test_a_policy_that_is_no_causal_lm_of_the_presets_tokenizer_is_refused_in_one_line(
    policies, tmp_path, smol_tokenizer
):
    root, sources = policies
    tokenizer = load_data_tokenizer(root / "data")
    check_policy("first", root / "first", tokenizer)  # accepted
    cases = {
        "empty": (tmp_path / "empty", "holds no config.json"),
        "rm": (root / "rm", "is not a causal language model"),
    }
    (tmp_path / "empty").mkdir()
    foreign = tmp_path / "foreign"
    shutil.copytree(root / "first", foreign)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (foreign / name).unlink(missing_ok=True)
    smol_tokenizer.save_pretrained(foreign)
    cases["foreign"] = (foreign, "its tokenizer differs from the preset's")
    narrow = tmp_path / "narrow"
    shutil.copytree(root / "first", narrow)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (narrow / name).unlink(missing_ok=True)
    config = json.loads((narrow / "config.json").read_text())
    (narrow / "config.json").write_text(json.dumps(config | {"vocab_size": len(tokenizer) - 1}))
    cases["narrow"] = (narrow, f"{len(tokenizer) - 1} embedding rows for the preset's {len(tokenizer)} token ids")
    for name, (path, expected) in cases.items():
        with pytest.raises(ModelSourceError) as err:
            check_policy(name, path, tokenizer)
        message = str(err.value)
        assert message.startswith(f"policy {name!r}: ") and expected in message and "\n" not in message, message


def test_a_hub_policy_is_read_from_the_hub_cache_at_its_revision(policies, monkeypatch):
    root, _ = policies
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(root / "hub"))
    snapshot = root / "hub" / f"models--{HUB_ID.replace('/', '--')}" / "snapshots" / COMMIT
    assert policy_directory("p", f"{HUB_ID}@{COMMIT}") == snapshot
    assert policy_directory("p", HUB_ID) == snapshot  # main names the commit
    with pytest.raises(ModelSourceError, match=r"^policy 'p': hub model acme/tldr-policy at revision 0{40} cannot"):
        policy_directory("p", f"{HUB_ID}@{'0' * 40}")
    with pytest.raises(ModelSourceError, match="^policy 'r': .*registered MLflow model"):
        policy_directory("r", "models:/rlhf-tldr-policy@champion")


def test_policy_keys_and_the_cache_key_of_the_stage(policies, tmp_path):
    root, sources = policies
    assert policy_key("models:/rlhf-tldr-policy@champion") == "models-rlhf-tldr-policy-champion"
    assert policy_key("ppo") == "policy-ppo" and policy_key("//") == "policy-"
    with pytest.raises(ValueError, match="share the key 'a-b'"):
        EvalConfig(policies={"a/b": "x", "a:b": "y"})
    with pytest.raises(ConfigError):
        load_config("smoke", ["eval.policies=3"])
    cfg = load_config("smoke")
    local = {"first": sources["first"]}
    cfg.eval.policies = local
    key = stage_key("policy_eval", cfg, ["d", "b"])
    evaluation = stage_key("evaluation", cfg, list("abcdefghi"))
    moved = tmp_path / "first"
    shutil.copytree(sources["first"], moved)
    cfg.eval.policies = {"first": str(moved)}  # same files elsewhere: same key
    assert stage_key("policy_eval", cfg, ["d", "b"]) == key
    config = json.loads((moved / "config.json").read_text())
    (moved / "config.json").write_text(json.dumps(config | {"rlhf_note": 1}))
    assert stage_key("policy_eval", cfg, ["d", "b"]) != key  # its files changed: it runs again
    cfg.eval.policies = {}
    assert stage_key("evaluation", cfg, list("abcdefghi")) == evaluation  # not the pipeline's evaluation
