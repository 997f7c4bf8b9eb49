import base64
import re

import pytest

from rlhf_core.common.tracking import JsonlTracker
from rlhf_core.metrics.statistics import win_rate
from rlhf_core.views import page as report_module
from rlhf_core.views.html import token_shift_html
from rlhf_core.views.page import (
    RUN_MARKER,
    format_value,
    format_win_rate,
    plot_training_curves,
    stamp_report,
    write_report,
)
from rlhf_core.views.plots import plot_length_control

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _metrics_files(root):
    sft = JsonlTracker(root / "sft" / "metrics.jsonl")
    for step in range(1, 31):
        sft.log_metrics({"train/loss": 3.0 / step, "train/lr": 1e-5}, step=step)
    sft.log_metrics({"eval/rougeL": 0.25})  # no step: an end-of-stage summary, not a curve
    rm = JsonlTracker(root / "reward" / "metrics.jsonl")
    rm.log_params({"lr": 3e-6})
    for step in range(1, 6):
        rm.log_metrics({"train/loss": 0.7 - 0.05 * step, "train/accuracy": 0.5 + 0.04 * step}, step=step)
    ppo = JsonlTracker(root / "ppo" / "metrics.jsonl")
    for step in range(1, 4):
        ppo.log_metrics({"objective/scores": 0.1 * step, "objective/kl": 0.5 * step, "loss/value": 1.0}, step=step)
    return {
        "sft": root / "sft" / "metrics.jsonl",
        "reward": root / "reward" / "metrics.jsonl",
        "ppo": root / "ppo" / "metrics.jsonl",
        "missing": root / "nope" / "metrics.jsonl",
    }


def test_plot_training_curves_writes_a_png_with_a_panel_per_existing_key(tmp_path, monkeypatch):
    files = _metrics_files(tmp_path)
    out = plot_training_curves(files, tmp_path / "training_curves.png")
    assert out.read_bytes()[:8] == PNG_MAGIC

    seen = {}

    def capture(fig, path, dpi=90):
        seen["titles"] = [ax.get_title() for ax in fig.axes if ax.axison]
        seen["rows"] = fig.axes[0].get_subplotspec().get_gridspec().get_geometry()
        return path

    monkeypatch.setattr(report_module, "savefig_atomic", capture)
    plot_training_curves(files, tmp_path / "unused.png")
    assert seen["titles"] == [
        "sft: train/loss",
        "reward: train/loss",
        "reward: train/accuracy",
        "ppo: objective/scores",
        "ppo: objective/kl",
    ]
    assert seen["rows"] == (3, 2)  # the missing file has no row; two columns for the widest stage
    plot_training_curves(files, tmp_path / "unused.png", keys={"ppo": ["loss/value", "absent"]})
    assert seen["titles"][-1] == "ppo: loss/value" and len(seen["titles"]) == 4
    # a stage with more keys than columns wraps: sft 1 row, reward 1, ppo (3 keys) 2 rows of 2
    plot_training_curves(
        files, tmp_path / "unused.png", max_columns=2, keys={"ppo": ["objective/scores", "objective/kl", "loss/value"]}
    )
    assert seen["rows"] == (4, 2) and len(seen["titles"]) == 6


def test_plot_training_curves_without_anything_to_plot_raises(tmp_path):
    with pytest.raises(ValueError):
        plot_training_curves({"sft": tmp_path / "missing.jsonl"}, tmp_path / "x.png")
    assert not (tmp_path / "x.png").exists()


def test_format_win_rate_and_cells():
    # 25 of 40 at 95%: centre 0.61405, half 0.14372
    assert format_win_rate(win_rate([True] * 25 + [False] * 15)) == "62.5% [47.0, 75.8] (n=40)"
    assert format_win_rate(win_rate([None])) == "n/a (n=0)"
    assert [format_value(v) for v in (0.23456, float("nan"), None, 3, 12345.6, True)] == [
        "0.235",
        "n/a",
        "–",
        "3",
        "12,346",
        "yes",
    ]


@pytest.fixture
def written(tmp_path):
    out = tmp_path / "report"
    out.mkdir()
    plot_length_control(
        {
            "SFT": ([-0.3, 0.0, 0.2, 0.5], [False, True, False, True]),
            "PPO": ([0.1, 0.3, 0.6, 0.9], [True, True, False, True]),
        },
        out / "length_control.png",
        bins=3,
    )
    plot_training_curves(_metrics_files(tmp_path), out / "training_curves.png")
    long_post = "I <b>really</b> love my cat & dog. " + "More words here. " * 40
    html_path, md_path = write_report(
        out,
        title="TL;DR <RLHF> run",
        headline=[
            {"policy": "base", "ROUGE-L": 0.1234, "win rate": win_rate([True] * 2 + [False] * 38)},
            {
                "policy": "PPO",
                "ROUGE-L": 0.2468,
                "win rate": win_rate([True] * 25 + [False] * 15),
                "title copy": "12.5%",
            },
        ],
        tables={"Reward model": [{"split": "validation", "accuracy": 0.6789}]},
        plots={"Length control": out / "length_control.png", "Training": out / "training_curves.png"},
        captions={"Training": "Loss | accuracy per step."},
        samples=[
            {
                "post": long_post,
                "reference": "Cat > dog?",
                "reference_score": 0.5,
                "sft": "I love pets.",
                "sft_score": 1.25,
                "sft_raw_score": 1.25,
                "ppo": "Cat & dog | love",
                "ppo_score": -0.75,
                "ppo_raw_score": 2.5,
            },
            {"post": "short post", "reference": "r", "sft": "s", "ppo": "p"},
        ],
        html_blocks={"Token shift": token_shift_html(["Hello", " <world>"], [1, 5])},
        notes=["Judged by a small offline judge (SmolLM2-135M): not comparable with GPT-3.5 <or> Claude."],
        intro="Run 42.",
    )
    return out, html_path, md_path


