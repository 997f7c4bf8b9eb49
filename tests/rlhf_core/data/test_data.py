"""The data pipeline on real TL;DR rows, for the Llama 3.2 and SmolLM2 tokenizers (Details 1-6)."""

import json
import statistics

import datasets
import pytest

from rlhf_core.config.data_settings import QueryFormat
from rlhf_core.config.presets import load_config
from rlhf_core.data.prepare import (
    format_query,
    left_pad,
    policy_pairs,
    prepare_data,
    right_pad,
    tokenize_response,
    truncate_query,
)
from rlhf_core.data.prepared import load_prepared, policy_pair_figures, token_lengths
from rlhf_core.data.rows import BadRow
from tests.conftest import read_jsonl

FMT = QueryFormat()


def n_tokens(tokenizer, text):
    return len(tokenizer(text, add_special_tokens=True)["input_ids"])


# ------------------------------------------------------------------ Detail 2


def test_query_format_is_exact_with_no_trailing_space(sft_rows):
    row = sft_rows[0]
    query = format_query(row, FMT)
    assert query == f"SUBREDDIT: r/{row['subreddit']}\n\nTITLE: {row['title']}\n\nPOST: {row['post']}\n\nTL;DR:"
    assert query.endswith("TL;DR:")


def test_short_query_is_not_truncated(tokenizer, sft_rows):
    row = next(r for r in sft_rows if n_tokens(tokenizer, format_query(r, FMT)) < 300)
    query, ids, counts = truncate_query(row, tokenizer, FMT)
    assert query == format_query(row, FMT)
    assert ids == tokenizer(query)["input_ids"]
    assert counts == {"paragraphs_removed": 0, "token_cut": False}


def _long_row(tokenizer, rows):
    """A real row whose post has newlines and whose query is over the limit.

    At the paper's 512 tokens SmolLM2's tokenizer has such rows; Llama 3.2's denser
    tokenizer has none in this data (the longest query is 505 tokens), so for it the
    same rule is checked at 400 tokens.
    """
    for limit in (512, 400):
        for row in rows:
            if "\n" in row["post"] and n_tokens(tokenizer, format_query(row, FMT)) > limit:
                return row, limit
    raise AssertionError("no real row long enough")


def test_long_post_loses_whole_last_paragraphs(tokenizer, sft_rows):
    """A real post over the limit is cut at its last newline(s), no more than needed."""
    row, limit = _long_row(tokenizer, sft_rows)
    query, ids, counts = truncate_query(row, tokenizer, QueryFormat(max_query_length=limit))
    assert len(ids) <= limit
    assert counts["paragraphs_removed"] >= 1 and counts["token_cut"] is False
    kept = query.split("\n\nPOST: ", 1)[1][: -len("\n\nTL;DR:")]
    assert row["post"].startswith(kept)
    assert row["post"][len(kept)] == "\n"  # cut exactly at a newline
    # one paragraph fewer removed would not fit: the cut is the smallest that works
    next_cut = row["post"].find("\n", len(kept) + 1)
    longer = row["post"][:next_cut] if next_cut >= 0 else row["post"]
    assert n_tokens(tokenizer, format_query(dict(row, post=longer), FMT)) > limit


def test_smollm2_has_real_posts_over_512_tokens(smol_tokenizer, sft_rows):
    row, limit = _long_row(smol_tokenizer, sft_rows)
    assert limit == 512
    _, ids, counts = truncate_query(row, smol_tokenizer, FMT)
    assert len(ids) <= 512 and counts["paragraphs_removed"] >= 1


def test_post_without_newline_is_cut_by_tokens(tokenizer, sft_rows):
    row = next(r for r in sft_rows if "\n" not in r["post"] and len(r["post"]) > 800)
    full = n_tokens(tokenizer, format_query(row, FMT))
    fmt = QueryFormat(max_query_length=full - 40)
    query, ids, counts = truncate_query(row, tokenizer, fmt)
    assert counts == {"paragraphs_removed": 0, "token_cut": True}
    assert full - 40 - 3 <= len(ids) <= full - 40
    post = query.split("\n\nPOST: ", 1)[1][: -len("\n\nTL;DR:")]
    assert row["post"].startswith(post) and len(post) < len(row["post"])
    assert query.endswith("\n\nTL;DR:")


