"""Calibration: fit a Cluster's link and device numbers to the processes that run the step.

:func:`calibrate` runs collectively on every rank of an initialized ``torch.distributed`` job
whose world is the cluster's mesh, and returns the cluster with ``latency``, ``bandwidth``,
``flops`` and ``memory_bandwidth`` replaced by what these processes achieve (mesh shape, axis
names, device type and memory stay as given)::

    cluster = fxpar.calibrate(fxpar.Cluster.preset("cpu", (2,)))  # on every rank
    cluster.save("cluster.json")  # fxpar plan --cluster-file cluster.json, Cluster.load(...)

What it times (:class:`CalibrationOptions` sets the sizes and repeats):

- On each mesh axis of more than one device, an all-reduce of one element, one of
  ``check_bytes`` and one of ``large_bytes``, on every process group of the axis at once, as a
  step runs them. They fix the lines of the cost model's all-reduce, ``α + 2(n−1)/n·B/β``
  (:func:`fxpar.planning.cost.collective_seconds`), of which a collective pays the lowest: those
  of the points' upper hull (:func:`fxpar.runtime.link_fit.upper_lines`, which says why), so the
  model gives back every time on the hull and the others no lower than measured. The large
  collectives' line is the axis' ``α`` and ``β``; where there is a second line, for small ones,
  both are the all-reduce's own links on the axis. An axis of one device
  has no collective to time and keeps its numbers.
- On the same axes, the one-element all-reduce again, each run after a stretch of compute on
  every rank (:attr:`CalibrationOptions.compute_before`), as a step reaches its collectives:
  what it takes beyond the run started after a barrier is the *wait* for the last peer, which
  on a machine with more ranks than cores every collective of a step pays (the ranks leave a
  stretch of compute apart). It is added to the latency of every kind of collective on the
  axis; the model then gives back the fitted times plus the wait.
- On the same axes, an all-gather, a reduce-scatter and an all-to-all of one element per device,
  of ``check_bytes`` and of ``large_bytes`` (each rounded to whole elements per device),
  through the runtime's own :class:`~fxpar.runtime.communicators.ProcessGroupCommunicator`,
  each kind fitted a line of its own (:class:`~fxpar.cluster.CollectiveLink`): gloo runs them
  at speeds of their own (``CalibrationOptions.each_kind`` turns this off). So is a send of the
  same sizes from each rank of the first half of the axis to one of the second, as pipeline
  stages pass activations: its lines take no wait for the last peer (a send waits for one,
  where the pipeline's schedule prices it), and the stage model prices its sends with them.
- On the same axes, the ``large_bytes`` all-reduce once more beside as many of those products
  as take about as long (:attr:`CalibrationOptions.overlap`): started, the products run, then
  waited for, as the programs run an all-reduce started where its value is made. With ``c``
  the products' time alone, ``a`` the all-reduce's and ``b`` both together, the share of the
  shorter one that ran hidden, ``(c + a − b) / min(c, a)`` (clipped to 0..1, the least over
  the axes and ranks), is the cluster's :attr:`~fxpar.cluster.Cluster.overlap`: near 1 where
  collectives run on engines of their own, near 0 where they take the cores the products need.
- A ``matmul_size``-cubed matrix product in ``dtype`` (``2·size³`` FLOPs over its time gives
  ``flops``) and a copy of ``copy_bytes`` (it reads and writes them: ``2·copy_bytes`` over its
  time gives ``memory_bandwidth``), the two roofline terms of
  :func:`fxpar.planning.cost.roofline_seconds`. Every rank computes at once, so on a machine
  shared by several ranks each device's share of it is what is measured. On a CUDA cluster
  they run on this rank's GPU (:func:`fxpar.runtime.devices.rank_device`), each run waited
  for, with the GPU's defaults (:meth:`CalibrationOptions.for_device`: bfloat16, 8192-square
  matrices, a 1 GiB copy).
- On CPU, where the world's threads outnumber this host's cores, a short and a long stretch of
  products on half the ranks while the others wait, and on all at once: how much faster the
  half computes once the scheduler has handed it the idle cores is the cluster's
  :attr:`~fxpar.cluster.Cluster.core_demand`, and how long that takes its ``core_delay``; and
  how much longer a collective
  waits for its last peer after a long stretch of compute than after the wait's short one:
  ``lag_share`` (:mod:`fxpar.runtime.core_sharing`).

Each operation runs ``warmup`` times untimed, then ``repeats`` times. A collective starts each
run after a barrier of its own process group (the wait's all-reduce after compute too); local
work runs back to back, every rank at once, as in a step
(:func:`fxpar.runtime.calibration_runs.typical_seconds` says why). A rank keeps the lower
quartile of a collective's times (:attr:`CalibrationOptions.quantile`), the mean of the wait's
and the mean of its local work's, and the slowest rank's (one all-reduce MAX) is the time every
rank fits: every rank returns the same Cluster. A kind of collective whose small runs all came
out no faster than its large one (a noisy stretch) is timed again, up to
:attr:`CalibrationOptions.attempts` times. With the defaults calibration takes a few seconds on
local CPU processes.

Why a function and not a ``Cluster`` method: :mod:`fxpar.cluster` is a leaf that the cost model
imports, and calibration needs the cost model's formulas (so that the fitted numbers give back
the measured times) and torch.distributed; a method would make the cluster import the cost
model, a cycle.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from fxpar import ir
from fxpar.cluster import COLLECTIVE_KINDS, Cluster, CollectiveLink
from fxpar.errors import DistributedError, FxparError
from fxpar.ir.program import Program
from fxpar.planning.cost import link_seconds, roofline_seconds
from fxpar.runtime import core_sharing
from fxpar.runtime.calibration_runs import (
    ALL_REDUCE,
    COPY,
    MATMUL,
    OWN_LINKS,
    SEND,
    runner,
    typical_seconds,
)
from fxpar.runtime.communicators import ProcessGroupCommunicator
from fxpar.runtime.devices import for_collective, rank_device, synchronize
from fxpar.runtime.link_fit import Line, upper_lines
from fxpar.runtime.op_fit import fit_ops
from fxpar.runtime.op_timing import OpTiming, time_ops
from fxpar.runtime.text_table import columns, rate_text, seconds_text

logger = logging.getLogger(__name__)

MicroStep = tuple[Program, Sequence[object]] | None
"""A step captured at a smaller batch and its flat inputs (``microbatch=``), or none."""


@dataclass(frozen=True)
class CalibrationOptions:
    """What :func:`calibrate` times, and how often."""

    large_bytes: int = 4 * 2**20
    """The all-reduce whose time fits each axis' bandwidth."""
    check_bytes: int = 256 * 2**10
    """The middle size of each collective: between the one element and ``large_bytes``."""
    matmul_size: int = 512
    """The product of two square matrices of this size fits ``flops``."""
    copy_bytes: int = 32 * 2**20
    """The copy that fits ``memory_bandwidth``."""
    dtype: torch.dtype = torch.float32
    """The element type of every tensor timed: the one training computes in."""
    each_kind: bool = True
    """Also time all-gathers, reduce-scatters, all-to-alls and sends (of one element per
    device, ``check_bytes`` and ``large_bytes``) and fit each its own lines on every axis
    (:class:`~fxpar.cluster.CollectiveLink`); without, they take the all-reduce's."""
    warmup: int = 2
    repeats: int = 15
    local_seconds: float = 0.25
    """Local work (the matmul, the copy) runs at least this long, and its time is the mean:
    long enough to span many scheduler slices on a machine with fewer cores than ranks."""
    op_passes: int = 5
    """Timed steps of a program given to :func:`calibrate` (or :func:`calibrate_ops`): each op
    call takes the median of its times in them (:func:`~fxpar.runtime.op_timing.time_ops`)."""
    op_rounds: int = 3
    """With a smaller step beside the program (``microbatch=``), how many times the two are
    timed in turn; each call takes its median over the rounds."""
    compute_before: int = 1
    """Products of two ``matmul_size``-square matrices every rank computes before each run of
    the all-reduce that measures an axis' wait (the module docstring); 0 measures none."""
    idle_seconds: float = 0.008
    """How long the short one of the stretches of compute that measure the cluster's
    ``core_demand`` and ``core_delay`` on CPU takes with every rank computing (the long one
    four times as long): about a pipeline stage's forward or backward
    (:func:`~fxpar.runtime.core_sharing.measure_core_sharing`); 0 counts the demand
    instead."""
    idle_repeats: int = 60
    """How many runs of the short stretch (each with every rank computing, then with half)
    the core sharing takes means over, a quarter as many of the long: a stretch of a few
    milliseconds gets its share of a core in scheduler slices of about that length, so one
    run's speed swings widely, and a mean over a few runs moves from one calibration to the
    next; a mean over dozens moves much less, at a cost of a few seconds."""
    drift_seconds: float = 0.1
    """How long the stretch of compute that measures the cluster's ``lag_share`` on CPU takes
    (:func:`~fxpar.runtime.core_sharing.measure_lag`); 0 measures none."""
    overlap: bool = True
    """Also measure how much of an all-reduce compute running beside it hides (the module
    docstring), and set the cluster's :attr:`~fxpar.cluster.Cluster.overlap` to it."""
    attempts: int = 3
    """How many times a collective's points are timed at most: where no line of a positive
    latency and bandwidth goes through them (a noisy stretch made the small one slower than
    the large), they are timed again (:func:`retime_lineless`)."""
    quantile: float = 0.25
    """Which of a rank's ``repeats`` times of a collective started after a barrier it keeps
    (the runs after compute keep their mean, the wait a step pays): 0.5 the median, 0 the
    fastest. On a busy
    machine (other programs, or more processes than cores) a collective's time is bimodal,
    the transfer itself or the transfer plus a scheduler slice (milliseconds) for a peer that
    was not running; the median flips between the two from one calibration to the next, while
    the lower quartile holds unless most runs stall."""

    @staticmethod
    def for_device(device_type: str) -> CalibrationOptions:
        """The defaults for ``device_type``'s devices: on a GPU, a bfloat16 product of 8192-
        square matrices and a copy of 1 GiB (small ones time the launch, not the device),
        and all-reduces up to 64 MiB."""
        if device_type == "cuda":
            return CalibrationOptions(
                large_bytes=64 * 2**20, check_bytes=4 * 2**20, matmul_size=8192,
                copy_bytes=2**30, dtype=torch.bfloat16, warmup=3, repeats=20,
            )  # fmt: skip
        return CalibrationOptions()

    def __post_init__(self) -> None:
        itemsize = self.dtype.itemsize
        sizes = {
            "large_bytes": self.large_bytes,
            "check_bytes": self.check_bytes,
            "copy_bytes": self.copy_bytes,
        }
        for name, size in sizes.items():
            if size < itemsize:
                raise FxparError(f"{name}={size} holds not even one {self.dtype} element")
        if not self.check_bytes < self.large_bytes:
            raise FxparError(
                f"check_bytes={self.check_bytes} must be below large_bytes={self.large_bytes}: "
                "it is the middle size of each collective's fitted line"
            )
        if self.local_seconds < 0:
            raise FxparError(f"local_seconds must be >= 0, got {self.local_seconds}")
        if self.op_passes < 1:
            raise FxparError(f"op_passes must be >= 1, got {self.op_passes}")
        if self.op_rounds < 1:
            raise FxparError(f"op_rounds must be >= 1, got {self.op_rounds}")
        if self.matmul_size < 1 or self.warmup < 0 or min(self.repeats, self.idle_repeats) < 1:
            raise FxparError(
                "need matmul_size >= 1, warmup >= 0, repeats >= 1 and idle_repeats >= 1, got "
                f"{self.matmul_size}, {self.warmup}, {self.repeats} and {self.idle_repeats}"
            )
        if self.attempts < 1:
            raise FxparError(f"attempts must be >= 1, got {self.attempts}")
        if self.compute_before < 0:
            raise FxparError(f"compute_before must be >= 0, got {self.compute_before}")
        if not (self.idle_seconds >= 0 and self.drift_seconds >= 0):
            raise FxparError(
                "idle_seconds and drift_seconds must be >= 0, got "
                f"{self.idle_seconds} and {self.drift_seconds}"
            )
        if not 0 <= self.quantile <= 1:
            raise FxparError(f"quantile must lie in [0, 1], got {self.quantile}")


