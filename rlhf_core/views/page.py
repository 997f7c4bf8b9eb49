"""A readable end-of-pipeline report: ``report.html`` (self-contained) and ``report.md``.

The caller assembles the pieces — a headline table (one row per policy), further tables,
PNG plots with captions, sample summaries, trusted HTML fragments such as
:func:`rlhf_core.views.html.token_shift_html`, and notes — and :func:`write_report` lays
them out. The HTML embeds its images as ``data:`` URIs and its CSS inline, and holds no
script and no external reference, so it renders on its own (e.g. in the MLflow UI's
artifact viewer). The markdown carries the same tables and links the PNGs by file name.
"""

from __future__ import annotations

import base64
import html
import math
import mimetypes
import os
import re
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..common.io import atomic_file
from ..common.tracking import read_metrics
from .plots import pyplot, savefig_atomic

DEFAULT_CURVE_KEYS: list[str] = [
    # SFT and reward model (rlhf_core.train.trainer.train_loop's ``train/`` keys)
    "train/loss",
    "train/accuracy",
    # PPO (rlhf_core.ppo.trainer)
    "objective/scores",
    "objective/kl",
    "objective/rlhf_reward",
    "objective/entropy",
    "policy/clipfrac",
    "response/length_mean",
    # DPO (rlhf_core.train.dpo, Figure 6)
    "dpo/loss",
    "dpo/accuracy",
    "dpo/rewards/chosen",
    "dpo/rewards/rejected",
]
"""Metric keys :func:`plot_training_curves` looks for when a stage has no explicit keys."""

DEFAULT_CAPTIONS: dict[str, str] = {
    "length_control": (
        "Win rate against the reference summary (y) by log(summary length / reference length) (x), one "
        "curve per policy; the shaded band is the 95% Wilson interval of each bin. x = 0 is a summary as "
        "long as the reference, x = 0.69 one twice as long. A curve that stays above another across x "
        "wins at every length, so its advantage is not only longer summaries (Huang et al. 2024, Figure 8)."
    ),
    "training_curves": (
        "Training metrics of each stage against the optimisation step. SFT and reward-model loss should "
        "fall and reward-model accuracy rise. In PPO, objective/scores (the reward model's score of the "
        "sampled summaries) should rise while objective/kl (the sampled summaries' KL from the SFT policy, "
        "nats per summary) stays moderate: scores rising together with a fast-growing KL suggest the "
        "policy is exploiting the reward model. In DPO, dpo/loss should fall from log 2 and dpo/accuracy "
        "(the implicit reward preferring the chosen summary) rise; the chosen and rejected rewards often "
        "both fall, the rejected faster (Huang et al. 2024, Figure 6)."
    ),
    "calibration": (
        "Reward-model calibration (Huang et al. 2024, Figure 5): preference pairs binned by the score "
        "difference |r(chosen) − r(rejected)| (x); y is the share of pairs where the chosen response "
        "scores higher. The dashed curve 1/(1+e^−Δ) is a perfectly calibrated model; points below it "
        "mean the model is over-confident."
    ),
    "win_rate_by_length": (
        "Each policy's win rate against the human references (y, with its 95% Wilson interval) by the mean "
        "length of its summaries in tokens (x; the dotted line is the references' mean length): Huang et al. "
        "2024, Figures 7 and 8, left. A judge tends to prefer longer summaries, so a policy that wins more "
        "while writing longer has not necessarily learned to summarise better: compare policies at similar "
        "lengths, or read the plot by length ratio below."
    ),
    "token_lengths": (
        "Histograms of token lengths of queries and responses per split; the dashed red line marks "
        "the longest (Huang et al. 2024, Figures 9-10)."
    ),
    "reward_logits": (
        "The reward model's output at every token of a few validation responses, the chosen and the "
        "rejected one of each pair (Huang et al. 2024, Detail 13, Figure 3). Only the output at the EOS "
        "(orange; the token before the first PAD, Detail 12) is trained, and it is the reward; the others "
        "are by-products (mostly negative for the paper's models; their sign varies with the model) and "
        "are never used as rewards."
    ),
    "value_vs_reward": (
        "The trained value model read as a per-token reward model (Huang et al. 2024, Detail 22): its "
        "output at every token of a few PPO evaluation summaries (green line) against the reward model's "
        "logits there (bars; orange: the score at the EOS). The value model starts as the reward model, "
        "so before PPO the line lies on the bars. PPO trains the value read at each token to predict the "
        "return from the next token on (the score plus the KL penalties still to come), so a trained one "
        "moves towards the score all along the summary, not only at the EOS. Right, in the same row (Figure 11): "
        "the same summary's rewards as PPO's step 2 computes them (bars, before the optional whitening of Detail "
        "24): the KL penalty −kl_coef·(log π − log π_SFT) at every token and, in orange, the score (with the "
        "EOS trick, Detail 23) added at the EOS; and PPO's value of each token, the state before it (line). The "
        "axis is symmetric-log, linear up to the largest KL penalty, so that penalties of a few thousandths show "
        "beside a score of a few units."
    ),
}
"""Captions used for a plot whose file stem is a key here and whose caller gives none."""

