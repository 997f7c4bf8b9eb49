"""The offline presets' rows fetched from the hub (``data.hub_subset``), through the real
``huggingface_hub`` and ``datasets`` code, offline: the hub datasets are repositories in the hub
cache's own layout (tests/hub_layout.py), built from the rows committed with the tests."""

import json
import logging
from pathlib import Path

import huggingface_hub
import pytest

from rlhf_core.config.data_settings import load_subset, subset_dir
from rlhf_core.config.presets import load_config
from rlhf_core.data.files import data_fingerprint
from rlhf_core.data.hub import load_hub_split
from rlhf_core.data.hub_subset import FETCH_RECORD, content_digest, ensure_local_rows, row_identity
from rlhf_core.data.prepare import DataError
from rlhf_core.run.cli import main
from tests.conftest import FIXTURE_TLDR, read_jsonl
from tests.hub_layout import hub_cache_repo, to_hub_comparison

ROWS = FIXTURE_TLDR / "ROWS.json"
SUBSET_FILE = Path(__file__).resolve().parents[3] / "configs" / "data" / "tldr-offline-rows.json"
SFT = "vwxyzjn/summarize_from_feedback_tldr_3_filtered"
COMPARISONS = "openai/summarize_from_feedback"
SFT_COMMIT = "5" * 40
EXPORT_COMMIT = "e" * 40
SCRIPT = "# a loading script: `datasets` no longer runs these\n"
SFT_CARD = (
    "---\nconfigs:\n- config_name: default\n  data_files:\n  - split: validation\n    path: data/validation-*\n---\n"
)


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """An empty hub cache, offline (tests/conftest.py), with no local TL;DR folder set and no
    rows fetched yet (a cache folder of this test's own)."""
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.delenv("RLHF_TLDR_DIR")
    monkeypatch.setenv("RLHF_CACHE_DIR", str(tmp_path / "rlhf-cache"))
    return tmp_path / "hub"


def build_hub(cache, drop: set[str] = frozenset(), add: list[dict] = (), change: dict[str, dict] = {}) -> None:  # noqa: B006
    """The two hub datasets holding the committed rows (less ``drop``, by identity; plus the
    comparisons ``add``; the rows named in ``change`` with those fields replaced), each split in
    reverse order with rows of another split after them.
    ``openai/summarize_from_feedback`` at the pinned revision holds a loading script and no data,
    as on the hub; its rows are in the hub's Parquet export (``refs/convert/parquet``)."""
    sft = {split: read_jsonl(FIXTURE_TLDR / f"sft_{split}.jsonl") for split in ("train", "validation", "test")}
    files: dict = {"README.md": SFT_CARD}
    for split, rows in sft.items():
        other = sft["train" if split != "train" else "test"][:3]
        kept = [r | change.get(row_identity("sft", r), {}) for r in rows if row_identity("sft", r) not in drop]
        files[f"data/{split}-00000-of-00001.parquet"] = kept[::-1] + other
    hub_cache_repo(cache, SFT, SFT_COMMIT, files)
    flat = read_jsonl(FIXTURE_TLDR / "preference_validation.jsonl") + read_jsonl(
        FIXTURE_TLDR / "preference_validation_cnndm.jsonl"
    )
    kept = [
        to_hub_comparison(r | change.get(row_identity("preference", r), {}))
        for r in flat
        if row_identity("preference", r) not in drop
    ]
    pinned = load_subset(str(ROWS)).datasets["preference"].revision
    hub_cache_repo(cache, COMPARISONS, pinned, {"summarize_from_feedback.py": SCRIPT, "README.md": "---\n---\n"})
    export = {
        "comparisons/validation/0000.parquet": kept[::-1] + [to_hub_comparison(r) for r in add],
        "comparisons/train/0000.parquet": [to_hub_comparison(r) for r in flat[:2]],
    }
    hub_cache_repo(cache, COMPARISONS, EXPORT_COMMIT, export, ref="refs/convert/parquet")


