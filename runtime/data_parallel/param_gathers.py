"""ZeRO 1/2: the parameter all-gathers after ``step()``, left in flight until first use.

After the optimizer step each data-parallel rank holds the updated shard it owns; the other
ranks' shards arrive by an all-gather per group (a layer, in forward order). With overlap on
(``ShardingConfig.overlap``, Megatron-Core's ``--overlap-param-gather``) ``step()`` launches them
all asynchronously, group by group in forward order, and returns; a forward pre-hook on the
module(s) that hold each group (the same modules the ZeRO-3 gathers hook,
``runtime.data_parallel.flat_shards.hook_module_names``) waits for that group's gather just before
the next forward reads it. So the gather of layer ``k + 1`` runs while layer ``k`` computes, and
on a pipeline rank the first receive's wait hides them too.

No read of a stale parameter: the engine waits for every gather still in flight before anything
else reads or writes the parameters -- the next ``step()`` (whose update writes the owned shard a
gather may still be sending), ``state_dict``/``full_state_dict``/``load_state_dict`` (checkpoint
save and resume, export), ``memory_report``/``tracked_tensors`` (the memory tracker),
``close()`` (the end of training) -- and ``ZeroEngine.wait_params()`` is there for any other
reader (an evaluation outside the module's forward). The contract is ZeRO-3's: a group's
parameters are read only inside the forward of its module(s).

With overlap off, and with the optimizer state offloaded (``runtime.data_parallel.offload_engine``,
whose update publishes each group from the host tier), ``step()`` waits for every gather itself.
"""

from __future__ import annotations

from typing import Any, Callable

from torch import nn

from runtime.data_parallel.flat_shards import FlatGroup
from runtime.distributed import comm

__all__ = ["ParamGathers"]


class ParamGathers:
    """The all-gathers of one engine's groups still in flight, and the hooks that wait for them."""

    def __init__(self, counters: dict[str, int]) -> None:
        self.pending: dict[int, Any] = {}
        """Group index -> the handle of its parameter all-gather not yet waited for."""
        self.counters = counters
        """The engine's counters: ``params_waited_at_use`` (gathers waited by a forward pre-hook,
        their first use) and ``params_waited_early`` (by ``wait_all``: another reader, or the next
        step before any forward)."""
        counters.setdefault("params_waited_at_use", 0)
        counters.setdefault("params_waited_early", 0)

    def defer(self, group: FlatGroup, work: Any) -> None:
        """Keep ``group``'s gather in flight (``work`` None: nothing was launched)."""
        if work is not None:
            self.pending[group.index] = work

    def wait(self, groups: list[FlatGroup]) -> None:
        """First use of ``groups``: wait for their gathers (a no-op when none is pending)."""
        for group in groups:
            work = self.pending.pop(group.index, None)
            if work is not None:
                self.counters["params_waited_at_use"] += 1
                comm.wait(work)

    def wait_all(self) -> None:
        """Wait for every gather in flight, in launch order."""
        for index in list(self.pending):
            self.counters["params_waited_early"] += 1
            comm.wait(self.pending.pop(index))

    def hook(self, module: nn.Module, groups: list[FlatGroup]) -> list:
        """Forward pre-hooks that wait for each group's gather before the module(s) holding it run;
        the handles."""
        by_module: dict[str, list[FlatGroup]] = {}
        for group in groups:
            for name in group.hook_modules:
                by_module.setdefault(name, []).append(group)
        handles = []
        for name, held in by_module.items():
            waiter: Callable = lambda mod, args, held=held: self.wait(held)  # noqa: E731
            handles.append(module.get_submodule(name).register_forward_pre_hook(waiter))
        return handles
