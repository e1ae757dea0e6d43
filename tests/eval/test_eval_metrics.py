"""Benchmark metrics against values worked out by hand (in the comments), ties included."""
import math

import pytest

from paco_ds.eval.metrics import overall_score, rank_item_metrics, summarize_edit, summarize_rank

pytestmark = pytest.mark.fast


def test_rank_metrics_reference_form_and_rank_vector_form_differ_as_worked_out():
    # scores per candidate c0..c3 -> pred (best first) = [0, 2, 3, 1]; annotated gt = [0, 1, 3, 2]
    m = rank_item_metrics([0.9, 0.1, 0.8, 0.4], [0, 1, 3, 2])
    assert m["pred_rank"] == [0, 2, 3, 1] and not m["tie"]
    assert m["accuracy"] == 0.5                      # positions 0 and 2 agree
    assert (m["top1_accuracy"], m["bottom1_accuracy"], m["top1_bottom1_accuracy"]) == (1.0, 0.0, 0.5)
    # positions: pred c0:0 c1:3 c2:1 c3:2, gt c0:0 c1:1 c2:3 c3:2 -> 0 + 2 + 2 + 0
    assert m["footrule_distance"] == 4.0
    # index-order lists [0,2,3,1] vs [0,1,3,2]: 5 concordant, 1 discordant pairs -> 4/6
    assert m["kendalltau"] == pytest.approx(2 / 3)
    # ranks [1,3,4,2] vs [1,2,4,3]: sum d^2 = 2 -> 1 - 6*2/(4*15)
    assert m["spearmanr"] == pytest.approx(0.8)
    # per candidate: scores [.9,.1,.8,.4] vs goodness [0,-1,-3,-2]: 3 concordant, 3 discordant
    assert m["kendalltau_ranks"] == pytest.approx(0.0)
    # ranks [4,1,3,2] vs [4,3,1,2]: sum d^2 = 8 -> 1 - 48/60
    assert m["spearmanr_ranks"] == pytest.approx(0.2)


def test_rank_metrics_with_tied_scores():
    # c0 and c2 tie at 0.5: the lower index goes first -> pred = [1, 0, 2, 3]; gt = [1, 2, 0, 3]
    m = rank_item_metrics([0.5, 0.7, 0.5, 0.2], [1, 2, 0, 3])
    assert m["pred_rank"] == [1, 0, 2, 3] and m["tie"]
    assert m["accuracy"] == 0.5 and m["top1_bottom1_accuracy"] == 1.0
    assert m["footrule_distance"] == 2.0              # c0: |2-1|, c2: |1-2|
    assert m["kendalltau"] == pytest.approx(0.0)      # 3 concordant, 3 discordant
    assert m["spearmanr"] == pytest.approx(0.2)       # ranks [2,1,3,4] vs [2,3,1,4]: sum d^2 = 8
    # tau-b: 5 concordant, 0 discordant, 1 pair tied in the scores -> 5 / sqrt((6-1)*6)
    assert m["kendalltau_ranks"] == pytest.approx(5 / math.sqrt(30))
    # average ranks [2.5,4,2.5,1] vs [2,4,3,1]: cov 4.5, var 4.5 and 5 -> 4.5/sqrt(22.5)
    assert m["spearmanr_ranks"] == pytest.approx(math.sqrt(0.9))


def test_rank_summary_counts_ties_and_leaves_undefined_correlations_out():
    items = [rank_item_metrics([0.9, 0.1, 0.8, 0.4], [0, 1, 3, 2]),
             rank_item_metrics([0.5, 0.7, 0.5, 0.2], [1, 2, 0, 3]),
             rank_item_metrics([0.3] * 4, [3, 2, 1, 0])]        # all tied: pred = [0,1,2,3], gt reversed
    assert items[2]["kendalltau"] == pytest.approx(-1.0) and items[2]["footrule_distance"] == 8.0
    assert math.isnan(items[2]["kendalltau_ranks"])
    s = summarize_rank(items)
    assert s["items"] == 3 and s["items_with_ties"] == 2
    assert s["accuracy"] == pytest.approx((0.5 + 0.5 + 0.0) / 3)
    assert s["kendalltau"] == pytest.approx((2 / 3 + 0 - 1) / 3)
    assert s["top1_bottom1_accuracy"] == pytest.approx((0.5 + 1.0 + 0.0) / 3)
    assert s["footrule_distance"] == pytest.approx((4 + 2 + 8) / 3)
    assert s["kendalltau_ranks"] == pytest.approx((0 + 5 / math.sqrt(30)) / 2)
    assert s["kendalltau_ranks_undefined"] == 1