def test_paragraphs_go_first_then_tokens(tokenizer, sft_rows):
    row = next(r for r in sft_rows if r["post"].count("\n") >= 2 and len(r["post"].split("\n")[0]) > 400)
    fmt = QueryFormat(
        max_query_length=n_tokens(tokenizer, format_query(dict(row, post=row["post"].split("\n")[0]), FMT)) - 20
    )
    query, ids, counts = truncate_query(row, tokenizer, fmt)
    assert counts["paragraphs_removed"] >= 2 and counts["token_cut"] is True
    assert len(ids) <= fmt.max_query_length
    assert "\n" not in query.split("\n\nPOST: ", 1)[1][: -len("\n\nTL;DR:")]


def test_query_that_cannot_fit_is_a_bad_row(tokenizer, sft_rows):
    with pytest.raises(BadRow, match="query_too_long"):
        truncate_query(sft_rows[0], tokenizer, QueryFormat(max_query_length=5))


def _truncate_one_paragraph_at_a_time(row: dict, tokenizer, fmt: QueryFormat) -> tuple[str, list[int], dict]:
    """The reference for :func:`truncate_query`: the paper code's loop (and this project's until
    it bisected), which drops one paragraph and tokenises the whole query again, up to once per
    newline of the post."""
    fields, limit, key = dict(row), fmt.max_query_length, fmt.truncate_field
    query = format_query(fields, fmt)
    ids = tokenizer(query, add_special_tokens=True)["input_ids"]
    paragraphs, token_cut = 0, False
    while len(ids) > limit:
        text = fields.get(key) or ""
        cut = text.rfind("\n")
        if cut >= 0:
            fields[key] = text[:cut]
            paragraphs += 1
        else:
            if not text:
                raise BadRow("query_too_long", "")
            text_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            keep = min(len(text_ids) - (len(ids) - limit), len(text_ids) - 1)
            fields[key] = tokenizer.decode(text_ids[: max(keep, 0)])
            token_cut = True
        query = format_query(fields, fmt)
        ids = tokenizer(query, add_special_tokens=True)["input_ids"]
    return query, ids, {"paragraphs_removed": paragraphs, "token_cut": token_cut}


def _distinct_posts(tldr_dir) -> dict[str, list[dict]]:
    """Every distinct post of the real files, by task: TL;DR (SFT and comparison files) and CNN/DM."""
    out: dict[str, dict[tuple, dict]] = {"tldr": {}, "cnndm": {}}
    files = {
        "tldr": ["sft_train.jsonl", "sft_validation.jsonl", "sft_test.jsonl", "preference_validation.jsonl"],
        "cnndm": ["preference_validation_cnndm.jsonl"],
    }
    for task, names in files.items():
        for name in names:
            for row in read_jsonl(tldr_dir / name):
                out[task].setdefault((row.get("subreddit"), row.get("title"), row.get("post")), row)
    return {task: list(rows.values()) for task, rows in out.items()}


@pytest.mark.slow
def test_bisected_truncation_equals_dropping_one_paragraph_at_a_time_on_every_real_post(tokenizer, tldr_dir):
    """Every distinct post of the real files, at the query limits of the presets (TL;DR 256 and
    512, CNN/DM 512 and 1919): the same query, token ids and counts as the one-at-a-time loop."""
    cnndm_template = load_config("cpu-demo").data.cnndm_format.template
    formats = [QueryFormat(max_query_length=n) for n in (256, 512)]
    formats += [QueryFormat(template=cnndm_template, max_query_length=n) for n in (512, 1919)]
    posts = _distinct_posts(tldr_dir)
    assert len(posts["tldr"]) > 500 and len(posts["cnndm"]) >= 40  # the whole folder, or the tests' rows
    checked = truncated = 0
    for fmt in formats:
        for row in posts["cnndm" if fmt.template == cnndm_template else "tldr"]:
            try:
                expected = _truncate_one_paragraph_at_a_time(row, tokenizer, fmt)
            except BadRow:
                with pytest.raises(BadRow):
                    truncate_query(row, tokenizer, fmt)
                continue
            assert truncate_query(row, tokenizer, fmt) == expected, (row.get("id"), fmt.max_query_length)
            checked += 1
            truncated += expected[2]["paragraphs_removed"] > 0
    assert truncated > checked / 4  # many exercise the bisection, not the early return (about 38%)


