"""The local calls around a mixture-of-experts block's exchanges, for a block whose tokens are
dispatched to their experts' devices by all-to-all (docs/expert_parallel.md, "Tokens
dispatched").

Each device along the expert axis holds a slice of the tokens and ``E / n`` consecutive
experts. A block's rows are its (token, slot) pairs, ``k`` per token, in *slot order* (token
``t``'s slot ``j`` is row ``t * k + j``). The exchanges themselves are collectives of the
collective schedule (:class:`fxpar.planning.collective_schedule.Exchange`), which the
lowering emits as calls of :mod:`fxpar.lowering.collective_calls` like every other
collective; this module holds what a device computes on its own around them:

- at the block's routing sort, :func:`expert_counts` counts this device's rows per expert;
  the counts travel by one fixed-size all-to-all
  (:func:`~fxpar.lowering.collective_calls.exchange_counts`), after which :func:`route`
  works out, once per block and step, where each of this device's rows goes (sorted stably
  by expert, the rows for device ``j``'s experts are consecutive) and what it receives: how
  many rows from each device and, since each device sends its rows sorted by expert, the
  expert of every one of them;
- a dispatch (:func:`dispatch`, :func:`dispatch_tokens`) puts the rows in the order they are
  sent, one variable-size all-to-all
  (:func:`~fxpar.lowering.collective_calls.exchange_rows`) sends them, and :func:`grouped`
  regroups what arrives by expert;
- a combine is its inverse: :func:`ungrouped` puts the rows computed here in the order they
  arrived, the same exchange with the splits reversed sends them back, and :func:`combine`
  (or :func:`combine_tokens`, summed per token) puts them back in slot order.

The backward reuses the forward's :class:`Route`: its dispatches and combines swap roles.

Sorting stably makes a device's received rows, regrouped by expert, exactly its experts'
block of the rows that a single device sorts stably by expert, tokens in batch order: the
grouped products see the same rows, only cut by device. No row is dropped and none padded.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from fxpar.lowering.collective_calls import RowSplits


@dataclass(frozen=True)
class Route:
    """Where one device's rows of a block go, and how what it receives is ordered."""

    order: torch.Tensor
    """This device's rows (slot order) sorted stably by expert: sent in this order."""
    send_counts: torch.Tensor
    """Rows sent to each device of the axis."""
    receive_counts: torch.Tensor
    """Rows received from each device of the axis."""
    splits: RowSplits
    """The two counts as the exchange of a dispatch takes them (a combine's: reversed)."""
    regroup: torch.Tensor
    """The received rows (by source device) sorted stably by expert."""
    expert_ids: torch.Tensor
    """The expert of each row this device computes, in its order (regrouped)."""
    offsets: torch.Tensor
    """Cumulative row counts of this device's experts over its rows (a grouped product's
    ``offs`` for its own experts)."""


def expert_counts(expert_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """This device's rows per expert, of the experts ``expert_ids`` (1-D, slot order) names:
    what the block's count exchange sends, device ``j`` the counts of its own experts."""
    return torch.bincount(expert_ids, minlength=num_experts)


def route(
    expert_ids: torch.Tensor,
    counts: torch.Tensor,
    received: torch.Tensor,
    piece: int,
    pieces: int,
    offsets_dtype: torch.dtype,
) -> Route:
    """The route of this device's rows, whose experts are ``expert_ids`` (1-D, slot order),
    to the ``pieces`` devices of the expert axis, each holding as many consecutive experts
    (this one piece ``piece``): ``counts`` are this device's rows per expert
    (:func:`expert_counts`) and ``received`` the counts of this device's experts every
    device sent, device by device (their exchange)."""
    per_device = counts.numel() // pieces
    order = torch.sort(expert_ids, stable=True).indices
    send_counts = counts.view(pieces, per_device).sum(1)
    by_source = received.view(pieces, per_device)
    receive_counts = by_source.sum(1)
    # Each device sends its rows sorted by expert, so what arrives from it is its rows for
    # this device's first expert, then its second, ...: the experts are known from the counts.
    mine = torch.arange(per_device, device=received.device) + piece * per_device
    received_ids = torch.repeat_interleave(mine.repeat(pieces), received)
    regroup = torch.sort(received_ids, stable=True).indices
    offsets = torch.cumsum(by_source.sum(0), 0).to(offsets_dtype)
    splits = RowSplits(tuple(send_counts.tolist()), tuple(receive_counts.tolist()))
    return Route(order, send_counts, receive_counts, splits, regroup, received_ids[regroup],
                 offsets)  # fmt: skip


def dispatch(route: Route, rows: torch.Tensor) -> torch.Tensor:
    """``rows`` (this device's, slot order on dim 0) in the order a dispatch sends them."""
    return rows[route.order]


def dispatch_tokens(route: Route, tokens: torch.Tensor, top_k: int) -> torch.Tensor:
    """Each of this device's ``tokens`` (one per ``top_k`` rows) in the order a dispatch sends
    its rows: row ``t * top_k + j`` is token ``t``."""
    return tokens[route.order // top_k]


def grouped(route: Route, received: torch.Tensor) -> torch.Tensor:
    """The rows a dispatch's exchange brought (by source device): the rows this device
    computes, grouped by expert."""
    return received[route.regroup]


def ungrouped(route: Route, rows: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`grouped`: rows this device computed (grouped by expert) in the
    order they arrived, as a combine's exchange sends them back."""
    back = torch.empty_like(rows)
    back[route.regroup] = rows
    return back


def combine(route: Route, returned: torch.Tensor) -> torch.Tensor:
    """The rows a combine's exchange brought back (in the order they were sent) in slot
    order: the inverse of :func:`dispatch`."""
    slots = torch.empty_like(returned)
    slots[route.order] = returned
    return slots


def combine_tokens(route: Route, returned: torch.Tensor, top_k: int) -> torch.Tensor:
    """:func:`combine`, then each token's ``top_k`` rows summed (the adjoint of
    :func:`dispatch_tokens`)."""
    slots = combine(route, returned)
    return slots.view(-1, top_k, *slots.shape[1:]).sum(1)


def route_splits(route: Route) -> RowSplits:
    """The splits of a dispatch's exchange."""
    return route.splits


def return_splits(route: Route) -> RowSplits:
    """The splits of a combine's exchange: a dispatch's, reversed."""
    return route.splits.back()


def route_offsets(route: Route) -> torch.Tensor:
    return route.offsets


def route_expert_ids(route: Route) -> torch.Tensor:
    return route.expert_ids


DISPATCH_CALLS = (route, dispatch, dispatch_tokens, combine, combine_tokens)
"""The calls that name a block's exchanges in a rank program: its route (made from the count
exchange), and each boundary's call on the slot-order side of its exchange (before a
dispatch's, after a combine's), named after the boundary's kind."""

DISPATCHES: dict[str, Callable[..., torch.Tensor]] = {
    "dispatch": dispatch,
    "dispatch_tokens": dispatch_tokens,
}
"""The call before each kind of dispatch's exchange; :func:`grouped` follows it."""

COMBINES: dict[str, Callable[..., torch.Tensor]] = {
    "combine": combine,
    "combine_tokens": combine_tokens,
}
"""The call after each kind of combine's exchange; :func:`ungrouped` precedes it."""