def test_report_files_exist_atomically(written):
    out, html_path, md_path = written
    assert (html_path, md_path) == (out / "report.html", out / "report.md")
    assert sorted(p.name for p in out.iterdir()) == [
        "length_control.png",
        "report.html",
        "report.md",
        "training_curves.png",
    ]


def test_report_html_is_self_contained(written):
    out, html_path, _ = written
    text = html_path.read_text()
    assert text.startswith("<!DOCTYPE html>")
    assert not re.search(r"https?://", text)
    assert "<script" not in text.lower() and "javascript:" not in text.lower()
    assert not re.search(r'(src|href)="(?!data:|#)', text)  # images inline, links within the page
    uris = re.findall(r'<img src="data:image/png;base64,([A-Za-z0-9+/=]+)"', text)
    assert len(uris) == 2
    assert base64.b64decode(uris[0]) == (out / "length_control.png").read_bytes()


def test_report_html_lists_its_sections_and_plots_in_its_contents(written):
    """After the run's name, a contents list links every section below it and each plot, by
    ids the headings carry."""
    _, html_path, _ = written
    text = html_path.read_text()
    nav = re.search(r'<nav class="contents" aria-label="Contents">(.*?)</nav>', text).group(1)
    links = re.findall(r'<a href="#([^"]+)">([^<]+)</a>', nav)
    assert links == [
        ("headline", "Headline"),
        ("notes", "Notes"),
        ("reward-model", "Reward model"),
        ("plots", "Plots"),
        ("plot-length-control", "Length control"),
        ("plot-training", "Training"),
        ("samples", "Samples"),
        ("token-shift", "Token shift"),
    ]
    for anchor, _ in links:
        assert text.count(f'id="{anchor}"') == 1, anchor
    assert text.index(RUN_MARKER) < text.index("<nav") < text.index('<h2 id="headline">')


def test_report_html_content_is_escaped_and_readable(written):
    _, html_path, _ = written
    text = html_path.read_text()
    assert "<title>TL;DR &lt;RLHF&gt; run</title>" in text
    assert "62.5% [47.0, 75.8] (n=40)" in text and "5.0% [" in text and "0.247" in text and "0.679" in text
    assert "<b>really" not in text and "I &lt;b&gt;really&lt;/b&gt; love my cat &amp; dog" in text
    assert "<details><summary>" in text and text.count("<details>") == 1  # only the long post folds
    assert "score 1.250" in text and "score -0.750" in text
    assert "score -0.750, raw 2.500" in text and "raw 1.250" not in text  # raw shown only where it differs
    assert "<th>ppo_raw_score</th>" not in text  # not a column of its own
    assert "Cat &gt; dog?" in text
    assert "GPT-3.5 &lt;or&gt; Claude" in text
    assert "Loss | accuracy per step." in text  # the caller's caption
    assert "Figure 8" in text  # the default caption of length_control.png
    assert '<span class="tok-shifted" title="rank 5"> &lt;world&gt;</span>' in text  # trusted fragment, raw
    order = [
        text.index(h) for h in (">Headline<", ">Notes<", ">Reward model<", ">Plots<", ">Samples<", ">Token shift<")
    ]
    assert order == sorted(order)


def test_report_markdown_carries_the_tables_and_links_plots(written):
    _, _, md_path = written
    text = md_path.read_text()
    assert "| policy | ROUGE-L | win rate | title copy |" in text
    assert "| base | 0.123 | 5.0% [1.4, 16.5] (n=40) | – |" in text
    assert "| PPO | 0.247 | 62.5% [47.0, 75.8] (n=40) | 12.5% |" in text
    assert "](length_control.png)" in text and "](training_curves.png)" in text
    assert "| validation | 0.679 |" in text
    assert "Cat &amp; dog \\| love (score -0.750, raw 2.500)" in text
    assert "data:image" not in text


def test_a_stamped_copy_names_its_run_and_the_stage_report_stays_as_written(written, tmp_path):
    out, html_path, md_path = written
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    run = {"preset": "smoke", "config digest": "0123abcd", "commit": "deadbeef", "MLflow run": "<run&1>"}
    files = ("report.html", "report.md", "length_control.png", "missing.png")
    stamped = stamp_report(out, tmp_path / "run", run, files)
    assert stamped == tmp_path / "run" / "report.html"
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["length_control.png", "report.html", "report.md"]
    text, md = stamped.read_text(), (tmp_path / "run" / "report.md").read_text()
    assert RUN_MARKER not in text and RUN_MARKER not in md
    title = text.index("<h1>")
    assert title < text.index("<h2>This run</h2>") < text.index("<nav") < text.index('<h2 id="headline">')
    assert "<td>&lt;run&amp;1&gt;</td>" in text and "<td>0123abcd</td>" in text  # escaped values
    assert md.index("## This run") < md.index("## Headline") and "| commit | deadbeef |" in md
    assert (tmp_path / "run" / "length_control.png").read_bytes() == before["length_control.png"]
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # the stage's own report is unchanged
    # a report written before the marker existed gets the table right after its title
    (out / "report.html").write_text(before["report.html"].decode().replace(RUN_MARKER, ""))
    older = stamp_report(out, tmp_path / "older", run, files).read_text()
    assert older.index("</h1>") < older.index("<h2>This run</h2>") < older.index('<h2 id="headline">')
    with pytest.raises(FileNotFoundError, match="has no report.html"):
        stamp_report(tmp_path / "nothing", tmp_path / "x", run, files)