@pytest.mark.heavy
def test_bisected_truncation_of_a_post_of_hundreds_of_short_paragraphs(smol_tokenizer, sft_rows):
    """A pathological post (hundreds of line breaks) gets the reference's answer with about
    log2(n) tokenisations instead of up to n."""
    row = dict(sft_rows[0], post="\n".join(f"line {i} of a very long post" for i in range(600)))
    calls = []
    tokenizer = _CountingTokenizer(smol_tokenizer, calls)
    got = truncate_query(row, tokenizer, QueryFormat(max_query_length=512))
    assert got == _truncate_one_paragraph_at_a_time(row, smol_tokenizer, QueryFormat(max_query_length=512))
    assert got[2]["paragraphs_removed"] > 450
    assert len(calls) <= 1 + 10  # the whole query, then bisection over 599 newlines


class _CountingTokenizer:
    """A tokenizer that records each call, and otherwise is ``tokenizer``."""

    def __init__(self, tokenizer, calls: list):
        self._tokenizer, self._calls = tokenizer, calls

    def __call__(self, *args, **kwargs):
        self._calls.append(args[0][:20])
        return self._tokenizer(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)


# ------------------------------------------------------------------ Detail 3


def test_response_has_leading_space_and_eos(tokenizer, sft_rows):
    summary = sft_rows[0]["summary"]
    ids = tokenize_response(summary, tokenizer)
    assert ids[-1] == tokenizer.eos_token_id
    assert ids[:-1] == tokenizer(" " + summary, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids[:-1]) == " " + summary
    assert tokenizer.pad_token_id not in ids and tokenizer.pad_token_id != tokenizer.eos_token_id


def test_padding_helpers():
    assert left_pad([5, 6], 4, 0) == [0, 0, 5, 6]
    assert right_pad([5, 6], 4, 0) == [5, 6, 0, 0]
    with pytest.raises(ValueError):
        right_pad([1, 2, 3], 2, 0)


# ---------------------------------------------------------- prepared output


@pytest.fixture(scope="module", params=["llama3.2", "smollm2"])
def prepared(request, tmp_path_factory, llama_tokenizer, smol_tokenizer):
    tok = llama_tokenizer if request.param == "llama3.2" else smol_tokenizer
    cfg = load_config(
        "smoke",
        [
            "data.sft_splits.train.max_rows=64",
            "data.preference_splits.train.max_rows=48",
            "data.preference_splits.validation_cnndm.max_rows=16",
        ],
    )
    out = tmp_path_factory.mktemp(f"data-{request.param}") / "data"
    stats = prepare_data(cfg, out, tokenizer=tok)
    sft, pref, loaded_stats = load_prepared(out)
    assert loaded_stats == json.loads(json.dumps(stats))
    return tok, sft, pref, stats, out


def test_output_layout(prepared):
    tok, sft, pref, stats, out = prepared
    assert set(sft) == {"train", "validation", "test"}
    assert set(pref) == {"train", "validation", "validation_cnndm"}
    for col in (
        "id",
        "subreddit",
        "title",
        "post",
        "query",
        "query_token",
        "reference_response",
        "reference_response_token",
        "query_reference_response_token",
    ):
        assert col in sft["train"].column_names
    for col in (
        "query_token",
        "chosen_token",
        "rejected_token",
        "query_chosen_token",
        "query_rejected_token",
        "batch",
        "confidence",
        "split",
        "chosen_policy",
        "rejected_policy",
    ):
        assert col in pref["train"].column_names
    saved = datasets.load_from_disk(str(out / "sft" / "train"))
    assert len(saved) == 64
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(out / "tokenizer").pad_token_id == tok.pad_token_id
    # no plot in the stage's output: its token lengths are read back for whoever draws them
    assert not (out / "token_lengths.png").exists()
    lengths = token_lengths(out)
    assert lengths["sft/train"]["query"] == list(saved["query_token_len"])
    assert set(lengths["preference/train"]) == {"query", "chosen", "rejected"}


