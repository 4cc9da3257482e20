"""Local calls: what a device runs for its piece of a node when the node's own op would not do.

Nearly every strategy a rule offers is run by calling the node's op on each device's pieces
(with shape arguments made local). A few strategies need a different call on each device:
with a grouped product's experts split, a device multiplies only the rows routed to its own
experts, which it finds from the offsets at run time (:mod:`fxpar.rules.experts`). The op
family that offers such a strategy also writes the call, and this module finds it for the
lowering (:mod:`fxpar.lowering.spmd`) and for the rule checker
(:mod:`fxpar.testing.rules`), so both run the same thing.

A local call is a property of the op and the strategy alone (a grouped product's stacked
weights Shard(0) mean its experts are split), so a plan read from a file, broadcast from rank 0
or cut into pipeline stages lowers the same way. Rules a user registers on a
:class:`~fxpar.rules.RuleRegistry` run the node's own op: only fxpar's op families have
local calls.
"""

from __future__ import annotations

from fxpar.cluster import Coordinate
from fxpar.rules import experts
from fxpar.rules.registry import LocalCall, OpCall
from fxpar.sharding import Strategy

__all__ = ["LocalCall", "has_local_calls", "local_call"]


def has_local_calls(target: object) -> bool:
    """Whether some strategy of ``target`` runs a local call (a cheap test before
    :func:`local_call`, which needs the node's :class:`OpCall`)."""
    return experts.is_grouped_product(target)


def local_call(call: OpCall, strategy: Strategy, coordinate: Coordinate) -> LocalCall | None:
    """What the device at ``coordinate`` calls for its piece of ``call`` under ``strategy``,
    or None when that is the op itself on its local pieces."""
    if experts.is_grouped_product(call.target):
        return experts.local_call(call, strategy, coordinate)
    return None
