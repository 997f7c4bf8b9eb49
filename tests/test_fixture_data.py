"""The TL;DR rows committed with the tests (tests/data/tldr) are real rows of the offline folder,
named in their ``ROWS.json`` and in the offline presets' subset file; checked against the whole
folder, row by row, where it lies beside the repository."""

import json
import subprocess
import sys

from rlhf_core.data.hub_subset import row_identity
from tests.conftest import FIXTURE_TLDR, REPO, SHARED_TLDR

SUBSET = REPO / "configs" / "data" / "tldr-offline-rows.json"


def _lines(path):
    with open(path, encoding="utf-8") as fh:  # one row a line ("\u2028" in a text is no line break)
        return fh.readlines()


def test_the_committed_rows_are_named_in_order_and_small():
    rows = json.loads((FIXTURE_TLDR / "ROWS.json").read_text())
    offline = json.loads(SUBSET.read_text())
    assert rows["datasets"] == offline["datasets"]
    for name, entry in rows["files"].items():
        named = [row_identity(entry["kind"], json.loads(line)) for line in _lines(FIXTURE_TLDR / name)]
        assert named == entry["rows"] and named, name
        if name in offline["files"]:  # a subset of the offline presets' rows, in their order
            order = {ident: i for i, ident in enumerate(offline["files"][name]["rows"])}
            assert all(ident in order for ident in named), name
            assert [order[i] for i in named] == sorted(order[i] for i in named), name
    assert sum(p.stat().st_size for p in FIXTURE_TLDR.iterdir()) <= 3_000_000
    assert "CC BY 4.0" in (FIXTURE_TLDR / "README.md").read_text()
    assert "Copyright (c) 2020 OpenAI" in (FIXTURE_TLDR / "LICENSE-comparisons.txt").read_text()


def test_the_committed_rows_are_the_offline_folders_own_where_it_is_present(tmp_path):
    """Where the whole offline folder lies beside the repository (as in CI), the committed rows
    are its lines, byte for byte, as its script selects them, and the subset file names each of
    its rows; without it, the committed rows and the subset file agree (the test above)."""
    if not SHARED_TLDR.is_dir():
        offline = json.loads(SUBSET.read_text())
        assert sum(len(f["rows"]) for f in offline["files"].values()) > 4000  # the whole folder's rows
        return
    out = subprocess.run(
        [sys.executable, str(REPO / "infra" / "tldr_subset.py"), str(SHARED_TLDR)],
        capture_output=True,
        text=True,
        check=True,
        cwd=REPO,
    ).stdout
    assert json.loads(out) == json.loads(SUBSET.read_text())
    from tests.data.make_tldr_fixture import FIRST_ROWS, select

    for name, rule in FIRST_ROWS.items():
        assert select(_lines(SHARED_TLDR / name), rule) == _lines(FIXTURE_TLDR / name), name