_CSS = """
body{font-family:system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;margin:1.5em auto;max-width:1200px;
padding:0 1em;color:#222;line-height:1.45}
h1{font-size:1.6em;margin-bottom:0.2em}h2{font-size:1.25em;margin-top:1.6em;border-bottom:1px solid #ddd}
.table{overflow-x:auto;margin:0.6em 0;max-width:100%}table{border-collapse:collapse;font-size:0.92em}
th,td{border:1px solid #ccc;padding:0.3em 0.6em;text-align:left;vertical-align:top}
th{background:#f0f0f0}tr:nth-child(even) td{background:#fafafa}
td.num{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap}
table.samples{table-layout:fixed;width:100%}table.samples td{font-size:0.9em}
.text{white-space:pre-wrap;word-break:break-word}.score{color:#555;font-size:0.85em;margin-top:0.3em}
details summary{cursor:pointer;white-space:pre-wrap}
img{max-width:100%;height:auto}figure{margin:1em 0}figure img{border:1px solid #eee}
figcaption{font-size:0.9em;color:#333;max-width:60em}
.notes li{margin-bottom:0.3em}
.contents{margin-top:1.2em}.contents ul{margin:0.3em 0;padding-left:1.2em;columns:2 22em}.contents li{margin-bottom:0.2em}
"""


# --------------------------------------------------------------------------- training curves


def _moving_average(values: np.ndarray, window: int) -> np.ndarray:
    kernel = np.ones(window) / window
    return np.convolve(values, kernel, mode="valid")


