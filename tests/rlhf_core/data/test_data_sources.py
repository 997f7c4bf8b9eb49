"""Bad input, and the hub code path exercised with local dataset directories in the hub layout."""

import codecs
import json
from pathlib import Path

import pytest

from rlhf_core.config.presets import load_config
from rlhf_core.data.prepare import DataError, prepare_data
from rlhf_core.data.prepared import load_prepared
from tests.conftest import read_jsonl
from tests.hub_layout import to_hub_comparison

SPLITS = [
    "data.sft_splits={train: {source: train}}",
    "data.preference_splits={train: {source: train}}",
]


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture
def local_dir(tmp_path, sft_rows, preference_rows):
    """A local data directory holding a few real rows (the tests then damage some)."""
    d = tmp_path / "tldr"
    d.mkdir()
    write_jsonl(d / "sft_train.jsonl", sft_rows[:6])
    write_jsonl(d / "preference_train.jsonl", preference_rows[:6])
    return d


def cfg_for(local_dir, *extra):
    return load_config("smoke", [*SPLITS, f"data.local_dir={local_dir}", "data.on_bad_row=error", *extra])


@pytest.mark.parametrize(
    "damage, reason",
    [
        (lambda r: r.pop("summary"), "missing_field:summary"),
        (lambda r: r.update(title=None), "null_field:title"),
        (lambda r: r.update(post=123), "non_string_field:post"),
        (lambda r: r.update(post="  \n "), "empty_field:post"),
        (lambda r: r.update(summary=""), "empty_field:summary"),
        (lambda r: r.update(subreddit=["a"]), "non_string_field:subreddit"),
    ],
)
def test_bad_row_error_names_file_row_and_field(tmp_path, local_dir, sft_rows, llama_tokenizer, damage, reason):
    rows = [dict(r) for r in sft_rows[:6]]
    damage(rows[2])
    write_jsonl(local_dir / "sft_train.jsonl", rows)
    out = tmp_path / "out"
    with pytest.raises(DataError) as err:
        prepare_data(cfg_for(local_dir), out, tokenizer=llama_tokenizer)
    assert "sft_train.jsonl:3" in str(err.value) and reason in str(err.value)
    assert not out.exists() and not list(tmp_path.glob(".out.*"))  # nothing half-written


def test_bad_preference_row_is_named(tmp_path, local_dir, preference_rows, llama_tokenizer):
    rows = [dict(r) for r in preference_rows[:6]]
    rows[4]["rejected"] = ""
    rows[1]["confidence"] = "high"
    write_jsonl(local_dir / "preference_train.jsonl", rows)
    with pytest.raises(DataError, match=r"preference_train\.jsonl:2.*non_integer_field:confidence"):
        prepare_data(cfg_for(local_dir), tmp_path / "out", tokenizer=llama_tokenizer)


def test_file_that_is_not_jsonl(tmp_path, local_dir, llama_tokenizer):
    (local_dir / "sft_train.jsonl").write_text("id,subreddit,title,post,summary\n1,a,b,c,d\n")
    with pytest.raises(DataError, match=r"sft_train\.jsonl:1.*invalid_json.*JSONL"):
        prepare_data(cfg_for(local_dir), tmp_path / "out", tokenizer=llama_tokenizer)
    (local_dir / "sft_train.jsonl").write_text(json.dumps([{"post": "x"}]) + "\n")
    with pytest.raises(DataError, match=r"sft_train\.jsonl:1.*not_an_object"):
        prepare_data(cfg_for(local_dir), tmp_path / "out", tokenizer=llama_tokenizer)
    (local_dir / "sft_train.jsonl").write_bytes(b"\xff\xfe\x00binary")
    with pytest.raises(DataError, match=r"sft_train\.jsonl:1: bad sft row \(not_utf8: byte 0xff at byte 1"):
        prepare_data(cfg_for(local_dir), tmp_path / "out", tokenizer=llama_tokenizer)


def test_missing_split_file_is_named(tmp_path, local_dir, llama_tokenizer):
    (local_dir / "preference_train.jsonl").unlink()
    with pytest.raises(DataError, match=r"no file preference_train\.jsonl in .*tldr"):
        prepare_data(cfg_for(local_dir), tmp_path / "out", tokenizer=llama_tokenizer)


def test_skip_counts_every_bad_row(tmp_path, local_dir, sft_rows, llama_tokenizer):
    rows = [dict(r) for r in sft_rows[:8]]
    rows[1].pop("post")
    rows[3]["summary"] = None
    rows[5]["post"] = ""
    lines = [json.dumps(r) for r in rows]
    lines.insert(6, "{not json")
    (local_dir / "sft_train.jsonl").write_text("\n".join(lines) + "\n")
    stats = prepare_data(cfg_for(local_dir, "data.on_bad_row=skip"), tmp_path / "out", tokenizer=llama_tokenizer)
    assert stats["dropped"]["sft/train"] == {
        "missing_field:post": 1,
        "null_field:summary": 1,
        "empty_field:post": 1,
        "invalid_json": 1,
    }
    assert stats["splits"]["sft/train"]["rows"] == 5
    assert stats["dropped_total"] == 4
    assert {e["where"].rsplit("/", 1)[1] for e in stats["dropped_examples"]} == {
        "sft_train.jsonl:2",
        "sft_train.jsonl:4",
        "sft_train.jsonl:6",
        "sft_train.jsonl:7",
    }
    written = json.loads((tmp_path / "out" / "stats.json").read_text())
    assert written["dropped"] == stats["dropped"]