def test_edit_reward_strict_and_geq_per_type_macro_and_groups():
    assert overall_score(0.81, 0.25) == pytest.approx(0.45)
    pf = "prompt_following"
    recs = [{"task_type": "subject-add", "dimension": pf, "score": [0.9, 0.1]},    # strict yes, geq yes
            {"task_type": "subject-add", "dimension": pf, "score": [0.4, 0.4]},    # strict no,  geq yes
            {"task_type": "subject-add", "dimension": pf, "score": [0.2, 0.6]},    # no, no
            {"task_type": "subject-remove", "dimension": pf, "score": [0.5, 0.5]},  # no, yes
            {"task_type": "color_alter", "dimension": pf, "score": [0.7, 0.3]},    # yes, yes
            {"task_type": "extract", "dimension": "consistency", "score": [0.3, 0.8]}]
    s = summarize_edit(recs)
    st, ge = s["strict"][pf], s["geq"][pf]
    assert (st["subject-add"], ge["subject-add"]) == pytest.approx((1 / 3, 2 / 3))
    assert (st["subject-remove"], ge["subject-remove"]) == (0.0, 1.0)
    assert math.isnan(st["compose"])                                   # no records: left out
    assert st["average"] == pytest.approx((1 / 3 + 0 + 1) / 3)         # 4/9
    assert ge["average"] == pytest.approx((2 / 3 + 1 + 1) / 3)         # 8/9
    assert st["object"] == pytest.approx((1 / 3 + 0) / 2) and ge["object"] == pytest.approx((2 / 3 + 1) / 2)
    assert st["appearance"] == 1.0 and math.isnan(st["scene"])
    c = s["strict"]["consistency"]
    assert c["extract"] == 0.0 and c["scene"] == 0.0 and c["average"] == 0.0
    assert s["counts"][pf]["subject-add"] == 3


def test_the_correlations_are_the_definitions_with_ties_on_either_side():
    """scipy's tau-b and rho against the definitions, counted pair by pair, on 200 small samples
    with many ties (integer values in 0..3), as judge scores and annotated ranks have."""
    import numpy as np

    from paco_ds.eval.metrics import kendall_tau_b, spearman_rho

    def tau_b(x, y):
        pairs = [(np.sign(x[i] - x[j]), np.sign(y[i] - y[j])) for i in range(len(x)) for j in range(i + 1, len(x))]
        c = sum(dx * dy > 0 for dx, dy in pairs)
        d = sum(dx * dy < 0 for dx, dy in pairs)
        n0 = len(pairs)
        tx, ty = sum(dx == 0 for dx, _ in pairs), sum(dy == 0 for _, dy in pairs)
        return (c - d) / math.sqrt((n0 - tx) * (n0 - ty))

    def average_ranks(v):
        return np.array([sum(w < a for w in v) + (sum(w == a for w in v) + 1) / 2 for a in v])

    rng = np.random.default_rng(0)
    checked = 0
    for _ in range(200):
        n = int(rng.integers(3, 9))
        x, y = rng.integers(0, 4, n).astype(float), rng.integers(0, 4, n).astype(float)
        if len(set(x)) == 1 or len(set(y)) == 1:
            assert math.isnan(kendall_tau_b(x, y)) and math.isnan(spearman_rho(x, y))
            continue
        assert kendall_tau_b(x, y) == pytest.approx(tau_b(x, y), abs=1e-12)
        assert spearman_rho(x, y) == pytest.approx(np.corrcoef(average_ranks(x), average_ranks(y))[0, 1], abs=1e-12)
        checked += 1
    assert checked > 150