@dataclass(frozen=True)
class Timing:
    """One operation calibration timed, and the slowest rank's time for it."""

    operation: str
    """A collective (``all_reduce``, ``all_gather``, ``reduce_scatter``, ``all_to_all``),
    ``matmul`` or ``copy``."""
    nbytes: int
    """A collective's local tensor before it (as the cost model counts it); for a matmul or a
    copy, the bytes it reads and writes (as the roofline counts them)."""
    seconds: float
    axis: int | None = None
    """The mesh axis of a collective."""
    flops: int = 0
    after_compute: bool = False
    """Timed after a stretch of compute on every rank: the all-reduce that measures the
    axis' wait for the last peer."""

    def model_seconds(self, cluster: Cluster) -> float:
        """What the cost model says this operation takes on ``cluster``."""
        if self.axis is not None:
            return link_seconds(self.operation, self.nbytes, self.axis, cluster)
        work = ir.Cost(flops=self.flops, bytes_read=self.nbytes, bytes_written=0, output_bytes=0)
        return roofline_seconds(work, cluster)

    def label(self, cluster: Cluster) -> str:
        if self.axis is None:
            return self.operation
        role = "wait" if self.after_compute else "fit"
        kind = self.operation.replace("_", "-")
        return f"{kind} on {cluster.axis_names[self.axis]} ({role})"