def test_query_text_and_tokens_agree(prepared):
    tok, sft, _, _, _ = prepared
    for row in sft["train"].select(range(10)):
        unpadded = [t for t in row["query_token"] if t != tok.pad_token_id]
        assert unpadded == tok(row["query"])["input_ids"]
        if row["paragraphs_removed"] == 0:
            assert row["query"] == format_query(row, FMT)


def test_queries_are_left_padded_to_max_query_length(prepared):
    tok, sft, pref, stats, _ = prepared
    pad = tok.pad_token_id
    limit = stats["padded_lengths"]["query"]["tldr"]
    assert limit == load_config("smoke").data.tldr_format.max_query_length
    for ds in (sft["train"], pref["train"]):
        for row in ds.select(range(8)):
            q = row["query_token"]
            assert len(q) == limit
            n_pad = limit - row["query_token_len"]
            assert q[:n_pad] == [pad] * n_pad and pad not in q[n_pad:]


def test_sft_sequences_are_query_then_response_right_padded(prepared):
    tok, sft, _, stats, _ = prepared
    pad, eos = tok.pad_token_id, tok.eos_token_id
    total = stats["padded_lengths"]["sft_query_response"]
    for row in sft["train"]:
        q = row["query_token"][len(row["query_token"]) - row["query_token_len"] :]
        r = row["reference_response_token"][: row["reference_response_token_len"]]
        seq = row["query_reference_response_token"]
        assert len(seq) == total
        assert seq[: len(q) + len(r)] == q + r
        assert seq[len(q) + len(r) :] == [pad] * (total - len(q) - len(r))
        # EOS survives padding: it is the last real token and is not PAD
        assert r[-1] == eos and r[-1] != pad
        assert r[:-1] == tok(row["reference_response"], add_special_tokens=False)["input_ids"]
        assert row["reference_response"].startswith(" ")


def test_preference_sequences_are_right_padded(prepared):
    tok, _, pref, stats, _ = prepared
    pad, eos = tok.pad_token_id, tok.eos_token_id
    for name, ds in pref.items():
        task = stats["splits"][f"preference/{name}"]["task"]
        total = stats["padded_lengths"]["rm_query_response"][task]
        for row in ds.select(range(min(8, len(ds)))):
            q = row["query_token"][len(row["query_token"]) - row["query_token_len"] :]
            for side in ("chosen", "rejected"):
                r = row[f"{side}_token"][: row[f"{side}_token_len"]]
                seq = row[f"query_{side}_token"]
                assert len(seq) == total and seq[: len(q) + len(r)] == q + r
                assert set(seq[len(q) + len(r) :]) <= {pad}
                assert r[-1] == eos


def test_padded_lengths_are_derived_from_the_data(prepared):
    """Detail 4: padded lengths are the maxima seen, as the paper derives 53 and 169."""
    _, sft, pref, stats, _ = prepared
    lengths = stats["padded_lengths"]
    resp = [n for ds in sft.values() for n in ds["reference_response_token_len"]]
    assert lengths["sft_response"] == max(resp)
    assert lengths["sft_query_response"] == max(
        q + r for ds in sft.values() for q, r in zip(ds["query_token_len"], ds["reference_response_token_len"])
    )
    assert len(sft["train"][0]["reference_response_token"]) == lengths["sft_response"]
    tldr = [pref["train"], pref["validation"]]
    assert lengths["rm_response"]["tldr"] == max(
        max(list(ds["chosen_token_len"]) + list(ds["rejected_token_len"])) for ds in tldr
    )
    assert lengths["rm_response"]["cnndm"] == max(
        list(pref["validation_cnndm"]["chosen_token_len"]) + list(pref["validation_cnndm"]["rejected_token_len"])
    )
    assert lengths["query"] == {"tldr": 256, "cnndm": 256}  # the smoke preset's limits