def plot_training_curves(
    metrics_files: dict[str, str | os.PathLike],
    path: str | os.PathLike,
    keys: dict[str, list[str]] | None = None,
    max_columns: int = 3,
) -> Path:
    """Training curves of each stage in one PNG, a panel per key and a row (or more) per stage,
    written atomically.

    Args:
        metrics_files: ``{stage name: metrics.jsonl}`` written by
            :class:`rlhf_core.common.tracking.JsonlTracker` (read with
            :func:`rlhf_core.common.tracking.read_metrics`); files that do not exist are skipped.
        path: the PNG to write.
        keys: ``{stage name: metric keys}`` to plot; stages not named here (or all stages
            when ``None``) use :data:`DEFAULT_CURVE_KEYS`. Keys a file never logs are skipped.
        max_columns: panels per row; a stage with more keys wraps onto further rows.

    Returns:
        ``path``. Each panel plots one key against the record's step; records without a
        step (end-of-stage summaries) are ignored. Curves with 20 or more points are drawn
        faint with a moving average over ``n // 20`` steps on top.

    Raises:
        ValueError: no file holds any of the keys at any step.
    """
    keys = keys or {}
    panels: list[tuple[str, list[tuple[str, np.ndarray, np.ndarray]]]] = []
    for stage, file in metrics_files.items():
        if not Path(file).is_file():
            continue
        records = [(step, m) for step, m in read_metrics(file) if step is not None]
        series = []
        for key in keys.get(stage, DEFAULT_CURVE_KEYS):
            points = [(step, m[key]) for step, m in records if key in m]
            if points:
                xs, ys = zip(*points)
                series.append((key, np.asarray(xs, dtype=np.float64), np.asarray(ys, dtype=np.float64)))
        if series:
            panels.append((stage, series))
    if not panels:
        raise ValueError(
            f"none of {', '.join(map(str, metrics_files.values())) or 'no files'} holds a stepped metric to plot"
        )
    ncols = min(max_columns, max(len(series) for _, series in panels))
    cells: list[tuple[str, str, np.ndarray, np.ndarray] | None] = []
    for stage, series in panels:  # each stage starts a new row and wraps after ncols panels
        cells += [(stage, *s) for s in series] + [None] * (-len(series) % ncols)
    nrows = len(cells) // ncols
    fig, axes = pyplot().subplots(nrows, ncols, figsize=(3.6 * ncols, 2.7 * nrows), squeeze=False)
    for i, cell in enumerate(cells):
        ax = axes[i // ncols][i % ncols]
        if cell is None:
            ax.axis("off")
        else:
            stage, key, xs, ys = cell
            window = len(xs) // 20
            if window >= 2:
                ax.plot(xs, ys, color="#4C72B0", alpha=0.3, linewidth=0.8, label="per step")
                ax.plot(
                    xs[window - 1 :],
                    _moving_average(ys, window),
                    color="#4C72B0",
                    linewidth=1.6,
                    label=f"mean of {window} steps",
                )
                ax.legend(fontsize=7)
            else:
                ax.plot(xs, ys, "o-" if len(xs) < 10 else "-", color="#4C72B0", markersize=3)
            ax.set_title(f"{stage}: {key}", fontsize=9)
            ax.set_xlabel("step", fontsize=8)
            ax.set_ylabel(key.split("/")[-1], fontsize=8)
            ax.tick_params(labelsize=7)
            ax.grid(alpha=0.3)
    fig.suptitle("Training curves", fontsize=11)
    fig.tight_layout()
    return savefig_atomic(fig, path)


# --------------------------------------------------------------------------- formatting


def format_win_rate(result: dict[str, Any]) -> str:
    """``"62.5% [48.1, 75.0] (n=40)"`` from :func:`rlhf_core.metrics.statistics.win_rate`'s result:
    the rate and its interval in percent, and the number of valid judgements;
    ``"n/a (n=0)"`` when there is none."""
    n = int(result["n_valid"])
    if n == 0 or not math.isfinite(result["win_rate"]):
        return f"n/a (n={n})"
    return f"{100 * result['win_rate']:.1f}% [{100 * result['ci_low']:.1f}, {100 * result['ci_high']:.1f}] (n={n})"


def format_value(value: Any) -> str:
    """The text of one table cell: ``None`` -> ``"–"``, non-finite floats -> ``"n/a"``, other
    floats with three decimals (thousands and above without decimals), a
    :func:`~rlhf_core.metrics.statistics.win_rate` result via :func:`format_win_rate`, anything
    else ``str()``."""
    if value is None:
        return "–"
    if isinstance(value, dict) and {"win_rate", "ci_low", "ci_high", "n_valid"} <= value.keys():
        return format_win_rate(value)
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, (float, np.floating)):
        if not math.isfinite(value):
            return "n/a"
        return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.3f}"
    return str(value)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float, np.number)) and not isinstance(value, bool)


def _columns(rows: Sequence[dict[str, Any]]) -> list[str]:
    cols: list[str] = []
    for row in rows:
        cols.extend(k for k in row if k not in cols)
    return cols


def _html_table(rows: Sequence[dict[str, Any]]) -> str:
    """The rows as an HTML table inside a ``<div class="table">`` box that scrolls sideways on
    its own: a table wider than a phone's screen then leaves the page's width alone."""
    cols = _columns(rows)
    head = "".join(f"<th>{html.escape(c)}</th>" for c in cols)
    body = []
    for row in rows:
        cells = []
        for c in cols:
            v = row.get(c)
            cls = ' class="num"' if _is_number(v) or isinstance(v, dict) else ""
            cells.append(f"<td{cls}>{html.escape(format_value(v))}</td>")
        body.append("<tr>" + "".join(cells) + "</tr>")
    return f'<div class="table"><table><thead><tr>{head}</tr></thead><tbody>{"".join(body)}</tbody></table></div>'


def _md_cell(text: str) -> str:
    return html.escape(" ".join(text.split()), quote=False).replace("|", "\\|")


def _md_table(rows: Sequence[dict[str, Any]]) -> str:
    cols = _columns(rows)
    lines = [
        "| " + " | ".join(_md_cell(c) for c in cols) + " |",
        "|"
        + "|".join(
            "---:" if any(_is_number(r.get(c)) or isinstance(r.get(c), dict) for r in rows) else "---" for c in cols
        )
        + "|",
    ]
    for row in rows:
        lines.append("| " + " | ".join(_md_cell(format_value(row.get(c))) for c in cols) + " |")
    return "\n".join(lines)


