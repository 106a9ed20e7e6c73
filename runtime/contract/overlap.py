"""Which communication a run overlaps with compute: the one setting the price and the runtime share.

Three switches, one per kind of traffic (plan.json ``overlap``; ``planner train/validate
--overlap on|off`` sets all three):

- ``dp``: data-parallel and ZeRO collectives run beside compute: bucketed gradient reductions
  launched while backward runs, ZeRO 1/2 parameter all-gathers waited at each bucket's first use in
  the next forward, ZeRO-3 gathers prefetched a layer ahead. Off: every one issued where it is
  needed and waited at once.
- ``tp``: tensor-parallel collectives decomposed to run beside the matmuls they feed or follow (a
  column-parallel input gradient's all-reduce beside the weight-gradient product; under sequence
  parallelism chunked all-gathers and reduce-scatters beside partial products). Off: in line.
- ``pp``: pipeline sends and receives posted ahead and left in flight. Off: each waited at once.

Either way the numbers are the same: overlap changes when a collective is waited for, never what
it computes. ``OVERLAP_ALL`` is the default of plans and runs.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Mapping

from runtime.contract.choices import Toggle
from runtime.contract.input_errors import ConfigError

__all__ = ["Overlap", "OVERLAP_KINDS", "OVERLAP_ALL", "OVERLAP_NONE"]

OVERLAP_KINDS: tuple[str, ...] = ("dp", "tp", "pp")
"""The kinds of traffic that overlap separately (plan.json ``overlap``'s keys)."""


@dataclass(frozen=True)
class Overlap:
    """What a run overlaps (and what its price assumed)."""

    dp: bool = True
    """Data-parallel / ZeRO collectives beside forward and backward."""
    tp: bool = True
    """Tensor-parallel collectives beside the matmuls around them."""
    pp: bool = True
    """Pipeline sends and receives left in flight."""

    @classmethod
    def from_toggle(cls, toggle: str | Toggle) -> "Overlap":
        """``on``: all three; ``off``: none (``--overlap``)."""
        if toggle not in (Toggle.ON, Toggle.OFF):
            raise ConfigError(f"--overlap must be 'on' or 'off', got {toggle!r}")
        enabled = toggle == Toggle.ON
        return cls(dp=enabled, tp=enabled, pp=enabled)

    @classmethod
    def from_json(cls, data: Mapping[str, Any] | None) -> "Overlap":
        """Read plan.json's ``overlap`` (absent in plans older than it: everything overlapped)."""
        if data is None:
            return cls()
        unknown = set(data) - set(OVERLAP_KINDS)
        if unknown:
            raise ConfigError(f"plan.json overlap has unknown keys {sorted(unknown)}; expected {list(OVERLAP_KINDS)}")
        for kind, value in data.items():
            if not isinstance(value, bool):
                raise ConfigError(f"plan.json overlap.{kind} must be true or false, got {value!r}")
        return cls(**dict(data))

    @classmethod
    def of(cls, setting: "str | Toggle | Mapping[str, Any] | Overlap") -> "Overlap":
        """An ``Overlap`` from ``on`` / ``off`` (``--overlap``), plan.json's object or itself: a
        program (``benchmarks/bench_published.py``) may set the kinds one by one."""
        if isinstance(setting, Overlap):
            return setting
        if isinstance(setting, Mapping):
            return cls.from_json(setting)
        return cls.from_toggle(setting)

    def to_json(self) -> dict[str, bool]:
        """plan.json's ``overlap`` object."""
        return asdict(self)

    @property
    def any(self) -> bool:
        """Whether anything overlaps."""
        return self.dp or self.tp or self.pp


OVERLAP_ALL = Overlap()
"""Everything overlapped: the default of plans and runs."""
OVERLAP_NONE = Overlap(dp=False, tp=False, pp=False)
"""Every collective waited where it is issued (``--overlap off``)."""