def test_length_statistics_are_reported(prepared):
    _, sft, pref, stats, _ = prepared
    s = stats["splits"]["sft/train"]["lengths"]["reference_response"]
    values = sft["train"]["reference_response_token_len"]
    assert (s["min"], s["median"], s["max"]) == (min(values), statistics.median(values), max(values))
    c = stats["splits"]["preference/train"]["lengths"]
    assert c["chosen"]["max"] == max(pref["train"]["chosen_token_len"])
    assert c["rejected"]["median"] == statistics.median(pref["train"]["rejected_token_len"])


def test_comparison_metadata_is_kept(prepared, tldr_dir):
    """Detail 6: batch, confidence, policies and OpenAI's split survive, row for row."""
    _, _, pref, stats, _ = prepared
    source = read_jsonl(tldr_dir / "preference_validation.jsonl")
    for name in ("train", "validation"):
        for row in pref[name]:
            line = int(row["source_row"].rsplit(":", 1)[1])
            raw = source[line - 1]
            assert (row["batch"], row["confidence"], row["split"]) == (
                raw["batch"],
                raw["confidence"],
                raw["orig_split"],
            )
            assert (row["chosen_policy"], row["rejected_policy"]) == (raw["chosen_policy"], raw["rejected_policy"])
            assert (row["chosen"], row["rejected"]) == (raw["chosen"].strip(), raw["rejected"].strip())
    assert set(pref["train"]["batch"]) == {"batch13"}
    assert set(pref["validation"]["batch"]) <= {"batch18", "edit_b2_eval_test"}
    assert set(pref["validation"]["split"]) <= {"valid1", "valid2"}
    assert stats["splits"]["preference/train"]["batches"] == {"batch13": 48}


def test_policy_pairs_are_unordered_and_counted_once_per_comparison():
    """Table 2 / Appendix L: a pair is its two policies sorted, whichever was chosen; a policy
    against itself is a pair; a row without both policies is left out and counted."""
    chosen = ["sup4_t0.7", "ref", "ref", None, "", "sup4_t0.7", "b"]
    rejected = ["ref", "sup4_t0.7", "ref", "ref", "ref", "ref", "a"]
    assert policy_pairs(chosen, rejected) == {
        "unique": 3,
        "comparisons": 5,
        "without_policies": 2,
        "per_pair": {"min": 1, "median": 1, "max": 3},
        "pairs": [  # most compared first, ties by name
            {"policies": "ref, sup4_t0.7", "count": 3},
            {"policies": "a, b", "count": 1},
            {"policies": "ref, ref", "count": 1},
        ],
    }
    assert policy_pairs(["x", "y"], ["y", "z"])["per_pair"] == {"min": 1, "median": 1.0, "max": 1}
    assert policy_pairs([None, ""], ["a", None]) is None  # no policies named (TRL-format rows)


def test_each_preference_split_counts_the_policy_pairs_its_source_rows_compare(prepared):
    """Table 2 on the real rows: each split's pairs recounted from the source files' rows
    (the offline re-split: train is batch13, one pair; validation batch18's sampling variants)."""
    _, _, pref, stats, _ = prepared
    files: dict[str, list[dict]] = {}
    for name in ("train", "validation", "validation_cnndm"):
        recount: dict[str, int] = {}
        for where in pref[name]["source_row"]:
            path, line = where.rsplit(":", 1)
            raw = files.setdefault(path, read_jsonl(path))[int(line) - 1]
            pair = f"{min(raw['chosen_policy'], raw['rejected_policy'])}, {max(raw['chosen_policy'], raw['rejected_policy'])}"
            recount[pair] = recount.get(pair, 0) + 1
        counted = stats["splits"][f"preference/{name}"]["policy_pairs"]
        assert {p["policies"]: p["count"] for p in counted["pairs"]} == recount
        assert counted["unique"] == len(recount) and counted["comparisons"] == len(pref[name])
        assert counted["per_pair"]["max"] == max(recount.values())
    assert stats["splits"]["preference/train"]["policy_pairs"]["pairs"] == [
        {"policies": "sup4_12b_t0.7, sup4_ppo_rm4_t.7", "count": 48}
    ]
    assert stats["splits"]["preference/validation"]["policy_pairs"]["unique"] > 1
    assert "policy_pairs" not in stats["splits"]["sft/train"]
    metrics, rows = policy_pair_figures(stats)
    assert metrics["data/preference/train/policy_pairs"] == 1.0
    assert metrics["data/preference/train/comparisons_per_pair_median"] == 48.0
    validation = stats["splits"]["preference/validation"]["policy_pairs"]
    assert metrics["data/preference/validation/policy_pairs"] == validation["unique"]
    assert rows[0] == {"split": "preference/train", "policies": "sup4_12b_t0.7, sup4_ppo_rm4_t.7", "comparisons": 48}
    assert len(rows) == sum(s["policy_pairs"]["unique"] for s in stats["splits"].values() if "policy_pairs" in s)
    assert policy_pair_figures({"splits": {"preference/train": {"rows": 3}}}) == ({}, [])  # written before pairs