def _sample_columns(samples: Sequence[dict[str, Any]]) -> list[str]:
    return [c for c in _columns(samples) if c != "post" and not c.endswith("_score")]


def _score_text(sample: dict[str, Any], col: str) -> str | None:
    score, raw = sample.get(f"{col}_score"), sample.get(f"{col}_raw_score")
    if score is None:
        return None
    text = f"score {format_value(score)}"
    return text if raw is None or raw == score else f"{text}, raw {format_value(raw)}"


def _html_samples(samples: Sequence[dict[str, Any]], post_chars: int) -> str:
    cols = _sample_columns(samples)
    has_post = any("post" in s for s in samples)
    head = ("<th>post</th>" if has_post else "") + "".join(f"<th>{html.escape(c)}</th>" for c in cols)
    body = []
    for s in samples:
        cells = []
        if has_post:
            post = str(s.get("post", ""))
            if len(post) > post_chars:
                cells.append(
                    f"<td><details><summary>{html.escape(post[:post_chars])}… "
                    f"<i>(show all {len(post)} characters)</i></summary>"
                    f'<div class="text">{html.escape(post)}</div></details></td>'
                )
            else:
                cells.append(f'<td><div class="text">{html.escape(post)}</div></td>')
        for c in cols:
            text = "" if s.get(c) is None else str(s[c])
            score = _score_text(s, c)
            score_html = f'<div class="score">{html.escape(score)}</div>' if score else ""
            cells.append(f'<td><div class="text">{html.escape(text)}</div>{score_html}</td>')
        body.append("<tr>" + "".join(cells) + "</tr>")
    return (
        f'<div class="table"><table class="samples"><thead><tr>{head}</tr></thead>'
        f"<tbody>{''.join(body)}</tbody></table></div>"
    )


def _md_samples(samples: Sequence[dict[str, Any]], post_chars: int) -> str:
    cols = _sample_columns(samples)
    has_post = any("post" in s for s in samples)
    rows = []
    for s in samples:
        row = {}
        if has_post:
            post = str(s.get("post", ""))
            row["post"] = post if len(post) <= post_chars else post[:post_chars] + "…"
        for c in cols:
            text = "" if s.get(c) is None else str(s[c])
            score = _score_text(s, c)
            row[c] = f"{text} ({score})" if score else text
        rows.append(row)
    return _md_table(rows)


def _data_uri(path: Path) -> str:
    mime, _ = mimetypes.guess_type(path.name)
    if not mime or not mime.startswith("image/"):
        raise ValueError(f"{path} is not an image file")
    return f"data:{mime};base64,{base64.b64encode(path.read_bytes()).decode('ascii')}"


def _write_text_atomic(path: Path, text: str) -> Path:
    with atomic_file(path) as fh:
        fh.write(text)
    return path


# --------------------------------------------------------------------------- the report

#: Where :func:`stamp_report` puts the table naming the run; :func:`write_report` leaves it
#: in both files (an HTML comment, invisible until stamped), after the "Does it learn?" table
#: and before the headline.
RUN_MARKER = "<!-- rlhf:run -->"


def _anchor(text: str, taken: set[str]) -> str:
    """An HTML id for heading ``text``: its letters and digits in lower case joined by hyphens,
    with ``-2``, ``-3`` ... added where ``taken`` holds it already."""
    base = re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "section"
    anchor, n = base, 1
    while anchor in taken:
        n += 1
        anchor = f"{base}-{n}"
    return anchor


def _contents(sections: Sequence[tuple[str, str]], figures: Sequence[tuple[str, str]]) -> str:
    """The report's contents: a link to each ``(anchor, heading)`` section, the ``figures`` (the
    same pairs) listed under the "Plots" section."""
    esc = html.escape
    items = []
    for anchor, heading in sections:
        item = f'<a href="#{anchor}">{esc(heading)}</a>'
        if heading == "Plots" and figures:
            item += ": " + ", ".join(f'<a href="#{a}">{esc(h)}</a>' for a, h in figures)
        items.append(f"<li>{item}</li>")
    return f'<nav class="contents" aria-label="Contents"><b>Contents</b><ul>{"".join(items)}</ul></nav>'


