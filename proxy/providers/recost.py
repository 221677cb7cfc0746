"""When the requests of a model group still queued for its token windows are costed again.

A request's window cost is estimated when it asks for its slot (``estimate.Estimator``), from what its model
group had learned by then. Before the group's first answer that is its priors: the output is the request's own
maximum (64 000 for Claude Code), the input ratio 0.30, nothing in the mirrored prompt cache. A request that
queued then would keep that cost while it waits, long after the first answers taught far smaller numbers.

The rule, in one place: a group's estimates have **moved** when

- it has answers now and had none (or the reverse: the estimator forgot an idle group), or
- the tokens-per-byte ratio in use (window hits raise it), the output p90 or the image p90 is at least
  ``MOVED_BY`` times what it was when they last moved, or at most its inverse (a p90 that appears or vanishes
  moves too).

When they move, each waiter of that group queued in this process is estimated again from its own body
(the mirrored cache as it is then included), whichever way its cost goes, and admission is looked at again
at once; its place in the queue is not part of its cost and does not change. A smaller drift costs nothing
again: a request costs what it was last estimated at until the next move.

While none of the provider's requests is asking for its slot in this process, there is nothing here to cost
again, and the check is not made: the group's answers are not followed. Where its estimates then moved to is
not known, so the first check with a request asking measures from the priors (``PRIOR``): a group that has
answers has moved, and its waiters are estimated again once, from what it has learned by then. Pure: the
caller passes what the estimator says (``Estimator.basis``) and counts the requests asking (``Drift.asking``).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import NamedTuple

from .estimate import PRIOR_RATIO

__all__ = ["MOVED_BY", "PRIOR", "Basis", "Drift", "moved"]

MOVED_BY = 1.2
"""A ratio or p90 that changed by this factor (either way) or more has moved."""


class Basis(NamedTuple):
    """What a model group's estimates rest on (``Estimator.basis``)."""

    answered: bool
    ratio: float
    output_p90: float | None
    image_p90: float | None


PRIOR = Basis(False, PRIOR_RATIO, None, None)
"""A group that has no answer: what every estimate of it rests on."""


def moved(before: Basis, now: Basis) -> bool:
    """Whether estimates resting on ``now`` differ materially from those made on ``before`` (the rule above)."""
    return before.answered != now.answered or _apart(before.ratio, now.ratio) or \
        _apart(before.output_p90, now.output_p90) or _apart(before.image_p90, now.image_p90)


def _apart(before: float | None, now: float | None) -> bool:
    if before is None or now is None:
        return (before is None) != (now is None)
    low, high = min(before, now), max(before, now)
    return high > 0 and high >= MOVED_BY * low


class Drift:
    """One provider's groups, each with the basis its estimates last moved to (``PRIOR`` for a group never
    seen: its first answer moves it). Outlives config reloads as the estimator does; the least recently moved
    group is forgotten first beyond ``kept``."""

    __slots__ = ("_bases", "_kept", "asking")

    def __init__(self, kept: int = 1024) -> None:
        self._bases: OrderedDict[str, Basis] = OrderedDict()
        self._kept = kept
        self.asking = 0
        """The provider's requests asking for their slot in this process now: from their estimate until their
        grant, or until they give up (the caller counts them)."""

    def follows(self, group: str) -> bool:
        """Whether an answer of ``group`` is to be checked (``moved``): only while a request is asking. An
        answer that is not leaves the group unfollowed, measured from the priors at its next check."""
        if self.asking > 0:
            return True
        if group in self._bases:
            del self._bases[group]
        return False

    def moved(self, group: str, basis: Basis) -> bool:
        """Whether ``group``'s estimates moved to ``basis``; if they did, it is the one later moves are
        measured from."""
        if not moved(self._bases.get(group, PRIOR), basis):
            return False
        self._bases[group] = basis
        self._bases.move_to_end(group)
        if len(self._bases) > self._kept:
            self._bases.popitem(last=False)
        return True
