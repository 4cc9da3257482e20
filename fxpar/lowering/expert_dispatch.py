"""The calls a rank program makes for a mixture-of-experts block whose tokens are dispatched
to their experts' devices by all-to-all (docs/expert_parallel.md, "Tokens dispatched").

Each device along the expert axis holds a slice of the tokens and ``E / n`` consecutive
experts. A block's rows are its (token, slot) pairs, ``k`` per token, in *slot order* (token
``t``'s slot ``j`` is row ``t * k + j``). :func:`route` works out once per block and step
where each of this device's rows goes: sorted stably by expert, the rows for device ``j``'s
experts are consecutive, and their counts are exchanged first (a fixed-size all-to-all) so
every device can size what it receives. :func:`dispatch` sends rows to their experts'
devices (one variable-size all-to-all) and regroups what arrives by expert; :func:`combine`
is its inverse, the same exchange with the counts reversed, back in slot order. The backward
reuses the forward's :class:`Route`: its dispatches and combines swap roles.

Sorting stably makes a device's received rows, regrouped by expert, exactly its experts'
block of the rows that a single device sorts stably by expert, tokens in batch order: the
grouped products see the same rows, only cut by device. No row is dropped and none padded.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fxpar.lowering.collective_calls import RowCommunicator, all_to_all_rows


@dataclass(frozen=True)
class Route:
    """Where one device's rows of a block go, and how what it receives is ordered."""

    order: torch.Tensor
    """This device's rows (slot order) sorted stably by expert: sent in this order."""
    send_counts: torch.Tensor
    """Rows sent to each device of the axis."""
    receive_counts: torch.Tensor
    """Rows received from each device of the axis."""
    regroup: torch.Tensor
    """The received rows (by source device) sorted stably by expert."""
    expert_ids: torch.Tensor
    """The expert of each row this device computes, in its order (regrouped)."""
    offsets: torch.Tensor
    """Cumulative row counts of this device's experts over its rows (a grouped product's
    ``offs`` for its own experts)."""


def route(
    comm: RowCommunicator,
    expert_ids: torch.Tensor,
    num_experts: int,
    piece: int,
    pieces: int,
    axis: int,
    offsets_dtype: torch.dtype,
) -> Route:
    """The route of this device's rows, whose experts are ``expert_ids`` (1-D, slot order), to
    the devices along ``axis``, each holding ``num_experts / pieces`` consecutive experts
    (this one piece ``piece``)."""
    per_device = num_experts // pieces
    order = torch.sort(expert_ids, stable=True).indices
    sent_ids = expert_ids[order]
    send_counts = torch.bincount(sent_ids // per_device, minlength=pieces)
    received_ids, receive_counts = all_to_all_rows(comm, sent_ids, send_counts, axis)
    regroup = torch.sort(received_ids, stable=True).indices
    mine = received_ids[regroup]
    counts = torch.bincount(mine - piece * per_device, minlength=per_device)
    offsets = torch.cumsum(counts, 0).to(offsets_dtype)
    return Route(order, send_counts, receive_counts, regroup, mine, offsets)


def dispatch(comm: RowCommunicator, route: Route, rows: torch.Tensor, axis: int) -> torch.Tensor:
    """``rows`` (this device's, slot order on dim 0) at their experts' devices: the rows this
    device computes, grouped by expert."""
    sent = rows[route.order]
    received = comm.all_to_all_rows(
        sent, route.send_counts.tolist(), route.receive_counts.tolist(), axis
    )
    return received[route.regroup]


def dispatch_tokens(
    comm: RowCommunicator, route: Route, tokens: torch.Tensor, top_k: int, axis: int
) -> torch.Tensor:
    """Each of this device's ``tokens`` (one per ``top_k`` rows) at the devices of its
    experts: row ``t * top_k + j`` is token ``t``."""
    sent = tokens[route.order // top_k]
    received = comm.all_to_all_rows(
        sent, route.send_counts.tolist(), route.receive_counts.tolist(), axis
    )
    return received[route.regroup]


def combine(comm: RowCommunicator, route: Route, rows: torch.Tensor, axis: int) -> torch.Tensor:
    """The inverse of :func:`dispatch`: rows this device computed (grouped by expert) back on
    the devices they came from, in slot order."""
    back = torch.empty_like(rows)
    back[route.regroup] = rows
    returned = comm.all_to_all_rows(
        back, route.receive_counts.tolist(), route.send_counts.tolist(), axis
    )
    slots = torch.empty_like(returned)
    slots[route.order] = returned
    return slots


def combine_tokens(
    comm: RowCommunicator, route: Route, rows: torch.Tensor, top_k: int, axis: int
) -> torch.Tensor:
    """:func:`combine`, then each token's ``top_k`` rows summed (the adjoint of
    :func:`dispatch_tokens`)."""
    slots = combine(comm, route, rows, axis)
    return slots.view(-1, top_k, *slots.shape[1:]).sum(1)


def route_offsets(route: Route) -> torch.Tensor:
    return route.offsets


def route_expert_ids(route: Route) -> torch.Tensor:
    return route.expert_ids


DISPATCH_CALLS = (route, dispatch, dispatch_tokens, combine, combine_tokens)
"""The calls of this module that exchange rows (each one or two all-to-alls)."""
