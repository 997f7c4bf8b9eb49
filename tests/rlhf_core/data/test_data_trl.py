"""Rows in TRL's dataset formats (``data.format: trl``), and the settings that guard them."""

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from rlhf_core.common.errors import BadRow, ConfigError, DataError
from rlhf_core.config.presets import load_config
from rlhf_core.data.prepare import prepare_data, tokenize_splits
from rlhf_core.data.prepared import load_prepared, load_prompts
from rlhf_core.data.trl import normalise_trl_row, split_implicit_prompt, trl_query
from rlhf_core.models.tokenizers import load_tokenizer
from rlhf_core.ppo.trainer import PPOTrainer
from tests.conftest import SMOL_GGUF
from tests.stages import BITWISE_ENV

ROOT = Path(__file__).resolve().parents[3]
USER, ASSISTANT = "user", "assistant"
#: Conversational rows need a chat template: SmolLM2's (the smoke preset's own tokenizer has none).
CHAT_TOKENIZER = f"model.tokenizer={SMOL_GGUF}"


def msg(role, content):
    return {"role": role, "content": content}


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def rlhf_stages(overrides: list[str], until: str, out: Path) -> Path:
    """``rlhf stages --preset smoke OVERRIDES --until UNTIL --out OUT``, as a user runs it."""
    exe = str(Path(sys.executable).with_name("rlhf"))
    argv = [exe, "stages", "--preset", "smoke", *overrides, "--until", until, "--out", str(out)]
    result = subprocess.run(argv, capture_output=True, text=True, env=BITWISE_ENV, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    return out


def converter():
    spec = importlib.util.spec_from_file_location("convert_tldr_to_trl", ROOT / "examples/convert_tldr_to_trl.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ------------------------------------------------------------------- rows


def test_standard_and_conversational_rows_normalise_alike():
    form, row = normalise_trl_row({"prompt": "The sky is", "completion": " blue."}, "sft", {})
    assert form == "standard" and row["prompt"] == "The sky is" and row["summary"] == " blue."  # not stripped
    conversation = [msg(USER, "What color is the sky?"), msg(ASSISTANT, "It is blue.")]
    form, row = normalise_trl_row({"messages": conversation}, "sft", {})
    assert form == "conversational" and row["summary"] == "It is blue."
    assert json.loads(row["prompt_messages"]) == conversation[:1] and row["post"] == "What color is the sky?"
    split = {"prompt": conversation[:1], "completion": conversation[1:]}
    assert normalise_trl_row(split, "sft", {}) == ("conversational", row)


def test_preference_rows_with_explicit_and_implicit_prompts():
    explicit = {"prompt": "The sky is", "chosen": " blue.", "rejected": " green.", "batch": "b1", "confidence": 7}
    form, row = normalise_trl_row(explicit, "preference", {})
    assert (form, row["chosen"], row["rejected"], row["batch"], row["confidence"]) == (
        "standard",
        " blue.",
        " green.",
        "b1",
        7,
    )
    assert row["chosen_policy"] is None and row["split"] is None  # absent metadata stays absent
    # TRL's documented example: the implicit prompt is the common prefix, the space left to the responses
    _, implicit = normalise_trl_row({"chosen": "The sky is blue.", "rejected": "The sky is green."}, "preference", {})
    assert (implicit["prompt"], implicit["chosen"], implicit["rejected"]) == ("The sky is", " blue.", " green.")
    q = [msg(USER, "What color is the sky?")]
    whole = {"chosen": q + [msg(ASSISTANT, "It is blue.")], "rejected": q + [msg(ASSISTANT, "It is green.")]}
    form, row = normalise_trl_row(whole, "preference", {})
    assert form == "conversational" and json.loads(row["prompt_messages"]) == q
    assert (row["chosen"], row["rejected"]) == ("It is blue.", "It is green.")


def test_prompt_only_rows_normalise_to_a_prompt_and_no_response():
    """TRL's prompt-only format, PPO's prompts: ``prompt`` alone, a string or messages."""
    form, row = normalise_trl_row({"prompt": "The sky is", "completion": " ignored"}, "prompt", {})
    assert form == "standard" and row["prompt"] == "The sky is" and row["post"] == "The sky is"
    assert not {"summary", "chosen", "rejected", "completion"} & set(row)
    conversation = [msg("system", "Be brief."), msg(USER, "What color is the sky?")]
    form, row = normalise_trl_row({"question": conversation}, "prompt", {"prompt": "question"})
    assert form == "conversational" and json.loads(row["prompt_messages"]) == conversation
    assert row["post"] == "What color is the sky?"
    with pytest.raises(BadRow, match="missing_field:prompt"):
        normalise_trl_row({"completion": " blue."}, "prompt", {})
    with pytest.raises(BadRow, match="empty_field:prompt"):
        normalise_trl_row({"prompt": " "}, "prompt", {})
    with pytest.raises(BadRow, match="bad_messages:prompt"):
        normalise_trl_row({"prompt": [{"content": "no role"}]}, "prompt", {})


def test_prompt_splits_are_refused_where_they_cannot_be_read():
    with pytest.raises(ConfigError, match=r"data\.prompt_splits: prompt-only rows are read under data\.format: trl"):
        load_config("smoke", ['data.prompt_splits={"train": {}}'])
    with pytest.raises(ConfigError, match=r"data\.prompt_splits\.rollouts: PPO's prompts are the split 'train'"):
        load_config("smoke", ["data.format=trl", 'data.prompt_splits={"rollouts": {}}'])
    hub = load_config("smoke", ["data.format=trl", "data.source=hub", 'data.prompt_splits={"train": {}}'])
    with pytest.raises(DataError, match=r"data\.prompt_splits from the hub need data\.prompt_dataset"):
        hub.data.dataset("prompt")
    assert list(hub.data.splits("prompt")) == ["train"]
    assert load_config("smoke", ["data.format=trl"]).data.splits("prompt") == {}


def test_the_prompt_file_is_part_of_the_data_key(tmp_path):
    """The data stage's fingerprint reads ``prompt_train.jsonl`` when ``data.prompt_splits`` names
    it, and only then: one edited prompt moves the key."""
    from rlhf_core.data.files import data_fingerprint

    for name in ("sft_train", "sft_validation", "sft_test", "preference_train", "preference_validation"):
        write_jsonl(tmp_path / f"{name}.jsonl", [{"prompt": "P", "completion": " c", "chosen": " a", "rejected": " b"}])
    write_jsonl(tmp_path / "prompt_train.jsonl", [{"prompt": "Q1"}, {"prompt": "Q2"}])
    trl = ["data.format=trl", f"data.local_dir={tmp_path}"]
    with_prompts, without = load_config("smoke", [*trl, 'data.prompt_splits={"train": {}}']), load_config("smoke", trl)
    before, unused = data_fingerprint(with_prompts.data), data_fingerprint(without.data)
    write_jsonl(tmp_path / "prompt_train.jsonl", [{"prompt": "Q1"}, {"prompt": "Q3"}])
    assert data_fingerprint(with_prompts.data) != before and data_fingerprint(without.data) == unused


def text_rows_folder(folder: Path) -> Path:
    """The smoke rows as TRL standard rows, with ``sft_train.jsonl`` as TRL's language-modelling
    rows: each SFT row's prompt and completion as one ``text``."""
    converted(folder, "standard")
    rows = [json.loads(line) for line in (folder / "sft_train.jsonl").read_text().splitlines()]
    write_jsonl(folder / "sft_train.jsonl", [{"text": row["prompt"] + row["completion"]} for row in rows])
    return folder


def test_text_rows_train_sft_whole_as_trls_sft_trainer_tokenises_them(tmp_path, llama_tokenizer, smol_tokenizer):
    """A ``text`` row is the tokenizer's own prefix (Llama 3.2's BOS; nothing for SmolLM2) as the
    query and the text plus EOS as the response: the sequence SFT trains on is
    ``tokenizer(text) + [EOS]``, TRL's language-modelling tokenisation. The split's form is kept."""
    form, row = normalise_trl_row({"text": "The sky is blue."}, "sft", {})
    assert form == "language_modeling" and (row["prompt"], row["summary"]) == ("", "The sky is blue.")
    with pytest.raises(BadRow, match="empty_field:text"):
        normalise_trl_row({"text": " "}, "sft", {})
    folder = text_rows_folder(tmp_path / "rows")
    texts = [json.loads(line)["text"] for line in (folder / "sft_train.jsonl").read_text().splitlines()]
    cfg = load_config("smoke", ["data.format=trl", f"data.local_dir={folder}", "data.max_query_length=2048"])
    for tokenizer in (llama_tokenizer, smol_tokenizer):
        train = tokenize_splits(cfg.data, tokenizer).datasets["sft"]["train"]
        for text, query, response in zip(
            texts, train["query_token_unpadded"], train["reference_response_token_unpadded"]
        ):
            assert query + response == tokenizer(text)["input_ids"] + [tokenizer.eos_token_id]
        assert len(train) == len(texts) and train["query_token_len"][0] == (tokenizer is llama_tokenizer)
    stats = prepare_data(cfg, tmp_path / "data")
    assert stats["splits"]["sft/train"]["form"] == "language_modeling"
    assert stats["splits"]["sft/validation"]["form"] == "standard"


@pytest.mark.heavy
def test_stages_that_sample_prompts_refuse_a_split_of_text_rows(tmp_path, smoke_stages):
    """SFT trains on ``text`` rows; its evaluation, the reward normalisation, PPO and the
    evaluation sample from a split's prompts, and a split of text rows has none: each names its
    setting before any work."""
    from rlhf_core.data.prepared import require_prompts
    from rlhf_core.train.sft import run_sft

    folder = text_rows_folder(tmp_path / "rows")
    cfg = load_config(
        "smoke", ["data.format=trl", f"data.local_dir={folder}", "sft.max_steps=1", "sft.eval_max_samples=2"]
    )
    prepare_data(cfg, tmp_path / "data")
    _, _, stats = load_prepared(tmp_path / "data")
    require_prompts(stats, "validation", "eval.split")  # prompt/completion rows: no error
    with pytest.raises(DataError, match=r"reward\.normalization_split: the SFT split 'train' holds TRL language"):
        require_prompts(stats, "train", "reward.normalization_split")
    with pytest.raises(DataError, match=r"sft\.eval_split: the SFT split 'train' holds"):
        run_sft(
            cfg.sft.model_copy(update={"eval_split": "train"}), tmp_path / "data", smoke_stages / "base", tmp_path / "e"
        )
    with pytest.raises(DataError, match=r"ppo \(its prompts, the SFT split 'train'\).*data\.prompt_splits"):
        PPOTrainer(cfg.ppo, tmp_path / "data", smoke_stages / "base", smoke_stages / "rm")
    metrics = run_sft(cfg.sft, tmp_path / "data", smoke_stages / "base", tmp_path / "sft")
    assert metrics["train/steps"] == 1 and metrics["eval/samples"] > 0


def test_ppo_samples_its_queries_from_the_prompt_only_rows(tmp_path, smoke_stages):
    """With ``data.prompt_splits``, the data stage writes ``prompt/train`` (the prompt-only rows'
    queries, tokenised and left-padded as the SFT queries are) and PPO samples from it, not from
    the SFT split ``train``; without it, from the SFT split, as the paper does."""
    folder = converted(tmp_path / "rows", "standard")
    prompts = [{"prompt": f"Prompt number {i}: say something short.", "completion": " unused"} for i in range(6)]
    write_jsonl(folder / "prompt_train.jsonl", prompts)
    trl = ["data.format=trl", f"data.local_dir={folder}"]
    cfg = load_config("smoke", [*trl, 'data.prompt_splits={"train": {}}'])
    stats = prepare_data(cfg, tmp_path / "data")
    split = load_prompts(tmp_path / "data")["train"]
    assert split["post"] == [p["prompt"] for p in prompts] and stats["splits"]["prompt/train"]["rows"] == 6
    tokenizer = load_tokenizer(cfg.model)
    pad = tokenizer.pad_token_id
    assert [[t for t in q if t != pad] for q in split["query_token"]] == [
        tokenizer(p["prompt"])["input_ids"] for p in prompts
    ]
    trainer = PPOTrainer(cfg.ppo, tmp_path / "data", smoke_stages / "base", smoke_stages / "rm")
    assert trainer.queries.tolist() == split["query_token"]
    prepare_data(load_config("smoke", trl), tmp_path / "plain")
    sft, _, _ = load_prepared(tmp_path / "plain")
    assert load_prompts(tmp_path / "plain") is None
    plain = PPOTrainer(cfg.ppo, tmp_path / "plain", smoke_stages / "base", smoke_stages / "rm")
    assert plain.queries.tolist() == sft["train"]["query_token"]


TRL_CASES = Path(__file__).resolve().parents[2] / "data" / "trl_extract_prompt_cases.json"


def test_an_implicit_prompt_is_split_as_trls_extract_prompt_splits_it():
    """Each pair of tests/data/trl_extract_prompt_cases.json (written by TRL's own
    ``extract_prompt``: tests/data/make_trl_extract_prompt_cases.py) splits as TRL split it,
    and as TRL splits it now where TRL is installed; a pair that would leave no prompt, or two
    equal responses, is a bad row."""
    cases = json.loads(TRL_CASES.read_text())["cases"]
    trl_extract = None
    if importlib.util.find_spec("trl") is not None:
        from trl.data_utils import extract_prompt as trl_extract
    for case in cases:
        got = split_implicit_prompt(case["chosen"], case["rejected"])
        assert got == (case["trl"]["prompt"], case["trl"]["chosen"], case["trl"]["rejected"]), case
        if trl_extract is not None:
            now = trl_extract({"chosen": case["chosen"], "rejected": case["rejected"]})
            assert got == (now["prompt"], now["chosen"], now["rejected"]), case
    assert {type(case["chosen"]) for case in cases} == {str, list} and len(cases) >= 8
    with pytest.raises(BadRow, match="no_common_prompt"):
        split_implicit_prompt("Blue.", "Green.")
    with pytest.raises(BadRow, match="no_common_prompt"):
        split_implicit_prompt(" blue", " green")  # the space before the difference is all they share


TRL_TEMPLATE_CASES = Path(__file__).resolve().parents[2] / "data" / "trl_chat_template_cases.json"


def test_a_conversational_prompt_is_rendered_as_trls_maybe_apply_chat_template_renders_it(smol_tokenizer):
    """Each prompt of tests/data/trl_chat_template_cases.json (written by TRL's own
    ``maybe_apply_chat_template``: tests/data/make_trl_chat_template_cases.py) is PPO's query as
    TRL rendered it: the generation prompt after a final user or tool turn, a final assistant
    turn continued; and as TRL renders it now where TRL is installed. A prompt ending in another
    role is a bad row, as TRL refuses it."""
    data = json.loads(TRL_TEMPLATE_CASES.read_text())
    assert data["tokenizer"] == SMOL_GGUF
    trl_render = None
    if importlib.util.find_spec("trl") is not None:
        from trl.data_utils import maybe_apply_chat_template as trl_render
    for case in data["cases"]:
        row = {"prompt_messages": json.dumps(case["prompt"]), "prompt": ""}
        query, ids, counts = trl_query(row, smol_tokenizer, 10_000, "keep_end")
        assert query == case["trl"] and not counts["token_cut"], case
        assert ids == smol_tokenizer(case["trl"], add_special_tokens=False)["input_ids"]
        if trl_render is not None:
            assert query == trl_render({"prompt": case["prompt"]}, smol_tokenizer)["prompt"], case
    assert {c["prompt"][-1]["role"] for c in data["cases"]} == {"user", "tool", "assistant"}
    continued = [c for c in data["cases"] if c["prompt"][-1]["role"] == "assistant"]
    assert continued and all(c["trl"].endswith(c["prompt"][-1]["content"]) for c in continued)
    system_last = [{"role": "user", "content": "Hi"}, {"role": "system", "content": "Be brief."}]
    with pytest.raises(BadRow, match="prompt_last_role:system"):
        trl_query({"prompt_messages": json.dumps(system_last), "prompt": ""}, smol_tokenizer, 10_000, "keep_end")


def test_columns_are_renamed_and_bad_rows_named():
    form, row = normalise_trl_row(
        {"question": "Q?", "answer": " A."}, "sft", {"prompt": "question", "completion": "answer"}
    )
    assert (row["prompt"], row["summary"]) == ("Q?", " A.")
    with pytest.raises(BadRow, match="missing_column:answer"):
        normalise_trl_row({"question": "Q?"}, "sft", {"prompt": "question", "completion": "answer"})
    with pytest.raises(BadRow, match="missing_field:chosen_policy|missing_field:completion"):
        normalise_trl_row({"prompt": "Q?"}, "sft", {})
    with pytest.raises(BadRow, match="not_one_assistant_message:completion"):
        normalise_trl_row({"prompt": [msg(USER, "Q?")], "completion": [msg(USER, "A.")]}, "sft", {})
    with pytest.raises(BadRow, match="no_assistant_response:messages"):
        normalise_trl_row({"messages": [msg(USER, "Q?")]}, "sft", {})
    with pytest.raises(BadRow, match="identical_responses"):
        split_implicit_prompt("same", "same")


def test_columns_are_renamed_at_once_and_two_sources_for_one_name_are_refused():
    """``{chosen: rejected, rejected: chosen}`` swaps the two (renamed one after the other, the
    second found its column gone); a rename onto a column the row keeps, or one column read as
    two of TRL's, is refused, naming both."""
    pair = {"prompt": "P", "chosen": " worse", "rejected": " better"}
    _, row = normalise_trl_row(pair, "preference", {"chosen": "rejected", "rejected": "chosen"})
    assert (row["chosen"], row["rejected"]) == (" better", " worse")
    with pytest.raises(BadRow, match=r"column_clash:prompt: .*column 'question' to 'prompt', and the row has a column"):
        normalise_trl_row({"question": "Q", **pair}, "preference", {"prompt": "question"})
    with pytest.raises(ConfigError, match=r"data\.columns\.prompt and data\.columns\.completion both read column 'q'"):
        load_config("smoke", ["data.format=trl", "data.columns.prompt=q", "data.columns.completion=q"])


def test_a_mix_of_forms_in_one_split_names_the_file_and_row(tmp_path, smol_tokenizer):
    folder = _standard_folder(tmp_path / "d")
    rows = [json.loads(line) for line in (folder / "sft_train.jsonl").read_text().splitlines()]
    rows[3] = {"messages": [msg(USER, "Q?"), msg(ASSISTANT, "A.")]}
    write_jsonl(folder / "sft_train.jsonl", rows)
    cfg = load_config("smoke", ["data.format=trl", f"data.local_dir={folder}"])
    with pytest.raises(DataError, match=r"sft_train\.jsonl:4: a conversational sft row in a split of standard rows"):
        tokenize_splits(cfg.data, smol_tokenizer)


# ------------------------------------------------------------------- queries


def test_prompts_over_the_limit_are_cut_or_dropped(smol_tokenizer):
    row = {"prompt": " ".join(f"word{i}" for i in range(200)), "prompt_messages": ""}
    ids = smol_tokenizer(row["prompt"])["input_ids"]
    query, end, counts = trl_query(row, smol_tokenizer, 50, "keep_end")
    assert end == ids[-50:] and counts["token_cut"] and query == smol_tokenizer.decode(ids[-50:])
    _, start, _ = trl_query(row, smol_tokenizer, 50, "keep_start")
    assert start == ids[:50]
    with pytest.raises(BadRow, match="prompt_too_long"):
        trl_query(row, smol_tokenizer, 50, "drop")
    assert trl_query(row, smol_tokenizer, len(ids), "drop")[1] == ids


def test_a_conversation_goes_through_the_chat_template(smol_tokenizer, llama_tokenizer):
    prompt = [msg(USER, "Summarise: the cat sat on the mat.")]
    row = {"prompt": "", "prompt_messages": json.dumps(prompt)}
    query, ids, _ = trl_query(row, smol_tokenizer, 512, "keep_end")
    assert query == smol_tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
    assert (
        query.endswith("<|im_start|>assistant\n")
        and ids == smol_tokenizer(query, add_special_tokens=False)["input_ids"]
    )
    no_template = llama_tokenizer.__class__.from_pretrained(llama_tokenizer.name_or_path)
    no_template.chat_template = None
    with pytest.raises(DataError, match="has none"):
        trl_query(row, no_template, 512, "keep_end")


# ------------------------------------------------------------------- whole data stage


def _standard_folder(folder: Path) -> Path:
    converter().convert(folder, "smoke", [], "standard")
    return folder


def converted(folder: Path, form: str) -> Path:
    converter().convert(folder, "smoke", [], form)
    return folder


@pytest.fixture(scope="module")
def conversational_folder(tmp_path_factory):
    return converted(tmp_path_factory.mktemp("trl-conversational"), "conversational")


def test_the_data_stage_reads_conversational_files(tmp_path, conversational_folder, smol_tokenizer):
    cfg = load_config("smoke", ["data.format=trl", f"data.local_dir={conversational_folder}", CHAT_TOKENIZER])
    stats = prepare_data(cfg, tmp_path / "data")
    sft, preference, _ = load_prepared(tmp_path / "data")
    assert set(sft) == {"train", "validation", "test"} and set(preference) == {"train", "validation"}
    assert stats["splits"]["sft/train"]["task"] == "trl" and cfg.reward.eval_splits == ["validation"]
    first = json.loads((conversational_folder / "sft_train.jsonl").read_text().splitlines()[0])
    row, pad = sft["train"][0], smol_tokenizer.pad_token_id
    query = smol_tokenizer.apply_chat_template(first["prompt"], tokenize=False, add_generation_prompt=True)
    expected_query = smol_tokenizer(query, add_special_tokens=False)["input_ids"][-256:]  # the smoke preset's limit
    assert [t for t in row["query_token"] if t != pad] == expected_query
    response = first["completion"][0]["content"]  # the assistant's text, no leading space, then EOS
    expected = smol_tokenizer(response, add_special_tokens=False)["input_ids"] + [smol_tokenizer.eos_token_id]
    assert [t for t in row["reference_response_token"] if t != pad] == expected
    assert stats["splits"]["sft/train"]["truncation"]["token"] > 0  # the posts are longer than 256 tokens


@pytest.mark.heavy
def test_converted_rows_give_the_tldr_formats_token_ids_on_every_shared_row(tmp_path, tldr_dir):
    """Every row of the offline TL;DR files, read as TL;DR rows and as their TRL standard-form
    conversion, gives the same query, response, chosen and rejected token ids."""
    cnndm = ["batch0_cnndm", "cnndm0", "cnndm2"]
    full = {
        "data.source": "local",
        "data.local_dir": str(tldr_dir),
        "data.sft_splits": {s: {"source": s} for s in ("train", "validation", "test")},
        "data.preference_splits": {
            "train": {"source": "validation", "exclude_batches": cnndm},
            "validation": {"source": "validation", "batches": cnndm, "task": "cnndm"},
        },
        "data.tldr_format.max_query_length": 512,
        "data.cnndm_format.max_query_length": 1919,
    }
    overrides = [f"{k}={json.dumps(v)}" for k, v in full.items()]
    folder = tmp_path / "trl"
    _, tldr = converter().convert(folder, "smoke", overrides, "standard")  # the TL;DR rows, tokenised
    trl_overrides = ["data.format=trl", f"data.local_dir={folder}", "data.max_query_length=1919", *overrides[2:4]]
    cfg = load_config("smoke", trl_overrides)
    trl = tokenize_splits(cfg.data, load_tokenizer(cfg.model))  # the converter's: the preset's
    columns = {
        "sft": ("query_token_unpadded", "reference_response_token_unpadded"),
        "preference": ("query_token_unpadded", "chosen_token_unpadded", "rejected_token_unpadded"),
    }
    compared = 0
    for kind, names in columns.items():
        for split, ds in tldr.datasets[kind].items():
            other = trl.datasets[kind][split]
            assert len(other) == len(ds) > 0
            for column in names:
                assert other[column] == ds[column], f"{kind}/{split} {column}"
            assert not any(other["token_cut"])  # the prompts were cut by the paper's rule already
            compared += len(ds)
    shared = sum(1 for p in tldr_dir.glob("*.jsonl") for line in p.read_bytes().split(b"\n") if line.strip())
    dropped = sum(sum(c.values()) for c in tldr.dropped.values())
    assert compared + dropped == shared  # every row, or it was refused by the TL;DR checks and counted


# ------------------------------------------------------------------- settings


def test_a_template_placeholder_naming_no_field_is_refused():
    with pytest.raises(ConfigError, match=r"data\.tldr_format\.template: the placeholder \{prompt\} names no field"):
        load_config("smoke", ['data.tldr_format.template="Q: {prompt}"'])
    with pytest.raises(ConfigError, match=r"data\.cnndm_format\.truncate_field: 'body' names no field"):
        load_config("smoke", ["data.cnndm_format.truncate_field=body"])
    site = load_config("smoke", ['data.cnndm_format.template="{site}: {post}\\n\\nTL;DR:"'])
    assert site.data.cnndm_format.template.startswith("{site}")


def test_a_base_model_over_a_random_init_preset_is_not_ignored():
    with pytest.raises(ConfigError, match=r"model\.base .* and model\.random_init are both set"):
        load_config("smoke", ["model.base=HuggingFaceTB/SmolLM2-135M-Instruct"])
    cfg = load_config("smoke", ["model.base=HuggingFaceTB/SmolLM2-135M-Instruct", "model.random_init=null"])
    assert cfg.model.random_init is None


def test_trl_settings_left_at_their_defaults_keep_the_data_key():
    dumped = load_config("smoke").data.model_dump(mode="json")
    assert not {"format", "columns", "prompt_truncation", "max_query_length"} & set(dumped)
    assert load_config("smoke", ["data.format=trl"]).data.model_dump(mode="json")["format"] == "trl"
    trl = load_config("smoke", ["data.format=trl"]).data  # $RLHF_TLDR_DIR and the subset hold TL;DR rows
    assert trl.resolved_local_dir() is None and trl.resolved_source() == "hub"
    with pytest.raises(ConfigError, match=r"data\.columns\.question: not one of TRL's columns"):
        load_config("smoke", ["data.columns.question=prompt"])


# ------------------------------------------------------------------- every stage


def rows_as_users_have_them(folder: Path) -> Path:
    """``folder``'s TRL rows with no ``id`` column, as TRL's own datasets have none, and with
    repeats: the first SFT validation row (an evaluation prompt) given twice verbatim and once
    more with another row's completion, and the first pair of each preference split twice."""
    for path in folder.glob("*.jsonl"):
        rows = [{k: v for k, v in json.loads(line).items() if k != "id"} for line in path.read_text().splitlines()]
        if path.name == "sft_validation.jsonl":
            rows[1:1] = [rows[0], {**rows[0], "completion": rows[1]["completion"]}]
        elif path.name.startswith("preference_"):
            rows.insert(1, rows[0])
        write_jsonl(path, rows)
    return folder


@pytest.mark.slow
@pytest.mark.parametrize("form", ["standard", "conversational"])
def test_every_stage_runs_on_trl_rows_without_ids_and_with_repeats(tmp_path, form):
    """SFT, the reward model, its normalisation and evaluation, PPO, DPO and the evaluation on
    TRL rows with no ``id`` and with repeated prompts and pairs (:func:`rows_as_users_have_them`),
    conversations through SmolLM2's chat template; each summary evaluated keeps an id of its own,
    and the judge reads the pairwise prompt."""
    from rlhf_core.evaluation.judging import Comparison, prompt_sha256
    from rlhf_core.evaluation.judging.prompt import PAIRWISE_PROMPT

    folder = tmp_path / "rows"
    rows_as_users_have_them(converted(folder, form))
    # PPO's prompts, TRL's prompt-only rows: the preference pairs' prompts, not the SFT rows'
    pairs = [json.loads(line) for line in (folder / "preference_train.jsonl").read_text().splitlines()]
    prompts = list({json.dumps(pair["prompt"]): {"prompt": pair["prompt"]} for pair in pairs}.values())[:8]
    write_jsonl(folder / "prompt_train.jsonl", prompts)
    overrides = ["data.format=trl", f"data.local_dir={folder}", 'data.prompt_splits={"train": {}}']
    overrides += [CHAT_TOKENIZER] if form == "conversational" else []
    # each stage as short as it goes: one optimiser step or PPO update, a few rows evaluated
    overrides += ["sft.max_steps=1", "reward.max_steps=1", "dpo.max_steps=1", "ppo.total_episodes=8"]
    overrides += [
        "ppo.response_length=16",
        "sft.eval_max_samples=2",
        "reward.eval_max_samples=4",
        "ppo.eval_max_samples=2",
    ]
    overrides += ["eval.max_samples=3", "eval.judge_human_comparisons=2", "eval.judge_orders=one"]
    overrides += ["eval.diversity_prompts=0", "eval.token_shift_samples=0"]
    root = rlhf_stages(overrides, "evaluation", tmp_path / "run")
    for stage in ("data", "sft", "reward", "reward_norm", "reward_eval", "ppo", "dpo", "dpo_eval", "evaluation"):
        assert (root / stage / "stage.json").is_file(), stage
    reward_eval = json.loads((root / "reward_eval" / "metrics.json").read_text())
    assert "eval/accuracy" in reward_eval and not [key for key in reward_eval if "cnndm" in key]
    sft, _, _ = load_prepared(root / "data")
    summaries = [json.loads(line) for line in (root / "evaluation" / "summaries.jsonl").read_text().splitlines()]
    assert len({s["id"] for s in summaries}) == len(summaries) == 3 and len({s["post"] for s in summaries}) == 1
    judgements = [json.loads(line) for line in (root / "evaluation" / "judgements.jsonl").read_text().splitlines()]
    first = next(j for j in judgements if j["policy"] != "human-chosen")
    row = next(s for s in summaries if f"{first['policy']}/{s['id']}" == first["id"])
    # the prompt the judge read: the pairwise one, around the user's message
    comparison = Comparison(first["id"], row["post"], row[first["policy"]], row["reference"], template=PAIRWISE_PROMPT)
    assert first["prompt_sha256"] == prompt_sha256(comparison.prompt(first["response_is_a"]))
    assert row["post"] in sft["validation"]["post"] and not row["post"].startswith("<|im_start|>")
    assert "with a neutral pairwise prompt (TRL-format data)" in (root / "evaluation" / "report.md").read_text()
    # PPO sampled its queries from the prompt-only rows
    prompt_split = load_prompts(root / "data")["train"]
    written = [p["prompt"] if form == "standard" else p["prompt"][-1]["content"] for p in prompts]
    assert prompt_split["post"] == written and not set(written) & set(sft["train"]["post"])
    cfg = load_config("smoke", overrides)
    trainer = PPOTrainer(cfg.ppo, root / "data", root / "sft" / "model", root / "reward_norm" / "model")
    assert trainer.queries.tolist() == prompt_split["query_token"]


def test_a_bad_judge_prompt_file_is_found_before_any_stage_runs(tmp_path):
    from rlhf_core.run.preflight import PreflightError, check_before_stages

    template = tmp_path / "judge.txt"
    template.write_text("Post: {post}\nA: {a}\nB: {b}")
    cfg = load_config("smoke", [f"eval.judge_prompt={template}"])
    with pytest.raises(PreflightError, match=r"eval\.judge_prompt .*judge\.txt: a judge prompt names"):
        check_before_stages(cfg, ["evaluation"])
    template.write_text("Prompt: {prompt}\nA: {a}\nB: {b}\nPreferred: A or B")
    check_before_stages(cfg, ["evaluation"])


@pytest.mark.slow
def test_a_reward_model_trains_and_is_evaluated_on_cnndm_comparisons_as_trl_rows(tmp_path):
    train = {"source": "validation", "batches": ["batch0_cnndm"], "task": "cnndm", "max_rows": 40}
    splits = {"train": train | {"holdout": {"split": "validation", "rows": 7, "seed": 0}}}  # 5 articles, by article
    folder = tmp_path / "cnndm"
    written, _ = converter().convert(folder, "smoke", [f"data.preference_splits={json.dumps(splits)}"], "standard")
    assert (written["preference_train.jsonl"], written["preference_validation.jsonl"]) == (33, 7)
    root = rlhf_stages(
        ["data.format=trl", f"data.local_dir={folder}", "sft.max_steps=1"], "reward_eval", tmp_path / "run"
    )
    _, preference, _ = load_prepared(root / "data")
    assert all(post.startswith("Article:\n") for post in preference["train"]["post"])
    assert set(preference["validation"]["batch"]) == {"batch0_cnndm"}
    metrics = json.loads((root / "reward_eval" / "metrics.json").read_text())
    assert metrics["eval/count"] == 7 and 0 <= metrics["eval/accuracy"] <= 1
    assert metrics["eval/count/batch/batch0_cnndm"] == 7  # the per-group tables read the rows' metadata
    assert not (root / "ppo").exists()


def test_the_judge_prompt_file_is_part_of_the_evaluations_key(tmp_path):
    from rlhf_core.run.pipeline import stage_keys

    template = tmp_path / "judge.txt"
    template.write_text("Prompt: {prompt}\nA: {a}\nB: {b}\nPreferred: A or B")
    keys = stage_keys(load_config("smoke", [f"eval.judge_prompt={template}"]))
    template.write_text("Prompt: {prompt}\n\nA: {a}\nB: {b}\nPreferred: A or B")
    edited = stage_keys(load_config("smoke", [f"eval.judge_prompt={template}"]))
    assert [s for s in keys if keys[s] != edited[s]] == ["evaluation"]


def test_parquet_files_are_read_as_jsonl_files_are(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from rlhf_core.config.data_settings import SplitSpec
    from rlhf_core.data.rows import load_split

    rows = [{"question": f"Q{i}?", "answer": f" A{i}.", "id": f"r{i}"} for i in range(3)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "sft_train.parquet")
    columns = ["data.columns.prompt=question", "data.columns.completion=answer"]
    cfg = load_config("smoke", ["data.format=trl", f"data.local_dir={tmp_path}", *columns])
    loaded = load_split(cfg.data, "sft", SplitSpec(source="train", task="trl"), None)
    assert [(r["prompt"], r["summary"], r["id"]) for r in loaded.rows] == [
        (f"Q{i}?", f" A{i}.", f"r{i}") for i in range(3)
    ]
    assert loaded.rows[2]["source_row"] == f"{tmp_path / 'sft_train.parquet'}:row 3"


def test_the_converter_takes_settings_after_its_options(tmp_path, capsys):
    cap = json.dumps({s: {"source": "test", "max_rows": 2} for s in ("train", "validation", "test")})
    converter().main([str(tmp_path), "--preset", "smoke", "--form", "standard", f"data.sft_splits={cap}"])
    assert f"{tmp_path / 'sft_train.jsonl'}: 2 rows" in capsys.readouterr().out
    first = json.loads((tmp_path / "sft_train.jsonl").read_text().splitlines()[0])
    assert set(first) == {"id", "prompt", "completion"} and first["completion"].startswith(" ")


def test_a_split_reads_its_own_file_only(tmp_path):
    """``preference_validation_cnndm.jsonl`` is a split of its own under ``trl``, not more rows of
    ``validation`` (as the TL;DR format reads it)."""
    from rlhf_core.config.data_settings import SplitSpec
    from rlhf_core.data.rows import load_split

    write_jsonl(tmp_path / "preference_validation.jsonl", [{"prompt": "P", "chosen": " a", "rejected": " b"}])
    write_jsonl(tmp_path / "preference_validation_cnndm.jsonl", [{"prompt": "Q", "chosen": " c", "rejected": " d"}])
    cfg = load_config("smoke", ["data.format=trl", f"data.local_dir={tmp_path}"])
    loaded = load_split(cfg.data, "preference", SplitSpec(source="validation", task="trl"), None)
    assert [row["prompt"] for row in loaded.rows] == ["P"]


def test_rows_without_ids_get_ids_from_their_content_and_repeats_are_kept(tmp_path, caplog):
    """TRL's datasets carry no ``id``: each row gets one from its content, the same in every
    load, and a repeated prompt, a pair repeated verbatim (one pair labelled alike by two
    annotators) and an SFT row given twice each keep rows and ids of their own."""
    from rlhf_core.config.data_settings import SplitSpec
    from rlhf_core.data.rows import load_split

    pair = {"prompt": "P", "chosen": " a", "rejected": " b"}
    write_jsonl(tmp_path / "preference_train.jsonl", [pair, {**pair, "chosen": " c"}, pair, {"id": "mine", **pair}])
    sft = {"prompt": "Q", "completion": " x"}
    write_jsonl(tmp_path / "sft_train.jsonl", [sft, {**sft, "completion": " y"}, sft])
    cfg = load_config("smoke", ["data.format=trl", f"data.local_dir={tmp_path}"])
    spec = SplitSpec(source="train", task="trl")
    with caplog.at_level("INFO", logger="rlhf_core.data.rows"):
        first = load_split(cfg.data, "preference", spec, None)
    ids = [row["id"] for row in first.rows]
    assert [row["chosen"] for row in first.rows] == [" a", " c", " a", " a"]
    assert len(set(ids)) == 4 and ids[3] == "mine" and ids[2] == ids[0] + "-2"
    assert all(re.fullmatch(r"[0-9a-f]{16}", i) for i in ids[:2])
    assert [row["id"] for row in load_split(cfg.data, "preference", spec, None).rows] == ids  # stable
    assert "1 row(s) repeat an earlier row verbatim and are kept" in caplog.text
    assert f"preference_train.jsonl:3 repeats {tmp_path / 'preference_train.jsonl'}:1" in caplog.text
    sft_ids = [row["id"] for row in load_split(cfg.data, "sft", spec, None).rows]
    assert len(set(sft_ids)) == 3 and sft_ids[2] == sft_ids[0] + "-2"
