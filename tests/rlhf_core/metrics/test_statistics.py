import math
import re

import pytest
import torch

from rlhf_core.metrics.statistics import (
    agreement,
    judge_label_agreement,
    length_control,
    length_log_ratio,
    mean_ignoring_missing,
    wilson_interval,
    win_rate,
)
from rlhf_core.metrics.text import (
    diversity,
    normalized_edit_distance,
    repetition_loop,
    repetition_rate,
    title_copy_rate,
    title_coverage,
    token_ranks,
    words,
)
from rlhf_core.views.html import token_shift_html
from rlhf_core.views.plots import plot_length_control

# ----------------------------------------------------------------------------- win rate


def test_the_mean_skips_none_and_nan_and_is_nan_when_nothing_is_left():
    assert mean_ignoring_missing([1.0, None, 3.0, float("nan"), 5]) == 3.0
    assert mean_ignoring_missing([2.0, float("inf")]) == float("inf")  # an infinity is a value, kept
    assert math.isnan(mean_ignoring_missing([None, float("nan")])) and math.isnan(mean_ignoring_missing([]))


def test_wilson_interval_of_8_in_10():
    """z = 1.96: centre (0.8 + 0.19208) / 1.38416 = 0.71674, half 0.22658."""
    out = win_rate([True] * 8 + [False] * 2)
    assert out["win_rate"] == 0.8
    assert out["ci_low"] == pytest.approx(0.4902, abs=5e-4)
    assert out["ci_high"] == pytest.approx(0.9433, abs=5e-4)
    assert (out["n_valid"], out["n_invalid"]) == (10, 0)


def test_wilson_interval_at_the_extremes_stays_inside_0_1():
    """0/10: centre = half = 0.19208 / 1.38416 = 0.13877, so [0, 0.2775]; 10/10 mirrors it."""
    low, high = wilson_interval(0, 10)
    assert low == 0.0 and high == pytest.approx(0.2775, abs=5e-4)
    low, high = wilson_interval(10, 10)
    assert low == pytest.approx(0.7225, abs=5e-4) and high == 1.0


def test_wilson_interval_narrows_with_lower_confidence():
    """90%: z = 1.6449, 8/10 -> centre 0.73612, half 0.19533."""
    out = win_rate([True] * 8 + [False] * 2, confidence=0.90)
    assert out["ci_low"] == pytest.approx(0.5408, abs=5e-4)
    assert out["ci_high"] == pytest.approx(0.9315, abs=5e-4)


def test_win_rate_counts_none_as_invalid_and_leaves_it_out():
    out = win_rate([True, None, False, True, None, True])
    assert out["win_rate"] == 0.75
    assert (out["n_valid"], out["n_invalid"]) == (4, 2)


def test_win_rate_without_valid_judgements_is_nan():
    out = win_rate([None, None])
    assert math.isnan(out["win_rate"]) and math.isnan(out["ci_low"]) and math.isnan(out["ci_high"])
    assert (out["n_valid"], out["n_invalid"]) == (0, 2)
    assert math.isnan(win_rate([])["win_rate"])


def test_a_tie_counts_as_half_a_win_in_the_rate_and_its_interval():
    out = win_rate([1.0, 0.5, 0.0, 0.5, None])
    assert out["win_rate"] == 0.5 and (out["n_valid"], out["n_invalid"]) == (4, 1)
    assert (out["ci_low"], out["ci_high"]) == pytest.approx(wilson_interval(2, 4))
    assert win_rate([True, 0.5])["win_rate"] == 0.75
    with pytest.raises(ValueError, match="tie"):
        win_rate([0.25])


@pytest.mark.parametrize("confidence", [0.0, 1.0, 1.5])
def test_win_rate_rejects_a_bad_confidence(confidence):
    with pytest.raises(ValueError):
        win_rate([True], confidence=confidence)


# ----------------------------------------------------------------------------- length control


def test_length_log_ratio_in_words_and_in_tokens():
    ratios = length_log_ratio(["a b c d", "one two", "x"], ["w x", "one two", "y y y y"])
    assert ratios == pytest.approx([math.log(2), 0.0, math.log(1 / 4)])
    assert length_log_ratio(["abcd"], ["ab"], tokenize=list) == pytest.approx([math.log(2)])