@pytest.mark.heavy
def test_real_cnndm_rows_with_empty_summaries(tmp_path, tldr_dir, llama_tokenizer):
    """The released CNN/DM comparisons include empty summaries: an error by default, counted with skip."""
    cnndm = read_jsonl(tldr_dir / "preference_validation_cnndm.jsonl")
    first_bad = next(i for i, r in enumerate(cnndm) if not r["rejected"].strip()) + 1
    base = [
        "data.sft_splits={train: {source: validation, max_rows: 4}}",
        "data.preference_splits={cnn: {source: validation, batches: [batch0_cnndm, cnndm0], task: cnndm}}",
        "data.cnndm_format.max_query_length=4000",
    ]
    with pytest.raises(DataError, match=rf"preference_validation_cnndm\.jsonl:{first_bad}\b.*empty_field:rejected"):
        prepare_data(load_config("smoke", base + ["data.on_bad_row=error"]), tmp_path / "a", tokenizer=llama_tokenizer)
    stats = prepare_data(load_config("smoke", base), tmp_path / "b", tokenizer=llama_tokenizer)
    empty = sum(1 for r in cnndm if not r["rejected"].strip() or not r["chosen"].strip())
    assert stats["dropped"]["preference/cnn"] == {"empty_field:rejected": empty}
    assert stats["splits"]["preference/cnn"]["rows"] == len(cnndm) - empty


# ------------------------------------------------------------------ hub path


# The dataset card of the hub's comparisons config: data files and the declared schema.
HUB_COMPARISONS_CARD = """---
configs:
- config_name: comparisons
  data_files:
  - split: train
    path: comparisons/train.jsonl
  - split: validation
    path: comparisons/validation.jsonl
dataset_info:
- config_name: comparisons
  features:
  - name: info
    struct:
    - {name: id, dtype: string}
    - {name: post, dtype: string}
    - {name: title, dtype: string}
    - {name: subreddit, dtype: string}
    - {name: site, dtype: string}
    - {name: article, dtype: string}
  - name: summaries
    list:
    - {name: text, dtype: string}
    - {name: policy, dtype: string}
    - {name: note, dtype: string}
  - {name: choice, dtype: int32}
  - {name: worker, dtype: string}
  - {name: batch, dtype: string}
  - {name: split, dtype: string}
  - name: extra
    struct:
    - {name: confidence, dtype: int32}
---
"""


def test_hub_loader_matches_the_local_loader(tmp_path, tldr_dir, sft_rows, preference_rows, llama_tokenizer):
    """Hub-layout dataset directories through `datasets.load_dataset` give the same output as local JSONL."""
    sft = {"train": sft_rows[:6], "validation": sft_rows[6:10], "test": sft_rows[10:13]}
    cnndm = [r for r in read_jsonl(tldr_dir / "preference_validation_cnndm.jsonl") if r["rejected"]][:4]
    pref = {
        "train": [r for r in preference_rows if r["batch"] == "batch13"][:5],
        "validation": [r for r in preference_rows if r["batch"] == "batch18"][:4],
    }

    hub_sft = tmp_path / "hub_sft"
    hub_sft.mkdir()
    for split, rows in sft.items():
        write_jsonl(hub_sft / f"{split}.jsonl", rows)
    hub_cmp = tmp_path / "hub_cmp"
    (hub_cmp / "comparisons").mkdir(parents=True)
    (hub_cmp / "README.md").write_text(HUB_COMPARISONS_CARD)
    write_jsonl(hub_cmp / "comparisons" / "train.jsonl", [to_hub_comparison(r) for r in pref["train"]])
    write_jsonl(
        hub_cmp / "comparisons" / "validation.jsonl", [to_hub_comparison(r) for r in pref["validation"] + cnndm]
    )

    local = tmp_path / "local"
    local.mkdir()
    for split, rows in sft.items():
        write_jsonl(local / f"sft_{split}.jsonl", rows)
    write_jsonl(local / "preference_train.jsonl", pref["train"])
    write_jsonl(local / "preference_validation.jsonl", pref["validation"])
    write_jsonl(local / "preference_validation_cnndm.jsonl", cnndm)

    # the default (hub) split layout: validation minus CNN/DM batches, and validation_cnndm
    hub_cfg = load_config(
        None, ["data.source=hub", f"data.sft_dataset={hub_sft}", f"data.preference_dataset={hub_cmp}"]
    )
    local_cfg = load_config(None, ["data.source=local", f"data.local_dir={local}"])
    assert hub_cfg.data.preference_splits["validation_cnndm"].batches  # defaults kept
    hub_stats = prepare_data(hub_cfg, tmp_path / "from_hub", tokenizer=llama_tokenizer)
    local_stats = prepare_data(local_cfg, tmp_path / "from_local", tokenizer=llama_tokenizer)
    assert hub_stats["padded_lengths"] == local_stats["padded_lengths"]
    h_sft, h_pref, _ = load_prepared(tmp_path / "from_hub")
    l_sft, l_pref, _ = load_prepared(tmp_path / "from_local")
    for split in ("train", "validation", "test"):
        for col in ("query", "query_token", "reference_response_token", "query_reference_response_token"):
            assert list(h_sft[split][col]) == list(l_sft[split][col])
    assert [len(h_pref[s]) for s in ("train", "validation", "validation_cnndm")] == [5, 4, 4]
    for split in ("train", "validation", "validation_cnndm"):
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
            "chosen",
            "rejected",
        ):
            assert list(h_pref[split][col]) == list(l_pref[split][col]), (split, col)
    assert set(h_pref["validation_cnndm"]["batch"]) <= {"batch0_cnndm", "cnndm0"}
    assert "source_row" in h_pref["train"].column_names and "hub_cmp[train] row 0" in h_pref["train"][0]["source_row"]