@dataclass(frozen=True)
class Calibration:
    """What :func:`measure` timed, the cluster it was given and the cluster fitted to it."""

    given: Cluster
    cluster: Cluster
    timings: tuple[Timing, ...]
    ops: tuple[OpTiming, ...] = ()
    """The program's ops, when one was given: each node's op and the ranks' mean time, scaled
    to the slowest rank's step."""

    def table(self, given: str = "given") -> str:
        """The fitted fields beside the given ones (a column headed ``given``), then every
        timing beside the fitted model's time for it."""
        clusters = (self.given, self.cluster)
        fields: list[tuple[str, ...]] = [("field", given, "calibrated")]
        for axis, name in enumerate(self.cluster.axis_names):
            fields.append((f"latency {name}", *(seconds_text(c.latency[axis]) for c in clusters)))
            fields.append(
                (f"bandwidth {name}", *(rate_text(c.bandwidth[axis], "B/s") for c in clusters))
            )
            fields.append(
                (f"peer wait {name}", *(seconds_text(c.peer_wait[axis]) for c in clusters))
            )
        for link in self.cluster.collective_links:
            name = f"{link.kind} {self.cluster.axis_names[link.axis]}"
            lines = self.cluster.lines_of(link.kind, link.axis)
            if len(lines) > 1:  # a kind's lines, from small collectives' to large ones'
                name += f" ({lines.index((link.bandwidth, link.latency)) + 1}/{len(lines)})"
            fields.append((f"latency {name}", "-", seconds_text(link.latency)))
            fields.append((f"bandwidth {name}", "-", rate_text(link.bandwidth, "B/s")))
        fields.append(("flops", *(rate_text(c.flops, "FLOP/s") for c in clusters)))
        fields.append(
            ("memory_bandwidth", *(rate_text(c.memory_bandwidth, "B/s") for c in clusters))
        )
        fields.append(("hidden share", *(f"{c.hidden_share:.2f}" for c in clusters)))
        demands = (
            "-"
            if c.core_demand is None
            else f"{c.core_demand:.2f} after {seconds_text(c.core_delay)}"
            for c in clusters
        )
        fields.append(("core demand", *demands))
        lags = (f"{c.lag_share:.3f} after {seconds_text(c.lag_stretch)}" for c in clusters)
        fields.append(("lag share", *lags))
        timings: list[tuple[str, ...]] = [("operation", "bytes", "measured", "model")]
        for timing in self.timings:
            measured, model = timing.seconds, timing.model_seconds(self.cluster)
            timings.append(
                (
                    timing.label(self.cluster),
                    rate_text(timing.nbytes, "B"),
                    seconds_text(measured),
                    seconds_text(model),
                )
            )
        tables = [columns(fields), columns(timings)]
        if self.ops:
            tables.append(columns(self._op_rows()))
        return "\n\n".join(tables)

    def _op_rows(self) -> list[tuple[str, ...]]:
        """Per op of the program, its calls, their summed measured time and the fitted model's
        (the overhead and the slowdown's roofline), the slowest first."""
        totals: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0.0])
        for timing in self.ops:
            row = totals[timing.cost.op]
            row[0] += 1
            row[1] += timing.seconds
            row[2] += roofline_seconds(timing.cost, self.cluster)
        slowdowns = dict(self.cluster.op_slowdown)
        rows: list[tuple[str, ...]] = [("op", "calls", "measured", "model", "slowdown")]
        for op, (calls, measured, model) in sorted(totals.items(), key=lambda kv: -kv[1][1]):
            slowdown = slowdowns.get(op)
            rows.append((op, str(int(calls)), seconds_text(measured), seconds_text(model),
                         "-" if slowdown is None else f"{slowdown:.2f}"))  # fmt: skip
        return rows