def test_cnndm_split_uses_the_article_format(prepared):
    _, _, pref, stats, _ = prepared
    row = pref["validation_cnndm"][0]
    assert row["query"].startswith("Article:\n") and row["query"].endswith("\n\nTL;DR:\n")
    assert stats["splits"]["preference/validation_cnndm"]["task"] == "cnndm"


def test_response_cap_drops_and_counts_rows(tmp_path, llama_tokenizer, sft_rows):
    cap = 30
    cfg = load_config("smoke", [f"data.max_sft_response_length={cap}"])
    stats = prepare_data(cfg, tmp_path / "d", tokenizer=llama_tokenizer)
    expected_over = sum(len(tokenize_response(r["summary"].strip(), llama_tokenizer)) > cap for r in sft_rows[:32])
    assert expected_over > 0
    assert stats["dropped"]["sft/train"]["response_too_long"] == expected_over
    assert stats["splits"]["sft/train"]["rows"] == 32 - expected_over
    assert stats["padded_lengths"]["sft_response"] == cap


def test_truncation_counts_on_real_rows(tmp_path, smol_tokenizer):
    cfg = load_config("smoke", ["data.sft_splits.train.max_rows=400", "data.tldr_format.max_query_length=300"])
    stats = prepare_data(cfg, tmp_path / "d", tokenizer=smol_tokenizer)
    trunc = stats["splits"]["sft/train"]["truncation"]
    assert trunc["paragraph"] > 0 and trunc["token"] > 0
    sft, _, _ = load_prepared(tmp_path / "d")
    assert sum(n > 0 for n in sft["train"]["paragraphs_removed"]) == trunc["paragraph"]
    assert max(sft["train"]["query_token_len"]) <= 300


# ------------------------------------------------------------ held-out splits

HOLDOUT = "data.preference_splits.train.holdout={split: validation_in_dist, rows: 16, seed: 1}"


@pytest.fixture(scope="module")
def held_out(tmp_path_factory, smol_tokenizer):
    """The smoke preset's data with 64 batch13 comparisons in train, 16 of them held out, beside
    the same train split without a holdout (tokenised only)."""
    from rlhf_core.data.prepare import tokenize_splits

    rows = "data.preference_splits.train.max_rows=64"
    out = tmp_path_factory.mktemp("held-out") / "data"
    stats = prepare_data(load_config("smoke", [rows, HOLDOUT]), out, tokenizer=smol_tokenizer)
    _, pref, _ = load_prepared(out)
    whole = tokenize_splits(load_config("smoke", [rows]).data, smol_tokenizer).datasets["preference"]["train"]
    return pref, stats, whole


def test_held_out_rows_leave_train_exactly_and_share_no_query_with_it(held_out):
    pref, stats, whole = held_out
    train, held = pref["train"], pref["validation_in_dist"]
    assert list(pref) == ["train", "validation_in_dist", "validation", "validation_cnndm"]
    assert (len(held), len(train)) == (16, 64 - 16)
    # disjoint by row, by post id and by content; together the rows of the whole split, once each
    assert not set(held["source_row"]) & set(train["source_row"])
    assert not set(held["id"]) & set(train["id"])
    assert not set(held["query"]) & set(train["query"])
    assert not set(zip(held["chosen"], held["rejected"])) & set(zip(train["chosen"], train["rejected"]))
    assert sorted([*held["source_row"], *train["source_row"]]) == sorted(whole["source_row"])
    order = list(whole["source_row"])  # each side keeps the file order
    for ds in (train, held):
        assert [order.index(r) for r in ds["source_row"]] == sorted(order.index(r) for r in ds["source_row"])
    entry = stats["splits"]["preference/validation_in_dist"]
    assert (entry["rows"], entry["held_out_of"], entry["holdout_seed"], entry["batches"]) == (
        16,
        "train",
        1,
        {"batch13": 16},
    )
    train_entry = stats["splits"]["preference/train"]
    assert train_entry["rows"] == 48 and "held_out_of" not in train_entry