def test_the_subset_fetched_from_the_hub_equals_the_local_files(hub_cache):
    """Every file of the subset, rebuilt from the hub splits in the subset's order, equals the
    local file field by field and byte for byte: the data stage reads the same rows, with the same key."""
    build_hub(hub_cache)
    cfg = load_config("smoke", [f"data.hub_subset={ROWS}"])
    assert cfg.data.subset_in_use() == str(ROWS) and cfg.data.resolved_source() == "local"
    folder = ensure_local_rows(cfg.data)
    assert folder == subset_dir(str(ROWS)) and cfg.data.resolved_local_dir() == str(folder)
    for name in json.loads(ROWS.read_text())["files"]:
        fetched, local = read_jsonl(folder / name), read_jsonl(FIXTURE_TLDR / name)
        assert len(fetched) == len(local) > 0
        for got, want in zip(fetched, local):
            assert list(got.items()) == list(want.items()), name
        assert (folder / name).read_bytes() == (FIXTURE_TLDR / name).read_bytes(), name
    record = json.loads((folder / FETCH_RECORD).read_text())
    assert record["datasets"]["preference"]["commits"] == {"validation": EXPORT_COMMIT}  # the Parquet export
    assert record["datasets"]["sft"]["commits"] == {"train": SFT_COMMIT, "validation": SFT_COMMIT, "test": SFT_COMMIT}
    assert not any(f["missing"] for f in record["files"].values())
    local = load_config("smoke", [f"data.local_dir={FIXTURE_TLDR}"])
    assert data_fingerprint(cfg.data) == data_fingerprint(local.data)
    # fetched once: read from its folder from then on, the hub cache gone
    for path in sorted(hub_cache.rglob("*"), reverse=True):
        path.unlink() if path.is_file() else path.rmdir()
    assert ensure_local_rows(cfg.data) == folder


def test_rows_missing_from_the_hub_are_named_and_replaced_by_the_nearest(hub_cache, caplog):
    sft = read_jsonl(FIXTURE_TLDR / "sft_validation.jsonl")
    pref = read_jsonl(FIXTURE_TLDR / "preference_validation.jsonl")
    lost_sft = row_identity("sft", sft[5])
    lost = [r for r in pref if r["batch"] == "batch18"][2]
    # unused comparisons, in hub order: one of another batch, then one of the lost row's batch
    relabelled = dict(lost, worker="another-labeler")  # the same pair compared by another worker
    other_batch = dict(pref[0], worker="another-labeler")
    build_hub(hub_cache, drop={lost_sft, row_identity("preference", lost)}, add=[other_batch, relabelled])
    with caplog.at_level(logging.WARNING, logger="rlhf_core.data.hub_subset"):
        folder = ensure_local_rows(load_config("smoke", [f"data.hub_subset={ROWS}"]).data)
    record = json.loads((folder / FETCH_RECORD).read_text())["files"]
    assert record["sft_validation.jsonl"]["missing"] == [lost_sft]
    assert record["preference_validation.jsonl"]["missing"] == [row_identity("preference", lost)]
    warned = "\n".join(r.getMessage() for r in caplog.records)
    assert "sft_validation.jsonl: 1 of its 450 rows are not in" in warned and "oai1b.csv" in warned
    # the SFT row: the first unused row of the hub split (the kept rows reversed, then train's first)
    fetched = read_jsonl(folder / "sft_validation.jsonl")
    train = read_jsonl(FIXTURE_TLDR / "sft_train.jsonl")
    assert len(fetched) == len(sft) and fetched[5] == train[0] and fetched[:5] == sft[:5]
    # the comparison: the first of the same batch left unused
    fetched = read_jsonl(folder / "preference_validation.jsonl")
    assert fetched[pref.index(lost)] == relabelled
    assert record["preference_validation.jsonl"]["replaced_by"] == {
        row_identity("preference", lost): row_identity("preference", relabelled)
    }