def test_length_log_ratio_of_an_empty_side_is_nan():
    ratios = length_log_ratio(["", "a b"], ["a", "   "])
    assert all(math.isnan(r) for r in ratios)
    with pytest.raises(ValueError):
        length_log_ratio(["a"], ["a", "b"])


def test_length_control_bins_with_explicit_edges():
    ratios = [-0.5, -0.2, 0.0, 0.3, 1.0, 1.5, float("nan"), -2.0]
    wins = [True, False, True, None, True, True, True, False]
    rows = length_control(ratios, wins, bins=[-1.0, 0.0, 1.0])
    assert [(r["low"], r["high"], r["center"]) for r in rows] == [(-1.0, 0.0, -0.5), (0.0, 1.0, 0.5)]
    # [-1, 0): -0.5 won, -0.2 lost; [0, 1]: 0.0 won, 0.3 unjudged, 1.0 (last edge) won;
    # 1.5 and -2.0 are outside, nan is left out.
    assert [(r["n"], r["n_invalid"]) for r in rows] == [(2, 0), (2, 1)]
    assert [r["win_rate"] for r in rows] == [0.5, 1.0]
    assert rows[0]["ci_low"] < 0.5 < rows[0]["ci_high"]


def test_length_control_with_a_bin_count_spans_the_finite_range_and_keeps_empty_bins():
    rows = length_control([0.0, 1.0, 4.0, float("nan")], [True, False, True, True], bins=4)
    assert [r["low"] for r in rows] == [0.0, 1.0, 2.0, 3.0]
    assert [r["n"] for r in rows] == [1, 1, 0, 1]
    assert math.isnan(rows[2]["win_rate"])


def test_length_control_rejects_bad_input():
    with pytest.raises(ValueError):
        length_control([0.0, 1.0], [True], bins=2)
    with pytest.raises(ValueError):
        length_control([0.0], [True], bins=[1.0, 0.0])
    with pytest.raises(ValueError):
        length_control([float("nan")], [True], bins=3)


def test_plot_length_control_writes_a_png_atomically(tmp_path):
    curves = {
        "SFT": ([-0.5, 0.0, 0.4, 0.8], [False, True, False, True]),
        "PPO": ([0.1, 0.5, 0.9, float("nan")], [True, True, None, False]),
    }
    out = plot_length_control(curves, tmp_path / "length_control.png", bins=3)
    assert out == tmp_path / "length_control.png"
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [p.name for p in tmp_path.iterdir()] == ["length_control.png"]  # no temporary file left


# ----------------------------------------------------------------------------- title copying


def test_words_lower_cases_and_strips_punctuation():
    assert words("My [24F] dog's ball!!") == ["my", "24f", "dog", "s", "ball"]


def test_title_coverage_of_an_exact_copy_is_one():
    title = "So, my mom woke me up with a loud TV."
    assert title_coverage(title, title) == 1.0
    assert title_coverage("so my MOM woke me up with a loud tv", title) == 1.0


def test_title_coverage_of_partial_copies():
    # title: so my mom woke me up with a loud tv (10 words); all but "so" repeated in order
    assert title_coverage("My mom woke me up with a loud TV.", "So, my mom woke me up with a loud TV.") == 0.9
    # title: i 24f lost my job today (6 words); "lost my job" in order
    assert title_coverage("Lost my job, feeling bad about it", "I (24F) lost my job today") == 0.5
    # order matters: the longest common subsequence of "job my lost" and "lost my job" is one word
    assert title_coverage("job my lost", "lost my job") == pytest.approx(1 / 3)
    assert title_coverage("nothing shared", "lost my job") == 0.0
    with pytest.raises(ValueError):
        title_coverage("anything", "?!")