def test_the_holdout_seed_picks_the_rows(held_out):
    from rlhf_core.data.prepare import holdout_rows

    _, _, whole = held_out
    first, kept = holdout_rows(whole, 16, seed=1)
    assert holdout_rows(whole, 16, seed=1) == (first, kept)
    assert len(first) == 16 and sorted(first + kept) == list(range(len(whole)))
    assert [whole[i]["source_row"] for i in first] == list(held_out[0]["validation_in_dist"]["source_row"])
    other, _ = holdout_rows(whole, 16, seed=2)
    assert len(other) == 16 and other != first


def test_a_holdout_takes_whole_queries_or_fails_naming_its_key():
    from rlhf_core.data.prepare import DataError, holdout_rows

    # posts compared several times (a, c) and once (b, d, e, f): the single ones fill the last rows
    ds = datasets.Dataset.from_dict({"query": ["a", "a", "a", "b", "c", "c", "d", "e", "f"]})
    for seed in range(8):
        held, kept = holdout_rows(ds, 3, seed)
        assert len(held) == 3 and not {ds[i]["query"] for i in held} & {ds[i]["query"] for i in kept}
    with pytest.raises(DataError, match=r"data\.preference_splits\.train\.holdout\.rows: 9 rows held out of 9"):
        holdout_rows(ds, 9, 0, "data.preference_splits.train.holdout.rows")
    one_post = datasets.Dataset.from_dict({"query": ["a"] * 5 + ["b"] * 5})
    with pytest.raises(DataError, match=r"k\.rows: 3 rows cannot be held out by whole queries"):
        holdout_rows(one_post, 3, 0, "k.rows")


def test_a_holdout_larger_than_its_split_fails_naming_the_key(tmp_path, smol_tokenizer):
    from rlhf_core.data.prepare import DataError

    cfg = load_config("smoke", ["data.preference_splits.train.holdout={split: validation_in_dist, rows: 32}"])
    with pytest.raises(DataError, match=r"data\.preference_splits\.train\.holdout\.rows: 32 rows held out of 32"):
        prepare_data(cfg, tmp_path / "d", tokenizer=smol_tokenizer)
    assert not (tmp_path / "d").exists()


def test_the_data_stage_key_holds_the_holdout_and_is_unchanged_without_one():
    from rlhf_core.run.pipeline import stage_config, stage_key

    plain = load_config("smoke")
    # a split without a holdout dumps the fields it had before there were holdouts: the same
    # settings, MLflow params and data stage key as then
    for spec in plain.data.preference_splits.values():
        assert set(spec.model_dump(mode="json")) == {"source", "batches", "exclude_batches", "max_rows", "task"}
    explicit_none = load_config("smoke", ["data.preference_splits.train.holdout=null"])
    assert stage_config(explicit_none, "data") == stage_config(plain, "data")
    keys = {
        "none": stage_key("data", plain, []),
        "held": stage_key("data", load_config("smoke", [HOLDOUT]), []),
        "rows": stage_key("data", load_config("smoke", [HOLDOUT.replace("rows: 16", "rows: 8")]), []),
        "seed": stage_key("data", load_config("smoke", [HOLDOUT.replace("seed: 1", "seed: 2")]), []),
        "name": stage_key("data", load_config("smoke", [HOLDOUT.replace("validation_in_dist", "heldout")]), []),
    }
    assert len(set(keys.values())) == len(keys), keys
    assert stage_key("data", explicit_none, []) == keys["none"]
    assert stage_key("data", load_config("smoke", [HOLDOUT]), []) == keys["held"]