def write_report(
    out_dir: str | os.PathLike,
    *,
    title: str,
    headline: Sequence[dict[str, Any]],
    summary: Sequence[dict[str, Any]] | None = None,
    tables: dict[str, Sequence[dict[str, Any]]] | None = None,
    plots: dict[str, str | os.PathLike] | None = None,
    captions: dict[str, str] | None = None,
    samples: Sequence[dict[str, Any]] | None = None,
    html_blocks: dict[str, str] | None = None,
    notes: Sequence[str] | None = None,
    intro: str = "",
    post_chars: int = 300,
    figure_tables: dict[str, Sequence[dict[str, Any]]] | None = None,
) -> tuple[Path, Path]:
    """Write ``report.html`` and ``report.md`` to ``out_dir``, each atomically.

    Sections, in order: title and ``intro``; the ``summary`` table ("Does it learn?");
    :data:`RUN_MARKER`; in the HTML, the contents (a link to each section below and to each
    plot); the headline table; notes; each further table; each plot with its caption (and its
    ``figure_tables`` table); the samples; each raw HTML block. Each section's heading has an
    ``id`` made of its words (``Headline`` -> ``headline``), each plot's ``plot-`` and its
    heading's. All text is HTML-escaped except the ``html_blocks`` values.

    Args:
        out_dir: the directory to write to (created if missing).
        title: the report's title.
        headline: rows of the headline table, e.g. one per policy
            ``{"policy": "PPO", "ROUGE-L": 0.25, "RM score": 1.3, "win rate": win_rate(...)}``.
            Columns are the union of the rows' keys, in first-seen order; cells go through
            :func:`format_value` (a :func:`~rlhf_core.metrics.statistics.win_rate` result prints
            as ``"62.5% [48.1, 75.0] (n=40)"``).
        summary: rows of the first table, e.g. one per learning check
            (:func:`rlhf_core.report.learning_checks.learning_checks`); left out when empty.
        tables: ``{heading: rows}`` of further tables (e.g. reward-model accuracy).
        plots: ``{heading: image file}``; the HTML embeds each image as a base64 ``data:``
            URI; the markdown links it by file name, so the caller keeps the images next
            to ``report.md``.
        captions: ``{heading: caption}`` saying what a plot shows and how to read it; a plot
            without one gets :data:`DEFAULT_CAPTIONS` for its file stem, if any.
        samples: one dict per post: ``post`` (truncated to ``post_chars`` characters in
            the HTML behind an expandable ``<details>``, and in the markdown), then a
            column per other key (e.g. ``reference``, ``base``, ``sft``, ``ppo``); a key
            ``{column}_score`` is shown under that column's text as its reward score, and
            ``{column}_raw_score`` beside it when it differs (a score replaced by the EOS
            trick's penalty, Detail 23).
        html_blocks: ``{heading: trusted HTML fragment}`` inserted unescaped into the HTML
            (e.g. :func:`rlhf_core.views.html.token_shift_html`); the markdown points to
            the HTML for them.
        notes: caveats shown right after the headline (e.g. which judge produced the win
            rates and that they are not comparable with other judges').
        intro: a paragraph under the title (e.g. the run and configuration).
        post_chars: characters of each post shown before truncation.
        figure_tables: ``{plot heading: rows}``: a table shown right under that plot (e.g. the
            figures behind it); a heading that is not in ``plots`` is ignored.

    Returns:
        ``(report.html, report.md)`` paths.

    Raises:
        FileNotFoundError: a plot file does not exist (nothing is written).
        ValueError: a plot file is not an image (nothing is written).
    """
    out_dir = Path(out_dir)
    tables, plots, captions, figure_tables = tables or {}, plots or {}, captions or {}, figure_tables or {}
    samples, html_blocks, notes = list(samples or []), html_blocks or {}, list(notes or [])
    figures = []
    for heading, file in plots.items():
        file = Path(file)
        if not file.is_file():
            raise FileNotFoundError(f"plot {heading!r}: {file} does not exist")
        figures.append((heading, file, captions.get(heading, DEFAULT_CAPTIONS.get(file.stem, "")), _data_uri(file)))
    esc = html.escape
    figure_ids: dict[str, str] = {}
    for heading, *_ in figures:
        figure_ids[heading] = "plot-" + _anchor(heading, set(figure_ids.values()))

    toc: list[tuple[str, str]] = []  # (anchor, heading) of each section, for the contents

    def h2(text: str) -> str:
        anchor = _anchor(text, {a for a, _ in toc})
        toc.append((anchor, text))
        return f'<h2 id="{anchor}">{esc(text)}</h2>'

    h = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>{esc(title)}</title><style>{_CSS}</style></head><body>",
        f"<h1>{esc(title)}</h1>",
    ]
    m = [f"# {title}", ""]
    if intro:
        h.append(f'<p class="text">{esc(intro)}</p>')
        m += [intro, ""]
    if summary:
        h += [h2("Does it learn? Checks on rows no training saw"), _html_table(summary)]
        m += ["## Does it learn? Checks on rows no training saw", "", _md_table(summary), ""]
    # the run's name after the verdict, so that "Does it learn?" fits a laptop's first screen
    h.append(RUN_MARKER)
    m += [RUN_MARKER, ""]
    contents_at, listed_from = len(h), len(toc)  # the contents of what follows, after "This run"
    h += [h2("Headline"), _html_table(headline)]
    m += ["## Headline", "", _md_table(headline), ""]
    if notes:
        h += [h2("Notes"), '<ul class="notes">' + "".join(f"<li>{esc(n)}</li>" for n in notes) + "</ul>"]
        m += ["## Notes", ""] + [f"- {_md_cell(n)}" for n in notes] + [""]
    for heading, rows in tables.items():
        h += [h2(heading), _html_table(rows)]
        m += [f"## {heading}", "", _md_table(rows), ""]
    if figures:
        h.append(h2("Plots"))
        m += ["## Plots", ""]
    for heading, file, caption, uri in figures:
        cap = f" {esc(caption)}" if caption else ""
        h.append(
            f'<figure id="{figure_ids[heading]}"><img src="{uri}" alt="{esc(heading)}">'
            f"<figcaption><b>{esc(heading)}.</b>{cap}</figcaption></figure>"
        )
        m += [f"### {heading}", "", f"![{heading}]({file.name})", ""] + ([caption, ""] if caption else [])
        if figure_tables.get(heading):
            h.append(_html_table(figure_tables[heading]))
            m += [_md_table(figure_tables[heading]), ""]
    if samples:
        h += [h2("Samples"), _html_samples(samples, post_chars)]
        m += ["## Samples", "", _md_samples(samples, post_chars), ""]
    for heading, fragment in html_blocks.items():
        h += [h2(heading), fragment]
        m += [f"## {heading}", "", "Shown in report.html.", ""]
    h.insert(contents_at, _contents(toc[listed_from:], [(figure_ids[f[0]], f[0]) for f in figures]))
    h.append("</body></html>")

    out_dir.mkdir(parents=True, exist_ok=True)
    html_path = _write_text_atomic(out_dir / "report.html", "\n".join(h) + "\n")
    md_path = _write_text_atomic(out_dir / "report.md", "\n".join(m).rstrip() + "\n")
    return html_path, md_path