def test_title_copy_rate_excludes_and_counts_empty_titles():
    titles = ["Lost my job today", "My cat hates my new boyfriend", "", "Help!"]
    summaries = ["I lost my job today.", "My cat hates him", "whatever", "please help me"]
    out = title_copy_rate(summaries, titles, threshold=0.8)
    # coverages: 4/4, 3/6 (my cat hates), excluded, 1/1
    assert out["n"] == 3 and out["n_no_title"] == 1
    assert out["copied_indices"] == [0, 3] and out["n_copied"] == 2
    assert out["rate"] == pytest.approx(2 / 3)
    assert out["mean_coverage"] == pytest.approx((1 + 0.5 + 1) / 3)
    assert math.isnan(title_copy_rate(["a"], [""])["rate"])


# ----------------------------------------------------------------------------- diversity


def test_normalized_edit_distance():
    assert normalized_edit_distance("the cat sat", "the dog sat") == pytest.approx(1 / 3)
    assert normalized_edit_distance("a b", "a b c d") == 0.5
    assert normalized_edit_distance("The cat.", "the cat") == 0.0
    assert normalized_edit_distance("", "") == 0.0
    assert normalized_edit_distance("", "one two") == 1.0


def test_diversity_of_identical_and_disjoint_samples():
    assert diversity([["the same summary"] * 4]) == {"mean": 0.0, "n_prompts": 1, "n_skipped": 0}
    assert diversity([["a b", "c d", "e f"]])["mean"] == 1.0


def test_diversity_averages_pairs_then_prompts_and_skips_single_samples():
    # prompt 1 pairs: (a b, a b) 0, (a b, c d) 1, (a b, c d) 1 -> 2/3; prompt 2: 0; prompt 3 skipped
    out = diversity([["a b", "a b", "c d"], ["x", "x"], ["alone"]])
    assert out["mean"] == pytest.approx((2 / 3 + 0) / 2)
    assert (out["n_prompts"], out["n_skipped"]) == (2, 1)
    assert math.isnan(diversity([["alone"]])["mean"])


# ----------------------------------------------------------------------------- agreement


def test_agreement_over_valid_judgements():
    out = agreement([True, True, False, False, True], [True, False, False, None, True])
    assert out == {"agreement": 0.75, "n": 4, "n_invalid": 1}
    # a tie of the judge's two orders agrees by half with either preference of the reward model
    assert agreement([True, False, True], [0.5, 0.5, 1.0])["agreement"] == pytest.approx(2 / 3)
    assert math.isnan(agreement([True], [None])["agreement"])
    with pytest.raises(ValueError):
        agreement([True, False], [True])


class _J:
    """The fields of a Judgement that judge_label_agreement reads."""

    def __init__(self, response_is_a, response_wins, outcome=None, orders_agree=None, swapped=True):
        self.id, self.response_is_a, self.response_wins = "c", response_is_a, response_wins
        self.outcome, self.orders_agree, self.swapped = outcome, orders_agree, (object() if swapped else None)


def test_judge_label_agreement_of_a_judge_that_always_answers_a():
    """The chosen summary shown as A in half the rows: one order agrees exactly there, with an
    "A" share of 1; both orders tie everywhere: agreement 0.5, "A" share 0.5, no consistency."""
    rows = [_J(True, True, 0.5, False), _J(False, False, 0.5, False)] * 10
    one, both = judge_label_agreement(rows, "one"), judge_label_agreement(rows, "both")
    assert (one["n"], one["agreement"], one["a_share"], one["order_consistency"]) == (20, 0.5, 1.0, 0.0)
    assert (both["n"], both["agreement"], both["a_share"]) == (20, 0.5, 0.5)
    assert both["agreement_ci"] == pytest.approx(list(wilson_interval(10, 20)))


def test_judge_label_agreement_of_a_judge_that_reads_the_summaries():
    rows = [
        _J(True, True, 1.0, True),
        _J(False, True, 1.0, True),
        _J(False, None, None, None),
        _J(True, False, 0.0, True),
    ]
    both = judge_label_agreement(rows, "both")
    assert (both["n"], both["n_invalid"], both["agreement"], both["order_consistency"]) == (3, 1, 2 / 3, 1.0)
    assert both["a_share"] == pytest.approx(1 / 3)  # "A" only in row 1: row 2's win was B, row 4's loss B
    one = judge_label_agreement([_J(True, True, swapped=False), _J(True, False, swapped=False)], "one")
    assert one["agreement"] == 0.5 and one["order_consistency"] is None
    with pytest.raises(ValueError, match="swapped"):
        judge_label_agreement([_J(True, True, swapped=False)], "both")
    with pytest.raises(ValueError, match="orders"):
        judge_label_agreement(rows, "two")