def calibrate(
    cluster: Cluster,
    device_mesh: DeviceMesh | None = None,
    options: CalibrationOptions | None = None,
    *,
    program: Program | None = None,
    inputs: Sequence[object] = (),
    microbatch: MicroStep = None,
) -> Cluster:
    """``cluster`` with its links and devices measured on the processes of this job.

    Call it on every rank, like a collective. ``device_mesh`` defaults to
    ``cluster.device_mesh()``; :func:`measure` says what is timed and keeps the timings.
    Given a ``program`` (:func:`fxpar.capture`'s) and its real flat ``inputs``
    (:meth:`~fxpar.Program.flat_inputs`), every ATen op of its step is timed too, on the
    shapes and values of that step, and the cluster's ``op_overhead`` and ``op_slowdown`` are
    fitted to them (:func:`fit_ops`); ``microbatch`` as :func:`calibrate_ops` takes it.

    Raises:
        DistributedError: torch.distributed is not initialized, its world is not the mesh's,
            or ``device_mesh`` has another shape.
    """
    return measure(
        cluster, device_mesh, options, program=program, inputs=inputs, microbatch=microbatch
    ).cluster


def measure(
    cluster: Cluster,
    device_mesh: DeviceMesh | None = None,
    options: CalibrationOptions | None = None,
    *,
    program: Program | None = None,
    inputs: Sequence[object] = (),
    microbatch: MicroStep = None,
) -> Calibration:
    """:func:`calibrate`, keeping what was timed and the cluster it was given."""
    options = options or CalibrationOptions.for_device(cluster.device_type)
    device = rank_device(cluster.device_type)
    cluster.check_process_group()
    if device_mesh is None:
        device_mesh = cluster.device_mesh()
    elif tuple(device_mesh.shape) != cluster.mesh_shape:
        raise DistributedError(
            f"the device mesh has shape {tuple(device_mesh.shape)} but the cluster's mesh is "
            f"{cluster.mesh_shape}: pass cluster.device_mesh(), or none"
        )
    start = time.perf_counter()
    communicator = ProcessGroupCommunicator(device_mesh)

    def time_each(planned: Sequence[Timing]) -> list[Timing]:
        kept = []
        for timing in planned:
            group = None if timing.axis is None else device_mesh.get_group(timing.axis)
            run = runner(timing, communicator, group, options, device)
            kept.append(typical_seconds(run, group, options, device, timing.after_compute))
        slowest = torch.tensor(kept, dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        return [
            replace(timing, seconds=seconds)
            for timing, seconds in zip(planned, slowest.tolist(), strict=True)
        ]

    timings = tuple(
        retime_lineless(cluster, time_each(_planned_timings(cluster, options)), time_each,
                        options.attempts)
    )  # fmt: skip
    fitted = fit(cluster, timings)
    if device.type == "cpu":
        fitted = replace(fitted, **core_sharing.measure(options))
    if options.overlap:
        share = _overlap(fitted, device_mesh, communicator, options, device, timings)
        if share is not None:
            fitted = replace(fitted, overlap=share)
    ops: tuple[OpTiming, ...] = ()
    if program is not None:
        timed = _timed_steps(program, inputs, microbatch, options, device)
        ops = timed[0]
        fitted = fit_ops(fitted, *timed)
    logger.info("calibrated %s in %.2f s", cluster, time.perf_counter() - start)
    return Calibration(cluster, fitted, timings, ops)


def calibrate_ops(
    cluster: Cluster,
    program: Program,
    inputs: Sequence[object],
    options: CalibrationOptions | None = None,
    *,
    microbatch: MicroStep = None,
) -> Cluster:
    """``cluster`` with its ``op_overhead`` and ``op_slowdown`` fitted to ``program``'s ops
    timed on its flat ``inputs`` (:func:`fit_ops`), its links and rooflines kept: after
    :func:`calibrate`, to fit the ops of each model apart. Call it on every rank at once.

    ``microbatch``, the same step captured at a smaller batch and its flat inputs (such as
    :func:`fxpar.pipeline.microbatch_step` gives), is timed too, and each op's calls are
    then fitted a fixed cost apart from their rate (``op_fixed``): what a call costs whatever its
    size, which a pipeline of small micro-batches, or a plan that splits the batch over many
    devices, pays in every call (:mod:`fxpar.runtime.op_fit`).

    Raises:
        DistributedError: torch.distributed is not initialized, or the ranks' programs
            differ in their number of ops.
    """
    if not dist.is_initialized():
        raise DistributedError("calibrate_ops runs on every rank: initialize torch.distributed")
    options = options or CalibrationOptions.for_device(cluster.device_type)
    device = rank_device(cluster.device_type)
    return fit_ops(cluster, *_timed_steps(program, inputs, microbatch, options, device))


def _timed_steps(
    program: Program,
    inputs: Sequence[object],
    microbatch: MicroStep,
    options: CalibrationOptions,
    device: torch.device,
) -> list[tuple[OpTiming, ...]]:
    """The ops of ``program`` and of the ``microbatch`` step, if any, timed
    (:func:`_mean_ops`). Two steps are timed in turn,
    :attr:`CalibrationOptions.op_rounds` times, and each call takes its median over the rounds:
    a shared or virtual machine's speed can drift by tens of percent over a minute, and steps
    timed one after the other would fit that drift, not their difference in size, as the ops'
    fixed costs (or fit none); timed in turn, both steps see the same drift."""
    steps = [(program, inputs), *([microbatch] if microbatch is not None else [])]
    rounds = 1 if len(steps) == 1 else options.op_rounds
    timed = [[_mean_ops(program, inputs, options, device) for program, inputs in steps]
             for _ in range(rounds)]  # fmt: skip
    return [
        tuple(
            replace(call, seconds=statistics.median(run[index][at].seconds for run in timed))
            for at, call in enumerate(timed[0][index])
        )
        for index in range(len(steps))
    ]


def _mean_ops(
    program: Program, inputs: Sequence[object], options: CalibrationOptions, device: torch.device
) -> tuple[OpTiming, ...]:
    """Every rank times ``program``'s ops at once (:func:`~fxpar.runtime.op_timing.time_ops`),
    and each op takes the ranks' mean time, scaled so that the ops add up to the slowest rank's
    step: the ranks run the same ops in a step, sharing the machine as they do here, and a step
    waits for its slowest rank. (The slowest rank's time of each op would add every op's worst
    noise; the mean alone misses that on a machine with fewer cores than ranks, a rank that is
    done runs no more, and the last ones time their ops with the machine to themselves.)"""
    dist.barrier()
    return shared_op_times(time_ops(program, inputs, passes=options.op_passes, device=device))


def shared_op_times(mine: Sequence[OpTiming]) -> tuple[OpTiming, ...]:
    """This rank's op timings made the same on every rank (see :func:`_mean_ops`): each op's
    mean over the ranks, scaled so that they add up to the largest rank's sum."""
    counts = torch.tensor([len(mine), -len(mine)], dtype=torch.int64)
    dist.all_reduce(counts, op=dist.ReduceOp.MAX)
    if counts[0] != -counts[1]:
        raise DistributedError(
            f"the ranks timed between {-counts[1]} and {counts[0]} ops: calibrate every rank "
            "on the same program"
        )
    summed = torch.tensor([timing.seconds for timing in mine], dtype=torch.float64)
    dist.all_reduce(summed)
    mean = summed / dist.get_world_size()
    slowest = torch.tensor([sum(timing.seconds for timing in mine)], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    if mean.sum() > 0:
        mean *= slowest / mean.sum()
    return tuple(replace(t, seconds=s) for t, s in zip(mine, mean.tolist(), strict=True))


def _overlap(
    cluster: Cluster,
    device_mesh: DeviceMesh,
    communicator: ProcessGroupCommunicator,
    options: CalibrationOptions,
    device: torch.device,
    timings: Sequence[Timing],
) -> float | None:
    """The share of an all-reduce that products running beside it hide (the module docstring),
    the least over the mesh's axes and over the ranks; None on a mesh without collectives.
    ``timings`` are the slowest rank's, the same on every rank: every rank runs as many
    products."""
    matmul = next(t.seconds for t in timings if t.operation == MATMUL)
    size, dtype = options.matmul_size, options.dtype
    left = torch.randn(size, size, dtype=dtype, device=device)
    product = torch.empty_like(left)
    shares = []
    for axis, devices in enumerate(cluster.mesh_shape):
        if devices == 1:
            continue
        large = max(
            (t for t in timings if t.axis == axis and t.operation == ALL_REDUCE),
            key=lambda t: t.nbytes,
        )
        products = max(1, round(large.seconds / matmul))
        group = device_mesh.get_group(axis)
        zeros = torch.zeros(large.nbytes // dtype.itemsize, dtype=dtype, device=device)
        buffer = for_collective(zeros, group)

        def compute(products: int = products) -> None:
            for _ in range(products):
                torch.mm(left, left, out=product)

        def alone(axis: int = axis, buffer: torch.Tensor = buffer) -> None:
            communicator.start_all_reduce(buffer, axis).wait()

        def both(axis: int = axis, buffer: torch.Tensor = buffer) -> None:
            pending = communicator.start_all_reduce(buffer, axis)
            compute()
            pending.wait()

        runs: dict[str, list[float]] = defaultdict(list)
        for repeat in range(options.warmup + options.repeats):
            for name, run in (("compute", compute), ("collective", alone), ("both", both)):
                dist.barrier(group=group)
                start = time.perf_counter()
                run()
                synchronize(device)
                if repeat >= options.warmup:
                    runs[name].append(time.perf_counter() - start)
        c, a, b = (sum(runs[name]) / len(runs[name]) for name in ("compute", "collective", "both"))
        shares.append(min(max((c + a - b) / min(c, a), 0.0), 1.0))
    if not shares:
        return None
    least = torch.tensor([min(shares)], dtype=torch.float64)
    dist.all_reduce(least, op=dist.ReduceOp.MIN)
    return float(least.item())


def fit(cluster: Cluster, timings: Sequence[Timing]) -> Cluster:
    """``cluster`` with the fields that ``timings`` measure fitted to them (see the module's
    docstring); other fields, and the links of axes without timings, as they were. A kind of
    collective timed apart from the all-reduce gets its own link on that axis
    (:class:`~fxpar.cluster.CollectiveLink`)."""
    latency, bandwidth = list(cluster.latency), list(cluster.bandwidth)
    peer_wait = list(cluster.peer_wait)
    links: dict[tuple[str, int], list[CollectiveLink]] = defaultdict(list)
    for link in cluster.collective_links:
        links[link.kind, link.axis].append(link)
    for axis, kind, _, points, lines in _lines(cluster, timings):
        if not lines:
            (small_bytes, small_s), (large_bytes, large_s) = points[0], points[-1]
            raise FxparError(
                f"on mesh axis {cluster.axis_names[axis]}, {kind.replace('_', '-')}s of "
                f"{small_bytes} and {large_bytes} bytes took {small_s * 1e6:.0f} and "
                f"{large_s * 1e6:.0f} us: no line of a positive latency and bandwidth goes "
                "through both (the machine is too noisy for these sizes); calibrate again "
                "with a larger CalibrationOptions.large_bytes or more attempts"
            )
        peer_wait[axis] = wait_seconds(timings, axis)
        # A send waits for one peer, at a point the pipeline's schedule prices: no wait for the
        # last of the axis' peers.
        wait = peer_wait[axis] if kind != SEND else 0.0
        own = [CollectiveLink(kind, axis, alpha + wait, beta) for alpha, beta in lines]
        if kind == ALL_REDUCE:  # the axis' own line is the large collectives' one
            latency[axis], bandwidth[axis] = own[-1].latency, own[-1].bandwidth
            own = own if len(own) > 1 else []
        links[kind, axis] = own
    # A kind's links that the timings did not fit again (each_kind off on a calibrated
    # cluster) keep their latency, which may hold less than the new wait: the wait a
    # collective skips after little compute is no more than its latency.
    for (kind, axis), kept in links.items():
        for link in kept if kind != SEND else ():
            peer_wait[axis] = min(peer_wait[axis], link.latency)
    flops, memory_bandwidth = cluster.flops, cluster.memory_bandwidth
    for timing in timings:
        if timing.operation == MATMUL:
            flops = timing.flops / timing.seconds
        elif timing.operation == COPY:
            memory_bandwidth = timing.nbytes / timing.seconds
    return replace(
        cluster,
        latency=tuple(latency),
        bandwidth=tuple(bandwidth),
        peer_wait=tuple(peer_wait),
        flops=flops,
        memory_bandwidth=memory_bandwidth,
        collective_links=tuple(
            link
            for key in sorted(links, key=lambda k: (k[1], COLLECTIVE_KINDS.index(k[0])))
            for link in links[key]
        ),
    )


def wait_seconds(timings: Sequence[Timing], axis: int) -> float:
    """The wait for the last peer that calibration added to every collective's latency on
    ``axis`` (0 where it timed none)."""
    return _wait([t for t in timings if t.axis == axis])


def _wait(on_axis: Sequence[Timing]) -> float:
    """What the all-reduce after compute took beyond the same one after a barrier (never
    below 0: on a quiet machine with a core per rank the two are the same but for noise)."""
    after = [t for t in on_axis if t.after_compute]
    if not after:
        return 0.0
    (timed,) = after
    barrier = [
        t.seconds
        for t in on_axis
        if t.operation == timed.operation and t.nbytes == timed.nbytes and not t.after_compute
    ]
    return max(timed.seconds - min(barrier), 0.0)


def _fits(timing: Timing, kind: str) -> bool:
    """Whether ``timing`` is a point of the line fitted to ``kind`` on its axis."""
    return timing.operation == kind and not timing.after_compute


def retime_lineless(
    cluster: Cluster,
    timings: Sequence[Timing],
    time_again: Callable[[Sequence[Timing]], Sequence[Timing]],
    attempts: int,
) -> list[Timing]:
    """``timings`` with the points of every line :func:`fit` would find none through timed
    again by ``time_again`` (all of a kind's points on an axis at once), until each such line
    exists or ``attempts`` timings in all were made.

    On a machine running more processes than it has cores, a stretch in which most runs of the
    one-element collective wait a scheduler slice for a peer makes it slower than the large one;
    the next stretch is usually quiet. Every rank sees the same (slowest rank's) times, so all
    of them time the same points again."""
    timings = list(timings)
    for _ in range(attempts - 1):
        lineless = _lineless(cluster, timings)
        if not lineless:
            break
        logger.warning("calibration: no line through %d collective times; timing them again",
                       len(lineless))  # fmt: skip
        again = time_again([timings[i] for i in lineless])
        for i, timing in zip(lineless, again, strict=True):
            timings[i] = timing
    return timings


def _lineless(cluster: Cluster, timings: Sequence[Timing]) -> list[int]:
    """The indices of the points of every (axis, kind) line :func:`fit` finds none through."""
    return sorted(i for *_, indices, _, lines in _lines(cluster, timings) if not lines
                  for i in indices)  # fmt: skip


def _lines(
    cluster: Cluster, timings: Sequence[Timing]
) -> Iterator[tuple[int, str, list[int], list[tuple[int, float]], list[Line]]]:
    """For each mesh axis and kind of collective with points in ``timings``: the axis, the
    kind, the points' indices, the points as sorted (bytes, seconds), and the lines fitted to
    them (:func:`~fxpar.runtime.link_fit.upper_lines`; empty where there is none)."""
    for axis, devices in enumerate(cluster.mesh_shape):
        for kind in (ALL_REDUCE, *OWN_LINKS):
            indices = [i for i, t in enumerate(timings) if t.axis == axis and _fits(t, kind)]
            if not indices:
                continue
            points = sorted((timings[i].nbytes, timings[i].seconds) for i in indices)
            yield axis, kind, indices, points, upper_lines(kind, devices, points)


def _planned_timings(cluster: Cluster, options: CalibrationOptions) -> list[Timing]:
    """What to time, in the order every rank times it (seconds still 0)."""
    itemsize = options.dtype.itemsize
    middle_large = (options.check_bytes, options.large_bytes)
    planned = []
    for axis, devices in enumerate(cluster.mesh_shape):
        if devices == 1:
            continue
        for nbytes in (itemsize, *middle_large):
            whole = nbytes // itemsize * itemsize
            planned.append(Timing(ALL_REDUCE, whole, 0.0, axis=axis))
        if options.compute_before:
            planned.append(Timing(ALL_REDUCE, itemsize, 0.0, axis=axis, after_compute=True))
        if options.each_kind:
            # One element per device, check_bytes and large_bytes: sizes every kind splits evenly.
            step = devices * itemsize
            for kind in OWN_LINKS:
                for nbytes in (step, *(max(size // step, 1) * step for size in middle_large)):
                    planned.append(Timing(kind, nbytes, 0.0, axis=axis))
    size = options.matmul_size
    planned.append(Timing(MATMUL, 3 * size * size * itemsize, 0.0, flops=2 * size**3))
    copied = options.copy_bytes // itemsize * itemsize
    planned.append(Timing(COPY, 2 * copied, 0.0))  # read once, written once
    return planned
