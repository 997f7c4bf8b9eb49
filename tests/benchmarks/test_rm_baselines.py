"""benchmarks/rm_baselines.py: the reward-model baselines on comparisons held out by post."""

from benchmarks.rm_baselines import candidate, split_by_post


def rows():
    """Policy a beats b on every post; the chosen summary is the longer one on even posts."""
    out = []
    for post in range(10):
        for _ in range(2):
            long, short = "one two three", "one"
            chosen, rejected = (long, short) if post % 2 == 0 else (short, long)
            out.append({"post": f"p{post}", "chosen": chosen, "rejected": rejected})
            out[-1] |= {"chosen_policy": "a", "rejected_policy": "b"}
    return out


def test_posts_are_held_out_whole_and_the_baselines_measured_on_them():
    train, held = split_by_post(rows(), 0.2, seed=1)
    assert len(held) == 4 and len(train) == 16  # 2 of 10 posts, both of each post's rows
    assert not {r["post"] for r in train} & {r["post"] for r in held}
    assert split_by_post(rows(), 0.2, seed=1) == (train, held)  # seeded
    out = candidate(rows(), 0.2, seed=1)
    assert out["held_out_rows"] == 4 and out["policy_win_rates"] == {"a": 1.0, "b": 0.0}
    assert out["policy_prior"]["accuracy"] == 1.0  # a always wins, and the prior knows it from train
    even = sum(int(r["post"][1:]) % 2 == 0 for r in held)
    assert out["longer_wins"]["accuracy"] == even / 4