@pytest.mark.parametrize(
    "text, loop",
    [
        ("I'm not sure if I should eat it. I'm not sure if I should eat it. I'm not", ("i", "m", "not", "sure")),
        ("girlfriend broke up with me, what do I do", None),
        ("very very good, the the the end", None),  # repeated words are no loop
        ("I love you, I love you", ("i", "love", "you")),
        ("we met. We met. WE MET!", ("we", "met")),  # case and punctuation ignored
        ("ha ha ha ha ha", None),  # 5 words: under the span
        ("", None),
    ],
)
def test_repetition_loop(text, loop):
    found = repetition_loop(text)
    assert (found is None) == (loop is None)
    if loop is not None:
        assert found[: len(loop)] == loop


def test_repetition_rate_with_its_interval():
    out = repetition_rate(["a b c a b c", "a b c d", "x y x y x y", "fine"])
    assert (out["rate"], out["n"]) == (0.5, 4)
    assert (out["ci_low"], out["ci_high"]) == pytest.approx(wilson_interval(2, 4))
    assert repetition_loop("a b a b", min_span=4) == ("a", "b") and repetition_loop("a b a b") is None
    with pytest.raises(ValueError):
        repetition_loop("a", min_span=1)


# ----------------------------------------------------------------------------- token shift


def test_token_ranks_on_hand_made_logits():
    logits = torch.tensor(
        [
            [1.0, 3.0, 2.0, 0.0],  # token 2: only 3.0 is larger -> 2
            [5.0, 5.0, 1.0, 0.0],  # token 1 ties the maximum -> 1
            [0.0, 1.0, 2.0, 3.0],  # token 0: three larger -> 4
            [4.0, 2.0, 2.0, 1.0],  # token 2 ties token 1 below the maximum -> both rank 2
            [4.0, 2.0, 2.0, 1.0],  # token 1 -> 2 as well
        ]
    )
    ranks = token_ranks(logits, torch.tensor([2, 1, 0, 2, 1]))
    assert ranks.dtype == torch.long
    assert ranks.tolist() == [2, 1, 4, 2, 2]
    assert token_ranks(logits.to(torch.bfloat16), torch.tensor([2, 1, 0, 2, 1])).tolist() == [2, 1, 4, 2, 2]


def test_token_ranks_rejects_mismatched_shapes_and_ids():
    with pytest.raises(ValueError):
        token_ranks(torch.zeros(3, 4), torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError):
        token_ranks(torch.zeros(1, 4), torch.tensor([4]))


def test_token_shift_html_escapes_and_colours_by_rank():
    fragment = token_shift_html(["<script>", "alert", "(1)", "</script>", " & more"], [1, 2, 3, 4, 17])
    assert "<script>" not in fragment and "</script>" not in fragment
    spans = re.findall(r'<span class="(tok-[a-z0-9]+)" title="rank (\d+)">(.*?)</span>', fragment)
    assert spans == [
        ("tok-top1", "1", "&lt;script&gt;"),
        ("tok-top3", "2", "alert"),
        ("tok-top3", "3", "(1)"),
        ("tok-shifted", "4", "&lt;/script&gt;"),
        ("tok-shifted", "17", " &amp; more"),
    ]
    legend = fragment.split('<div class="legend">')[1].split("</div>")[0]
    assert re.findall(r'class="(tok-[a-z0-9]+)">[^<]*: (\d+) \((\d+)%\)', legend) == [
        ("tok-top1", "1", "20"),
        ("tok-top3", "2", "40"),
        ("tok-shifted", "2", "40"),
    ]
    assert "http" not in fragment
    with pytest.raises(ValueError):
        token_shift_html(["a"], [0])
    with pytest.raises(ValueError):
        token_shift_html(["a", "b"], [1])
