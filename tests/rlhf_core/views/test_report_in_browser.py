"""A run's ``report.html`` read in a real browser (tests/browser.py) as a person reads it, on a
laptop's screen and a phone's: the images load, the console stays quiet, nothing runs off the
right edge, the first table shows without scrolling and every link leads somewhere. No pixel
is compared."""

import re

import pytest

from rlhf_core.common.tracking import NullTracker
from rlhf_core.config.presets import load_config
from rlhf_core.report.run_report import REPORT_FILES
from rlhf_core.run.pipeline import STAGES
from rlhf_core.views.page import stamp_report
from tests.browser import LAPTOP, PHONE, broken_images, horizontal_overflow, unresolved_links
from tests.rlhf_core.evaluation.test_evaluation import stages  # noqa: F401  (the evaluation's inputs)

#: What names a run in its report, as long as the pipeline's (flows/pipeline.py: run_provenance).
PROVENANCE = {
    "preset": "smoke",
    "config digest": "3f1c9a0e7b5d2c4f8a6e1b3d5c7f9a0e2b4d6c8f1a3e5b7d9c0f2a4e6b8d1c3f",
    "commit": "9b2e4d6f8a1c3e5b7d9f0a2c4e6b8d1f3a5c7e9b (with uncommitted changes)",
    "date (UTC)": "2025-01-01 12:00:00",
    "MLflow run": "http://127.0.0.1:5000/#/experiments/1/runs/0123456789abcdef0123456789abcdef",
    "Prefect flow run": "quixotic-heron (0f8e7d6c-5b4a-3928-1706-f5e4d3c2b1a0)",
}


@pytest.fixture(scope="module")
def report(browser, stages, tmp_path_factory):  # noqa: F811  (the fixture imported above)
    """The evaluation stage's report on smoke models, stamped with a run's provenance as the
    pipeline stamps it: the ``report.html`` a user opens. Made only where there is a browser
    to read it."""
    cfg, root = stages
    cfg = load_config(
        "smoke",
        [
            "eval.max_samples=4",
            "eval.diversity_prompts=0",
            "eval.token_shift_samples=1",
            "eval.judge_human_comparisons=0",
        ],
    )
    out = tmp_path_factory.mktemp("report")
    names = ("data", "base", "sft", "reward", "reward_norm", "reward_eval", "ppo", "dpo", "dpo_eval")
    STAGES["evaluation"].run(cfg, [root / name for name in names], out / "evaluation", NullTracker())
    return stamp_report(out / "evaluation", out / "run", PROVENANCE, REPORT_FILES)


@pytest.mark.parametrize("viewport", [LAPTOP, PHONE], ids=["1280px", "390px"])
@pytest.mark.heavy
def test_the_report_reads_well_on_a_laptop_and_a_phone(report, visit, viewport):
    seen = visit(report.as_uri(), viewport)
    page = seen.page
    assert page.get_by_role("heading", level=1).is_visible()
    assert page.locator("img").count() == len(list(report.parent.glob("*.png"))) >= 2  # every plot, shown
    assert broken_images(page) == []
    assert seen.console_errors == []
    contents = page.get_by_role("navigation", name="Contents").get_by_role("link")
    assert contents.count() >= 5 and contents.first.is_visible()  # the sections and the plots
    assert unresolved_links(page, report.parent) == []
    assert horizontal_overflow(page) == 0, "the page scrolls sideways: a table or image is wider than the screen"
    for table in page.get_by_role("table").all():  # each table's own box fits the screen; it scrolls inside it
        box = table.locator("xpath=..").bounding_box()
        assert box["x"] >= 0 and box["x"] + box["width"] <= viewport["width"] + 0.5


@pytest.mark.heavy
def test_the_first_table_shows_without_scrolling_on_a_laptop(report, visit):
    page = visit(report.as_uri(), LAPTOP).page
    heading = page.get_by_role("heading", name=re.compile("^Does it learn"))
    assert heading.is_visible()
    table = page.locator("h2:has-text('Does it learn') + * table, h2:has-text('Does it learn') + table").first
    assert table.is_visible()
    box = table.bounding_box()
    assert box["y"] >= 0 and box["y"] + box["height"] <= LAPTOP["height"], f"the table ends {box} below the fold"
    assert box["x"] + box["width"] <= LAPTOP["width"]
    assert table.get_by_role("columnheader").count() >= 3
    assert table.get_by_role("row").count() >= 2


@pytest.mark.heavy
def test_the_checks_see_a_broken_image_and_a_table_wider_than_a_phone(report, visit, tmp_path):
    """The checks above fail where a person would see something wrong: a plot whose data is
    corrupt shows as a broken image, one cut short as a part of one, a table out of its scrolling box pushes the page wider
    than a phone's screen, and a contents entry whose section lost its id leads nowhere."""
    text = report.read_text()
    first = re.search(r'<img src="data:image/png;base64,([^"]+)" alt="([^"]+)"', text)
    broken = tmp_path / "broken" / "report.html"
    broken.parent.mkdir()
    broken.write_text(text.replace(first.group(1), "bm90IGEgUE5H", 1))  # "not a PNG"
    assert broken_images(visit(broken.as_uri(), LAPTOP).page) == [first.group(2)]
    cut = tmp_path / "cut" / "report.html"  # a PNG cut short, which Chromium reports loaded
    cut.parent.mkdir()
    cut.write_text(text.replace(first.group(1), first.group(1)[:400], 1))
    assert broken_images(visit(cut.as_uri(), LAPTOP).page) == [first.group(2)]

    wide = tmp_path / "wide" / "report.html"
    wide.parent.mkdir()
    wide.write_text(text.replace("</head>", "<style>.table{overflow-x:visible}</style></head>", 1))
    assert horizontal_overflow(visit(wide.as_uri(), PHONE).page) > 0

    lost = tmp_path / "lost" / "report.html"
    lost.parent.mkdir()
    lost.write_text(text.replace('<h2 id="headline">', "<h2>", 1))
    assert unresolved_links(visit(lost.as_uri(), LAPTOP).page, lost.parent) == ["#headline"]