def stamp_report(
    src_dir: str | os.PathLike, dst_dir: str | os.PathLike, run: dict[str, str], files: Sequence[str]
) -> Path:
    """Copy the report ``files`` that exist in ``src_dir`` to ``dst_dir`` and name the run in
    its HTML and markdown: a table "This run" of ``run`` (e.g. preset, config digest, commit,
    date, MLflow run id) where :func:`write_report` left :data:`RUN_MARKER`, before the
    headline (right after the title in a report written without it). Values are escaped.

    The stage's own report stays as written, so that identical work keeps an identical
    artifact; the stamped copy belongs to one run.

    Returns:
        ``dst_dir/report.html``.

    Raises:
        FileNotFoundError: ``src_dir`` has no ``report.html``.
    """
    src, dst = Path(src_dir), Path(dst_dir)
    if not (src / "report.html").is_file():
        raise FileNotFoundError(f"{src} has no report.html")
    rows = [{"": key, "value": str(value)} for key, value in run.items()]
    blocks = {
        ".html": ("</h1>", "<h2>This run</h2>" + _html_table(rows)),
        ".md": ("\n", "## This run\n\n" + _md_table(rows) + "\n"),
    }
    dst.mkdir(parents=True, exist_ok=True)
    for name in files:
        if not (src / name).is_file():
            continue
        suffix = Path(name).suffix
        if suffix not in blocks:
            shutil.copyfile(src / name, dst / name)
            continue
        after, block = blocks[suffix]
        text = (src / name).read_text()
        if RUN_MARKER in text:
            text = text.replace(RUN_MARKER, block, 1)
        else:
            cut = text.find(after) + len(after) if after in text else 0
            text = text[:cut] + "\n" + block + "\n" + text[cut:]
        _write_text_atomic(dst / name, text)
    return dst / "report.html"