def _sft_file(rows: list[dict], surrogate: int | None = None, latin1: int | None = None, bom: bool = False) -> bytes:
    """JSONL bytes of ``rows``: row ``surrogate`` with a JSON-escaped lone surrogate at the start
    of its post, row ``latin1`` with a Latin-1 (not UTF-8) byte in its summary."""
    lines = [json.dumps(r).encode() for r in rows]
    if surrogate is not None:
        lines[surrogate] = lines[surrogate].replace(b'"post": "', b'"post": "\\ud800', 1)
    if latin1 is not None:
        lines[latin1] = lines[latin1].replace(b'"summary": "', b'"summary": "caf\xe9 ', 1)
    return (codecs.BOM_UTF8 if bom else b"") + b"\n".join(lines) + b"\n"


@pytest.mark.parametrize(
    "defect, message",
    [
        (
            {"surrogate": 2},
            r"sft_train\.jsonl:3: bad sft row \(invalid_unicode:post: lone surrogate U\+D800 at character 0\)",
        ),
        ({"latin1": 2}, r"sft_train\.jsonl:3: bad sft row \(not_utf8: byte 0xe9 at byte \d+ of the line\)"),
        ({"duplicate": 2}, r"sft_train\.jsonl:3: bad sft row \(duplicate_id: the same id as \S*sft_train\.jsonl:1\)"),
    ],
)
def test_each_kind_of_bad_row_is_named_by_file_and_line(
    tmp_path, local_dir, sft_rows, llama_tokenizer, defect, message
):
    rows = [dict(r) for r in sft_rows[:6]]
    if defect.pop("duplicate", None) is not None:
        rows[0]["id"] = rows[2]["id"] = "t3_same"
    (local_dir / "sft_train.jsonl").write_bytes(_sft_file(rows, **defect))
    with pytest.raises(DataError, match=message):
        prepare_data(cfg_for(local_dir), tmp_path / "out", tokenizer=llama_tokenizer)


def test_a_repeated_comparison_is_named_with_its_first_copy(tmp_path, local_dir, preference_rows, llama_tokenizer):
    prefs = [dict(r) for r in preference_rows[:6]]
    write_jsonl(local_dir / "preference_train.jsonl", [*prefs, prefs[2]])
    with pytest.raises(
        DataError,
        match=r"preference_train\.jsonl:7: bad preference row \(duplicate_row: the same row as \S*preference_train\.jsonl:3\)",
    ):
        prepare_data(cfg_for(local_dir), tmp_path / "out", tokenizer=llama_tokenizer)


def test_skip_mode_skips_every_per_row_defect_and_keeps_the_row_behind_a_bom(
    tmp_path, local_dir, sft_rows, preference_rows, llama_tokenizer
):
    rows = [dict(r) for r in sft_rows[:8]]
    rows[1]["id"] = rows[5]["id"] = "t3_same"
    (local_dir / "sft_train.jsonl").write_bytes(_sft_file(rows, surrogate=2, latin1=3, bom=True))
    prefs = [dict(r) for r in preference_rows[:6]]
    write_jsonl(local_dir / "preference_train.jsonl", [*prefs, prefs[2]])
    stats = prepare_data(cfg_for(local_dir, "data.on_bad_row=skip"), tmp_path / "out", tokenizer=llama_tokenizer)
    assert stats["dropped"] == {
        "sft/train": {"invalid_unicode:post": 1, "not_utf8": 1, "duplicate_id": 1},
        "preference/train": {"duplicate_row": 1},
    }
    assert stats["repaired"] == {"sft/train": {"utf8_bom_stripped": 1}}
    assert stats["splits"]["sft/train"]["rows"] == 5 and stats["splits"]["preference/train"]["rows"] == 6
    sft, _, _ = load_prepared(tmp_path / "out")
    assert sft["train"][0]["post"] == rows[0]["post"]  # the first row, behind the mark, is kept
