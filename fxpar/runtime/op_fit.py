"""Fit a cluster's per-op speeds to timed ATen calls (:func:`fit_ops`).

A call of op ``o`` whose roofline time on the cluster is ``r`` is priced
``op_overhead + fixed(o) + slowdown(o) · r`` (:meth:`fxpar.Cluster.op_seconds`; a call that
does no work by the roofline, a view, only ``op_overhead``). The three numbers come from
:func:`~fxpar.runtime.op_timing.time_ops`'s timings of a program's calls:

- ``op_overhead`` is the lower quartile of the times of the calls that do no work: what any call
  costs to dispatch.
- Per op, the calls' time beyond the overhead summed over each timed step, against their count
  and their summed roofline. From one step, the slowdown is the one over the other and the
  fixed cost 0: one batch size cannot tell a call's fixed cost from its rate (a least-squares
  intercept over one step's calls is noise, and can come out negative), so the rate absorbs
  it, right at that size and too cheap at any smaller one. From steps at two or more batch
  sizes (the same step captured at a micro-batch's shapes, say), the fixed cost and the
  slowdown are the least-squares line through the steps' sums, which gives back each step's
  time of the op when there are two. On a CPU a compute call's fixed cost can be several times
  the overhead, so a pipeline of many micro-batches priced by one step's rates is priced well
  under what it takes.
- ``"*"``, which ops the timings did not see take, is fitted the same way over every op.

A call whose roofline is below :data:`TINY_CALL` of the overhead is left out of the sums (at
every size, when its node is so at one): its time is all the call itself, and a rate fitted to
it (a one-element ``ones_like`` takes a whole call's time, orders of magnitude beyond its
roofline) would price the op absurdly at any other size.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import replace

from fxpar.cluster import Cluster
from fxpar.planning.cost import roofline_seconds
from fxpar.runtime.op_timing import OpTiming

MIN_SLOWDOWN = 1e-3
"""The least slowdown an op is fitted: one whose calls all take no more than the overhead
(a copy that is a view in practice) costs about nothing beyond it."""
TINY_CALL = 0.01
"""A call whose roofline time is below this share of the op overhead fits no slowdown."""

_Sums = tuple[int, float, float]
"""Over one step's calls of an op: how many, their measured seconds, their roofline seconds."""


def fit_ops(cluster: Cluster, *steps: Sequence[OpTiming]) -> Cluster:
    """``cluster`` with ``op_overhead``, ``op_slowdown`` and ``op_fixed`` fitted to the timed
    calls of one or more ``steps`` (the module docstring): ``op_fixed`` is empty unless the
    steps ran calls of an op at two sizes."""
    every = [timing for step in steps for timing in step]
    # A cost naming no op is priced by the roofline alone, whatever the cluster's op speeds.
    rooflines = {id(t): roofline_seconds(replace(t.cost, op=""), cluster) for t in every}
    idle = sorted(t.seconds for t in every if rooflines[id(t)] == 0)
    overhead = idle[len(idle) // 4] if idle else 0.0
    # A node tiny at any size is left out at every size: each step's sums then hold the same
    # calls (a bias add that is tiny only at a quarter of the batch would bend the line).
    tiny = {t.node for t in every if rooflines[id(t)] < TINY_CALL * overhead}
    per_step: dict[str, list[_Sums]] = defaultdict(list)
    for step in steps:
        sums: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0.0])
        for timing in step:
            roofline = rooflines[id(timing)]
            if roofline == 0 or timing.node in tiny:
                continue
            for op in (timing.cost.op, Cluster.OTHER_OPS):
                sums[op][0] += 1
                sums[op][1] += timing.seconds - overhead
                sums[op][2] += roofline
        for op, (calls, beyond, roofline) in sums.items():
            per_step[op].append((int(calls), beyond, roofline))
    fitted = {op: fit_line(found) for op, found in per_step.items()}
    return replace(
        cluster,
        op_overhead=overhead,
        op_slowdown=tuple((op, slowdown) for op, (_, slowdown) in fitted.items()),
        op_fixed=tuple((op, fixed) for op, (fixed, _) in fitted.items() if fixed > 0),
    )


def fit_line(steps: Sequence[_Sums]) -> tuple[float, float]:
    """The fixed seconds a call and the slowdown that best give each step's seconds beyond the
    overhead from its calls and roofline (least squares; exact for two steps), the fixed cost
    at least 0 and the slowdown at least :data:`MIN_SLOWDOWN`. One step, or steps whose calls
    have the same mean roofline (the rate and the fixed cost are then one unknown): no fixed
    cost."""
    calls = sum(n for n, _, _ in steps)
    beyond = sum(y for _, y, _ in steps)
    roofline = sum(r for _, _, r in steps)
    alone = max(beyond, MIN_SLOWDOWN * roofline) / roofline
    nn = sum(n * n for n, _, _ in steps)
    nr = sum(n * r for n, _, r in steps)
    rr = sum(r * r for _, _, r in steps)
    determinant = nn * rr - nr * nr
    if len(steps) < 2 or determinant <= 1e-9 * nn * rr:
        return 0.0, alone
    ny = sum(n * y for n, y, _ in steps)
    ry = sum(r * y for _, y, r in steps)
    fixed = (ny * rr - nr * ry) / determinant
    slowdown = (nn * ry - nr * ny) / determinant
    if fixed <= 0:
        return 0.0, alone
    if slowdown < MIN_SLOWDOWN:
        return max(0.0, (beyond - MIN_SLOWDOWN * roofline) / calls), MIN_SLOWDOWN
    return fixed, slowdown