def test_a_row_changed_on_the_hub_under_its_identity_is_refused_by_name(hub_cache, caplog):
    """A row the hub holds under the identity the subset names, with other text (an SFT post
    named by its post id, a comparison's post), is not read: it is named in a warning and in
    the fetch record, and the nearest unused row takes its place, never the changed row itself."""
    sft = read_jsonl(FIXTURE_TLDR / "sft_validation.jsonl")
    pref = read_jsonl(FIXTURE_TLDR / "preference_validation.jsonl")
    named = next(r for r in sft if r["id"])  # named by its post id alone
    edited_post = named["post"] + " EDIT: thanks everyone!"
    compared = [r for r in pref if r["batch"] == "batch18"][1]
    ids = {"sft": row_identity("sft", named), "preference": row_identity("preference", compared)}
    assert row_identity("sft", named | {"post": edited_post}) == ids["sft"]  # the same identity
    relabelled = dict(compared, worker="another-labeler")  # an unused comparison of the same batch
    build_hub(
        hub_cache,
        add=[relabelled],
        change={ids["sft"]: {"post": edited_post}, ids["preference"]: {"title": "another title"}},
    )
    with caplog.at_level(logging.WARNING, logger="rlhf_core.data.hub_subset"):
        folder = ensure_local_rows(load_config("smoke", [f"data.hub_subset={ROWS}"]).data)
    record = json.loads((folder / FETCH_RECORD).read_text())["files"]
    assert record["sft_validation.jsonl"]["changed"] == [ids["sft"]]
    assert record["sft_validation.jsonl"]["missing"] == []
    assert record["preference_validation.jsonl"]["changed"] == [ids["preference"]]
    warned = "\n".join(r.getMessage() for r in caplog.records)
    assert f"sft_validation.jsonl: 1 of its 450 rows differ in {SFT}[validation]" in warned and ids["sft"] in warned
    assert ids["preference"] in warned
    fetched = read_jsonl(folder / "sft_validation.jsonl")
    assert len(fetched) == len(sft) and edited_post not in {r["post"] for r in fetched}
    at = sft.index(named)
    assert fetched[at] != named and fetched[:at] == sft[:at] and fetched[at + 1 :] == sft[at + 1 :]
    assert record["sft_validation.jsonl"]["replaced_by"] == {ids["sft"]: row_identity("sft", fetched[at])}
    fetched = read_jsonl(folder / "preference_validation.jsonl")
    assert "another title" not in {r["title"] for r in fetched}
    assert len(fetched) == len(pref) and fetched[pref.index(compared)] == relabelled
    assert record["preference_validation.jsonl"]["replaced_by"] == {
        ids["preference"]: row_identity("preference", relabelled)
    }


def test_every_row_of_the_committed_subsets_has_its_content_digest():
    """The subset files name each row's content: the committed test rows' digests are theirs."""
    for path in (ROWS, SUBSET_FILE):
        subset = load_subset(str(path))
        assert all(len(f.digests) == len(f.rows) > 0 for f in subset.files), path
    for f in load_subset(str(ROWS)).files:
        rows = read_jsonl(FIXTURE_TLDR / f.name)
        assert list(f.digests) == [content_digest(f.kind, r) for r in rows], f.name


def test_without_a_local_folder_or_the_hub_the_data_stage_stops_in_one_line(hub_cache, tmp_path, capsys):
    assert main(["data", "--preset", "smoke", "--out", str(tmp_path / "data")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("rlhf data: error: no TL;DR rows to read")
    assert "set RLHF_TLDR_DIR" in err and "give this machine a network" in err
    assert "tldr-offline-rows" in err and f"{SFT}@main" in err and "HF_HUB_OFFLINE is set" in err
    assert not (tmp_path / "data").exists() and not subset_dir("tldr-offline-rows").exists()


def test_the_check_before_the_stages_fetches_the_rows(hub_cache):
    from rlhf_core.run.preflight import check_before_stages

    build_hub(hub_cache)
    cfg = load_config("smoke", [f"data.hub_subset={ROWS}"])
    assert not subset_dir(str(ROWS)).exists()
    check_before_stages(cfg, ["data"])
    assert (subset_dir(str(ROWS)) / FETCH_RECORD).is_file()


def test_a_revision_with_no_data_for_the_split_is_named(hub_cache):
    hub_cache_repo(hub_cache, "acme/empty", SFT_COMMIT, {"README.md": "---\n---\n", "data/other.txt": "x"})
    with pytest.raises(DataError, match=r"acme/empty@main \(commit 5{40}\) has no data file for split 'validation'"):
        load_hub_split("acme/empty", None, "validation")
    with pytest.raises(
        DataError, match=r"acme/unknown@main is not in the local hub cache and the hub cannot be reached"
    ):
        load_hub_split("acme/unknown", None, "validation")


def test_a_subset_setting_naming_no_file_is_refused_naming_the_key():
    from rlhf_core.config.settings import ConfigError

    with pytest.raises(ConfigError, match=r"data\.hub_subset.*'no-such-subset'.*tldr-offline-rows"):
        load_config("smoke", ["data.hub_subset=no-such-subset"])
