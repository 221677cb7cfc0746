"""When a model group's waiters are costed again (``providers.recost``): the rule, the drift kept per group,
and the basis the estimator reports."""

from __future__ import annotations

import pytest

from proxy.providers.estimate import PRIOR_RATIO, Estimator
from proxy.providers.recost import MOVED_BY, PRIOR, Basis, Drift, moved

OTPM = "output_tokens_per_minute"
ITPM = "input_tokens_per_minute"


@pytest.mark.parametrize(("before", "now", "expected"), [
    (PRIOR, PRIOR, False),
    (PRIOR, Basis(True, 0.3, 500.0, None), True),  # the first answer: the priors are left behind
    (Basis(True, 0.3, 500.0, None), PRIOR, True),  # an idle group forgotten: back to the priors
    (Basis(True, 0.25, 500.0, None), Basis(True, 0.25 * 1.19, 500.0, None), False),
    (Basis(True, 0.25, 500.0, None), Basis(True, 0.25 * MOVED_BY, 500.0, None), True),  # a window hit's raise
    (Basis(True, 0.25, 500.0, None), Basis(True, 0.25 / MOVED_BY, 500.0, None), True),  # down as well as up
    (Basis(True, 0.25, 500.0, None), Basis(True, 0.25, 590.0, None), False),
    (Basis(True, 0.25, 500.0, None), Basis(True, 0.25, 600.0, None), True),
    (Basis(True, 0.25, 500.0, None), Basis(True, 0.25, 100.0, None), True),
    (Basis(True, 0.25, 500.0, None), Basis(True, 0.25, 500.0, 1200.0), True),  # the first image learned
    (Basis(True, 0.25, 500.0, 1200.0), Basis(True, 0.25, 500.0, 1300.0), False),
    (Basis(True, 0.25, 0.0, None), Basis(True, 0.25, 0.0, None), False),
    (Basis(True, 0.25, 0.0, None), Basis(True, 0.25, 1.0, None), True),
])
def test_the_rule(before: Basis, now: Basis, expected: bool) -> None:
    assert moved(before, now) is expected
    assert moved(now, before) is expected, "the rule is symmetric"


def test_the_drift_measures_each_move_from_the_last_one_not_from_each_answer() -> None:
    """Small steps that add up move the group once they reach the factor, measured from the last move."""
    drift = Drift()
    assert drift.moved("opus", Basis(True, 0.3, 500.0, None)), "a group never seen starts from the priors"
    assert not drift.moved("opus", Basis(True, 0.3, 550.0, None))
    assert not drift.moved("opus", Basis(True, 0.3, 590.0, None))
    assert drift.moved("opus", Basis(True, 0.3, 605.0, None)), "605 is 1.21 x the 500 it last moved to"
    assert not drift.moved("opus", Basis(True, 0.3, 700.0, None)), "700 is less than 1.2 x 605"
    assert not drift.moved("sonnet", PRIOR), "each group apart: one still on its priors has not moved"


def test_the_drift_forgets_the_least_recently_moved_group_first() -> None:
    drift = Drift(kept=2)
    learned = Basis(True, 0.3, 500.0, None)
    for group in ("a", "b", "c"):
        assert drift.moved(group, learned)
    assert drift.moved("a", learned), "forgotten: measured from the priors again (one more re-costing, no harm)"
    assert not drift.moved("c", learned)


def test_the_estimator_reports_the_basis_of_its_estimates() -> None:
    estimator = Estimator()
    assert Basis(*estimator.basis("opus")) == PRIOR == Basis(False, PRIOR_RATIO, None, None)
    body = (b'{"model": "claude-opus-4", "max_tokens": 64000, "messages": [{"role": "user", "content": "'
            + b"h" * 4000 + b'"}]}')
    estimate = estimator.estimate(dialect="anthropic", key=None, group="opus", body=body, request=None,
                                  windows=(ITPM, OTPM), now=0.0)
    assert estimate.cost[OTPM] == 64_000, "before any answer: the request's own maximum"
    estimator.learn(key=None, group="opus", estimate=estimate, input_tokens=len(body) // 4, cached_read=0,
                    output_tokens=480, now=1.0)
    answered, ratio, output_p90, image_p90 = estimator.basis("opus")
    assert (answered, output_p90, image_p90) == (True, 480.0, None)
    assert ratio == pytest.approx((len(body) // 4) / len(body))
    assert Basis(*estimator.basis("sonnet")) == PRIOR, "another group learned nothing"
    assert estimator.estimate(dialect="anthropic", key=None, group="opus", body=body, request=None,
                              windows=(ITPM, OTPM), now=2.0).cost[OTPM] == 480
