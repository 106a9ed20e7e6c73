"""The candidates a search visits: a floor of each one's step time at once, its costs when needed.

Pricing a candidate (``cost_models.strategy.candidate_costs``: each row's state, ZeRO traffic and
the windows that hide it) is most of a re-plan's time, and a search needs few candidates priced.
It visits them by increasing lower bound and stops at the first one above the fourth-best layout.
So an :class:`Entry` carries ``floor`` (``cost_models.strategy.work_floor``: the rows' work alone,
memoized per work setting). That floor is at most the candidate's ``time_lower_bound``. A search
that visits entries by floor and stops at the first floor above its threshold therefore prunes
exactly as soundly as one that priced everything, and only the entries it reaches are priced.
An 8B Llama on 64 H200 has 4,532 candidates, and its search prices about 160 of them.

An entry also knows, before it is priced, whether its model state alone overflows the device
(``too_big``: ``cost_models.strategy.state_floor``, at most ``memory_lower_bound``). A large model
on few devices has many such candidates (Llama-3 70B on 64 H100: 40% of those a search visits),
and a search skips them unpriced, as it would have once priced.
"""

from __future__ import annotations

from typing import Callable

from cost_models.strategy import Candidate, CandidateCosts
from planner.search.candidates import memory_lower_bound, time_lower_bound

__all__ = ["Entry"]


class Entry:
    """One candidate of a search: ``cand`` and ``floor`` now; ``costs``, ``time_lb`` and
    ``memory_lb`` priced by ``price(cand)`` the first time any of them is read."""

    __slots__ = ("cand", "floor", "_price", "_priced", "_too_big")

    def __init__(
        self,
        cand: Candidate,
        floor: float,
        price: Callable[[Candidate], CandidateCosts],
        too_big: Callable[[Candidate], bool] | None = None,
    ):
        self.cand = cand
        self.floor = floor
        self._price: Callable[[Candidate], CandidateCosts] | None = price
        self._priced: tuple[float, float, CandidateCosts] | None = None
        self._too_big: Callable[[Candidate], bool] | bool | None = too_big

    @classmethod
    def of(cls, costs: CandidateCosts) -> "Entry":
        """The entry of a candidate already priced (its floor is its time lower bound)."""
        entry = cls(costs.cand, 0.0, lambda _cand: costs)
        entry.floor = entry.time_lb
        return entry

    def _bounds(self) -> tuple[float, float, CandidateCosts]:
        if self._priced is None:
            assert self._price is not None
            costs = self._price(self.cand)
            self._priced = (time_lower_bound(costs), memory_lower_bound(costs), costs)
            self._price = None  # what it priced from (the table, the profile) is no longer held
        return self._priced

    @property
    def too_big(self) -> bool:
        """Whether no strategy of the candidate fits in memory, known without pricing it when its
        model state alone overflows the device (``memory_lb`` above the capacity once priced)."""
        if self._priced is not None:
            return self._priced[1] > self._priced[2].capacity
        if callable(self._too_big):
            self._too_big = bool(self._too_big(self.cand))
        return bool(self._too_big)

    @property
    def priced(self) -> bool:
        """Whether the costs are known (reading them now costs nothing)."""
        return self._priced is not None

    @property
    def costs(self) -> CandidateCosts:
        return self._bounds()[2]

    @property
    def time_lb(self) -> float:
        """``planner.search.candidates.time_lower_bound`` of the costs (at least ``floor``)."""
        return self._bounds()[0]

    @property
    def memory_lb(self) -> float:
        """``planner.search.candidates.memory_lower_bound`` of the costs."""
        return self._bounds()[1]

    def __repr__(self) -> str:
        priced = f", time_lb={self.time_lb:.4g}" if self.priced else ""
        return f"Entry({self.cand.describe()}, floor={self.floor:.4g}{priced})"
