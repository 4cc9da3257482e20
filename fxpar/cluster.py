"""The cluster: a logical N-D mesh of devices.

A :class:`Cluster` names the shape of the device mesh the step is split over (``(4,)``, ``(2, 2)``,
``(2, 4)``) and its axis names. Under ``torch.distributed`` it builds the matching
:class:`~torch.distributed.device_mesh.DeviceMesh`, whose per-axis process groups carry the
collectives of the per-rank programs.
"""

from __future__ import annotations

import functools
import itertools
import json
import math
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from fxpar.errors import DistributedError, FxparError

Coordinate = tuple[int, ...]


GiB = 2**30
CLUSTER_FORMAT = "fxpar-cluster"

# (bandwidth in bytes/s per device, latency in s) inside a node and between nodes; FLOP/s at the
# precision training uses (bf16 dense for GPUs), memory bandwidth and capacity per device.
_PRESETS: dict[str, dict[str, Any]] = {
    "cpu": {"intra": (5e9, 50e-6), "inter": (5e9, 50e-6), "flops": 5e10,
            "memory_bandwidth": 10e9, "memory": 8 * GiB, "device_type": "cpu"},
    "a100": {"intra": (300e9, 5e-6), "inter": (25e9, 15e-6), "flops": 250e12,
             "memory_bandwidth": 2.0e12, "memory": 80 * GiB, "device_type": "cuda"},
    "h100": {"intra": (450e9, 5e-6), "inter": (50e9, 15e-6), "flops": 600e12,
             "memory_bandwidth": 3.35e12, "memory": 80 * GiB, "device_type": "cuda"},
}  # fmt: skip


COLLECTIVE_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send")
"""The kinds of communication a :class:`CollectiveLink` prices: the four collectives, and
``send``, one rank's point-to-point send to another of the axis (a pipeline stage's
activations to the next stage)."""


@dataclass(frozen=True)
class CollectiveLink:
    """A latency and bandwidth one kind of collective runs at on one mesh axis, where they are
    not the axis' own (:attr:`Cluster.bandwidth` and :attr:`Cluster.latency`, which every other
    collective of that axis takes). Calibration measures them: gloo, for one, runs a
    reduce-scatter at a fraction of its all-reduce's speed. A kind may have several lines on an
    axis (one for small collectives, one for large ones): it takes the lowest
    (:meth:`Cluster.lines_of`)."""

    kind: str
    axis: int
    latency: float
    bandwidth: float

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "axis": self.axis, "latency": self.latency,
                "bandwidth": self.bandwidth}  # fmt: skip


@dataclass(frozen=True)
class Cluster:
    """A logical device mesh and what its devices and links can do.

    Rank ``r`` sits at the row-major coordinate of ``r`` in the mesh. The cost model reads:
    ``bandwidth`` and ``latency`` per mesh axis (bytes/s each device sends along that axis, and
    seconds per collective), ``flops`` and ``memory_bandwidth`` per device, and ``memory``, the
    bytes a device may hold. Axes without a bandwidth or latency take the first one given (or
    the defaults). ``collective_links`` give a kind of collective its own numbers on an axis
    (:class:`CollectiveLink`, :meth:`lines_of`; ``fxpar calibrate`` measures them).
    ``op_overhead`` (seconds every ATen op costs beyond its work: dispatch, allocation) and
    ``op_slowdown`` (per ATen op, such as ``"aten.mm"``, how many times its roofline time it
    takes; ``"*"`` for the ops not named; a mapping or ``(op, slowdown)`` pairs) refine the
    roofline per op (:meth:`op_seconds`); ``op_fixed`` (per ATen op, seconds each call that
    does work costs beyond ``op_overhead`` whatever its size: choosing a kernel, allocating
    its output, waking threads; ``"*"`` for the others) makes that a line rather than a
    proportion, so that a call on a small piece of the batch is not priced as that piece of
    the whole call; :func:`fxpar.calibrate_ops` measures them on a model's own ops (the fixed
    costs from the step timed at two batch sizes). ``overlap`` is the share of the
    communication a step runs beside compute that the compute really hides
    (:attr:`hidden_share`; ``fxpar calibrate`` measures it).
    ``core_demand`` is, for ranks that are processes of one host sharing its cores, the
    threads they compute with over those cores: above 1 the ranks take turns, and ranks that
    idle (a pipeline's bubble) leave their turns to the others (:meth:`compute_speedup`;
    ``fxpar calibrate`` measures it on CPU, ``None`` where devices compute alone), after
    ``core_delay`` seconds at the speed of all (the scheduler takes a slice or so to hand a
    rank the cores its peers left).
    ``lag_share`` is how far the slowest of such ranks trails the others per second of
    compute since they last waited for each other, beyond the first ``lag_stretch`` seconds
    (whose wait the collectives' latency holds): what a collective that synchronises them
    waits for its last peer (:meth:`lag_seconds`; ``fxpar calibrate`` measures both on CPU).
    ``peer_wait`` is, per mesh axis, the part of its collectives' latency that is that wait
    after ``lag_stretch`` of compute; a collective after less compute since the ranks last
    met on the axis waits less (:meth:`peer_wait_seconds`; ``fxpar calibrate`` measures it).
    :meth:`preset` builds common machines.
    """

    mesh_shape: tuple[int, ...]
    axis_names: tuple[str, ...] = ()
    device_type: str = "cpu"
    bandwidth: tuple[float, ...] = (10e9,)
    latency: tuple[float, ...] = (20e-6,)
    flops: float = 1e11
    memory_bandwidth: float = 20e9
    memory: float = 16 * GiB
    collective_links: tuple[CollectiveLink, ...] = ()
    op_overhead: float = 0.0
    op_slowdown: tuple[tuple[str, float], ...] = ()
    op_fixed: tuple[tuple[str, float], ...] = ()
    overlap: float | None = None
    core_demand: float | None = None
    core_delay: float = 0.0
    lag_share: float = 0.0
    lag_stretch: float = 0.0
    peer_wait: tuple[float, ...] = ()

    # The op every op not in ``op_slowdown`` (``op_fixed``) takes the slowdown (fixed cost) of.
    OTHER_OPS = "*"

    def __post_init__(self) -> None:
        shape = tuple(self.mesh_shape)
        if not shape or any(not isinstance(n, int) or n < 1 for n in shape):
            raise FxparError(f"mesh_shape must be a non-empty tuple of positive ints, got {shape}")
        object.__setattr__(self, "mesh_shape", shape)
        names = tuple(self.axis_names) or tuple(f"axis{i}" for i in range(len(shape)))
        if len(names) != len(shape) or len(set(names)) != len(names):
            raise FxparError(f"need {len(shape)} distinct axis names for mesh {shape}, got {names}")
        object.__setattr__(self, "axis_names", names)
        for field_name in ("bandwidth", "latency"):
            values = tuple(getattr(self, field_name))
            if not values or any(v <= 0 for v in values) or len(values) > len(shape):
                raise FxparError(
                    f"{field_name} needs 1 to {len(shape)} positive values (one per mesh axis), "
                    f"got {values}"
                )
            object.__setattr__(self, field_name, values + (values[0],) * (len(shape) - len(values)))
        if self.flops <= 0 or self.memory <= 0 or self.memory_bandwidth <= 0:
            raise FxparError("flops, memory_bandwidth and memory must be positive")
        try:
            links = tuple(
                CollectiveLink(**link) if isinstance(link, Mapping) else link
                for link in self.collective_links
            )
        except TypeError as error:
            raise FxparError(
                f"a collective link has a kind, axis, latency and bandwidth: {error}"
            ) from error
        seen = set()
        for link in links:
            if not isinstance(link, CollectiveLink) or not all(
                isinstance(number, int | float) for number in (link.axis, link.latency,
                                                                link.bandwidth)
            ):  # fmt: skip
                raise FxparError(f"collective_links holds CollectiveLinks, got {link!r}")
            if link.kind not in COLLECTIVE_KINDS or not 0 <= link.axis < len(shape):
                raise FxparError(
                    f"a collective link needs a kind of {COLLECTIVE_KINDS} and an axis of the "
                    f"{len(shape)}-D mesh, got {link.kind!r} on axis {link.axis}"
                )
            if not (link.latency > 0 and link.bandwidth > 0):
                raise FxparError(
                    f"a collective link needs a positive latency and bandwidth: {link}"
                )
            if link in seen:
                raise FxparError(f"the same link twice: {link}")
            seen.add(link)
        object.__setattr__(self, "collective_links", links)
        object.__setattr__(self, "op_slowdown", _op_numbers("op_slowdown", self.op_slowdown))
        object.__setattr__(self, "op_fixed", _op_numbers("op_fixed", self.op_fixed, zero=True))
        if not (_finite(self.op_overhead) and self.op_overhead >= 0):
            raise FxparError(f"op_overhead must be a finite number >= 0, got {self.op_overhead}")
        if self.overlap is not None and not (_finite(self.overlap) and 0 <= self.overlap <= 1):
            raise FxparError(f"overlap must be a number from 0 to 1, or None; got {self.overlap!r}")
        if self.core_demand is not None and not _positive(self.core_demand):
            raise FxparError(
                f"core_demand must be a finite number > 0, or None; got {self.core_demand!r}"
            )
        for name in ("core_delay", "lag_share", "lag_stretch"):
            value = getattr(self, name)
            if not (_finite(value) and value >= 0):
                raise FxparError(f"{name} must be a finite number >= 0, got {value!r}")
        self._check_peer_wait()

    def _check_peer_wait(self) -> None:
        """``peer_wait`` as one number per axis (none given: 0), each within every latency of
        its axis' collectives, which hold it."""
        waits = tuple(self.peer_wait)
        if len(waits) > self.ndim or not all(_finite(wait) and wait >= 0 for wait in waits):
            raise FxparError(
                f"peer_wait needs at most {self.ndim} finite numbers >= 0 (one per mesh axis), "
                f"got {waits}"
            )
        waits += (waits[0] if waits else 0.0,) * (self.ndim - len(waits))
        object.__setattr__(self, "peer_wait", waits)
        for axis, wait in enumerate(waits):
            held = [self.latency[axis]] + [
                link.latency
                for link in self.collective_links
                if link.axis == axis and link.kind != "send"
            ]
            if wait > min(held):
                raise FxparError(
                    f"peer_wait {wait} on axis {self.axis_names[axis]} is more than a latency "
                    f"of its collectives ({min(held)}): it is the part of each that waits for "
                    "the last peer"
                )

    @property
    def hidden_share(self) -> float:
        """The share of the communication a step runs beside compute (an all-reduce started
        where its value is made and waited for where it is read, a layer's gathers started a
        layer ahead) that the compute really hides: :attr:`overlap` where it is set, else 1 on
        CUDA devices, whose collectives run on copy engines of their own, and 0 elsewhere: on
        CPU processes, gloo moves the bytes on the cores the ops need, and a collective in
        flight slows them by about what it takes."""
        if self.overlap is not None:
            return self.overlap
        return 1.0 if self.device_type.startswith("cuda") else 0.0

    def compute_speedup(self, computing: float) -> float:
        """How many times faster than calibrated a rank computes while only the share
        ``computing`` (0 to 1) of the host's ranks compute: its ops were timed with every rank
        computing, each thread getting ``min(1, 1 / core_demand)`` of a core, and with fewer
        computing each gets ``min(1, 1 / (computing * core_demand))``. 1 without
        ``core_demand``."""
        if self.core_demand is None or computing <= 0:
            return 1.0
        return min(1.0, 1 / (computing * self.core_demand)) / min(1.0, 1 / self.core_demand)

    def lag_seconds(self, stretch: float) -> float:
        """How long a collective that every rank waits for waits for the last one after
        ``stretch`` seconds of compute since the ranks last waited for each other, beyond the
        wait its latency holds: ``lag_share * max(0, stretch - lag_stretch)``."""
        return self.lag_share * max(0.0, stretch - self.lag_stretch)

    def peer_wait_seconds(self, axis: int, stretch: float) -> float:
        """How long a collective on ``axis`` waits for its last peer after ``stretch`` seconds
        of compute since the ranks last met there, of the ``peer_wait`` its latency holds: all
        of it after ``lag_stretch`` (the stretch calibration measured it after) or where that
        is 0, less in proportion after less (ranks that leave a collective together drift
        apart while they compute, by no more than they computed). Beyond ``lag_stretch`` the
        ranks drift further: :meth:`lag_seconds`."""
        wait = self.peer_wait[axis]
        if self.lag_stretch <= 0 or stretch >= self.lag_stretch:
            return wait
        return wait * max(stretch, 0.0) / self.lag_stretch

    @staticmethod
    def preset(name: str, mesh_shape: tuple[int, ...], **overrides: Any) -> Cluster:
        """A cluster of a known kind, with any field overridden by keyword.

        ``"cpu"``: local CPU processes on gloo. ``"h100"`` / ``"a100"``: nodes of 8 GPUs, NVLink
        inside a node and InfiniBand between nodes; the last mesh axis is taken to lie inside a
        node and the others to span nodes.
        """
        if name not in _PRESETS:
            raise FxparError(f"unknown cluster preset {name!r}; choose from {sorted(_PRESETS)}")
        preset = _PRESETS[name]
        inner, outer = preset["intra"], preset["inter"]
        fields: dict[str, Any] = {
            "bandwidth": (*(outer[0] for _ in mesh_shape[:-1]), inner[0]),
            "latency": (*(outer[1] for _ in mesh_shape[:-1]), inner[1]),
            "flops": preset["flops"],
            "memory_bandwidth": preset["memory_bandwidth"],
            "memory": preset["memory"],
            "device_type": preset["device_type"],
        }
        fields.update(overrides)
        return Cluster(tuple(mesh_shape), **fields)

    @staticmethod
    def from_env(preset: str = "cpu", **overrides: Any) -> Cluster:
        """The cluster of the processes ``torchrun`` started, read from its environment.

        ``WORLD_SIZE`` processes, ``LOCAL_WORLD_SIZE`` of them per node: a mesh of
        ``(nodes, local)`` when they span several nodes, ``(world,)`` on one node. The links and
        devices are those of ``preset`` (see :meth:`preset`); keyword arguments override any
        field, ``mesh_shape`` included (it must still hold exactly ``WORLD_SIZE`` devices).
        """
        world = _env_int("WORLD_SIZE")
        local = _env_int("LOCAL_WORLD_SIZE", default=world)
        if local < 1 or world % local:
            raise FxparError(
                f"WORLD_SIZE={world} is not a multiple of LOCAL_WORLD_SIZE={local}: every node "
                "must run the same number of processes (torchrun --nproc-per-node)"
            )
        nodes = world // local
        default_mesh = (nodes, local) if nodes > 1 else (world,)
        mesh_shape = tuple(overrides.pop("mesh_shape", default_mesh))
        if math.prod(mesh_shape) != world:
            raise FxparError(
                f"mesh {mesh_shape} has {math.prod(mesh_shape)} devices but torchrun started "
                f"WORLD_SIZE={world} processes; choose a mesh whose sizes multiply to {world}"
            )
        return Cluster.preset(preset, mesh_shape, **overrides)

    def to_dict(self) -> dict[str, Any]:
        """Every field, as JSON writes it (tuples as lists, ``op_slowdown`` and ``op_fixed`` as
        objects); ``collective_links``, the op fields, ``overlap``, the core sharing,
        the lag and the peer wait only when set."""
        data = {
            field.name: list(value) if isinstance(value, tuple) else value
            for field in fields(self)
            for value in (getattr(self, field.name),)
        }
        data["collective_links"] = [link.to_dict() for link in self.collective_links]
        data["op_slowdown"] = dict(self.op_slowdown)
        data["op_fixed"] = dict(self.op_fixed)
        optional = ("collective_links", "op_overhead", "op_slowdown", "op_fixed", "core_delay",
                    "lag_share", "lag_stretch")  # fmt: skip
        for name in optional:
            if not data[name]:
                del data[name]
        if not any(self.peer_wait):
            del data["peer_wait"]
        for name in ("overlap", "core_demand"):
            if data[name] is None:
                del data[name]
        return data

    @staticmethod
    def from_dict(data: Mapping[str, Any]) -> Cluster:
        """The cluster :meth:`to_dict` wrote (fields left out take their defaults)."""
        known = {field.name for field in fields(Cluster)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise FxparError(f"a cluster has no fields {unknown}; its fields are {sorted(known)}")
        if "mesh_shape" not in data:
            raise FxparError(f"a cluster needs a mesh_shape, got only {sorted(data)}")
        for key, value in data.items():
            if not _is_json_field(key, value):
                raise FxparError(f"a cluster's {key} cannot be {value!r}: {_FIELD_KINDS[key]}")
        try:
            values: dict[str, Any] = {
                key: tuple(value)
                if isinstance(value, list | dict) and key not in ("op_slowdown", "op_fixed")
                else value
                for key, value in data.items()
            }
            return Cluster(**values)
        except TypeError as error:
            raise FxparError(f"cannot build a cluster from {dict(data)}: {error}") from error

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write the cluster as JSON (a *cluster file*; :meth:`load` reads it back)."""
        document = {"format": CLUSTER_FORMAT, **self.to_dict()}
        path = Path(path)
        lines = [f"  {json.dumps(key)}: {json.dumps(value)}" for key, value in document.items()]
        path.write_text("{\n" + ",\n".join(lines) + "\n}\n")  # one field a line
        return path

    @staticmethod
    def load(path: str | os.PathLike[str], mesh_shape: tuple[int, ...] | None = None) -> Cluster:
        """The cluster of a cluster file (:meth:`save`, ``fxpar calibrate --output``), on
        ``mesh_shape`` if given: a mesh of as many axes keeps the file's axis names and
        per-axis links; another one takes the links of the file's last axis on every axis (as
        a preset gives a one-axis mesh its in-node links). A mesh of another number of devices
        drops the core sharing and the lag, measured for the file's (its collectives then
        wait for their last peer in full, :meth:`peer_wait_seconds`)."""
        try:
            document = json.loads(Path(path).read_text())
        except (OSError, ValueError) as error:
            raise FxparError(f"cannot read the cluster file {path}: {error}") from error
        if not isinstance(document, dict) or document.pop("format", None) != CLUSTER_FORMAT:
            raise FxparError(
                f'{path} is not a cluster file (a JSON object with "format": '
                f'"{CLUSTER_FORMAT}"); write one with Cluster.save or fxpar calibrate --output'
            )
        saved = Cluster.from_dict(document)
        if mesh_shape is None or tuple(mesh_shape) == saved.mesh_shape:
            return saved
        if math.prod(mesh_shape) != saved.world_size:  # measured for the file's ranks
            # Without its lag_stretch, a collective pays the whole peer_wait its latency holds.
            saved = replace(saved, core_demand=None, core_delay=0.0, lag_share=0.0, lag_stretch=0.0)
        if len(mesh_shape) == saved.ndim:
            return replace(saved, mesh_shape=tuple(mesh_shape))
        last = [link for link in saved.collective_links if link.axis == saved.ndim - 1]
        return replace(
            saved,
            mesh_shape=tuple(mesh_shape),
            axis_names=(),
            bandwidth=saved.bandwidth[-1:],
            latency=saved.latency[-1:],
            peer_wait=saved.peer_wait[-1:],
            collective_links=tuple(
                replace(link, axis=axis) for axis in range(len(mesh_shape)) for link in last
            ),
        )

    @staticmethod
    def parse_mesh(text: str) -> tuple[int, ...]:
        """``"2x4"`` -> ``(2, 4)``; ``"8"`` -> ``(8,)``."""
        try:
            shape = tuple(int(size) for size in text.lower().split("x"))
        except ValueError:
            shape = ()
        if not shape or any(size < 1 for size in shape):
            raise FxparError(f"cannot read a mesh shape from {text!r}; write it like 8 or 2x4")
        return shape

    @property
    def ndim(self) -> int:
        return len(self.mesh_shape)

    @property
    def world_size(self) -> int:
        return math.prod(self.mesh_shape)

    def coordinates(self) -> Iterator[Coordinate]:
        """Every device coordinate, in rank order."""
        return itertools.product(*(range(n) for n in self.mesh_shape))

    def coordinate(self, rank: int) -> Coordinate:
        if not 0 <= rank < self.world_size:
            raise FxparError(f"rank {rank} is outside a mesh of {self.world_size} devices")
        coordinate = []
        for size in reversed(self.mesh_shape):
            rank, index = divmod(rank, size)
            coordinate.append(index)
        return tuple(reversed(coordinate))

    def rank(self, coordinate: Coordinate) -> int:
        rank = 0
        for index, size in zip(coordinate, self.mesh_shape, strict=True):
            rank = rank * size + index
        return rank

    def axis_index(self, axis: int | str) -> int:
        if isinstance(axis, str):
            if axis not in self.axis_names:
                raise FxparError(f"no mesh axis {axis!r}; the axes are {self.axis_names}")
            return self.axis_names.index(axis)
        if not 0 <= axis < self.ndim:
            raise FxparError(f"mesh axis {axis} out of range for a {self.ndim}-D mesh")
        return axis

    def link_axis(self, devices: int) -> tuple[int | None, int]:
        """The innermost mesh axis whose block of trailing axes holds ``devices`` consecutive
        ranks evenly (ranks are row-major; None when no block does), and that block's ranks."""
        block = 1
        for axis in reversed(range(self.ndim)):
            block *= self.mesh_shape[axis]
            if block % devices == 0:
                return axis, block
        return None, block

    def lines_of(self, kind: str, axis: int) -> tuple[tuple[float, float], ...]:
        """The (bandwidth, latency) lines a collective of ``kind`` on mesh axis ``axis`` is
        priced with, the lowest of them at its size
        (:func:`fxpar.planning.cost.link_seconds`): its own (:attr:`collective_links`) where
        it has them, else the axis'."""
        return self._lines.get((kind, axis), ((self.bandwidth[axis], self.latency[axis]),))

    @functools.cached_property
    def _lines(self) -> dict[tuple[str, int], tuple[tuple[float, float], ...]]:
        lines: dict[tuple[str, int], tuple[tuple[float, float], ...]] = {}
        for link in self.collective_links:
            key = (link.kind, link.axis)
            lines[key] = (*lines.get(key, ()), (link.bandwidth, link.latency))
        return lines

    def op_seconds(self, op: str, roofline: float) -> float:
        """Time one device takes for an ATen op ``op`` (``"aten.mm"``) whose roofline time on
        this cluster is ``roofline``: :meth:`call_seconds` plus ``roofline`` times the op's
        slowdown (:attr:`op_slowdown`, else that of ``"*"``, else 1)."""
        slowdowns = self._slowdowns
        slowdown = slowdowns.get(op, slowdowns.get(self.OTHER_OPS, 1.0))
        return self.call_seconds(op, roofline) + roofline * slowdown

    def call_seconds(self, op: str, roofline: float) -> float:
        """The part of :meth:`op_seconds` a call pays whatever its size: ``op_overhead``, and
        for a call that does work (``roofline > 0``) the op's fixed cost (:attr:`op_fixed`,
        else that of ``"*"``, else 0)."""
        if roofline <= 0:
            return self.op_overhead
        fixed = self._fixed
        return self.op_overhead + fixed.get(op, fixed.get(self.OTHER_OPS, 0.0))

    @functools.cached_property
    def _slowdowns(self) -> dict[str, float]:
        return dict(self.op_slowdown)

    @functools.cached_property
    def _fixed(self) -> dict[str, float]:
        return dict(self.op_fixed)

    def link(self, devices: int) -> tuple[float, float]:
        """Bandwidth and latency among ``devices`` consecutive ranks: those of
        :meth:`link_axis`, or the slowest link when no block holds them evenly."""
        axis, _ = self.link_axis(devices)
        if axis is None:
            return min(self.bandwidth), max(self.latency)
        return self.bandwidth[axis], self.latency[axis]

    def submesh(self, shape: Sequence[int]) -> Cluster:
        """The cluster one pipeline stage runs (and is priced) on: a mesh of ``shape`` on
        consecutive ranks of this one. Each of its axes takes the links of the innermost axis
        of this mesh holding as many consecutive ranks as that axis's block
        (:meth:`link`); its axis names are this mesh's where ``shape`` is a trailing part of
        it (the stages are the leading axes), else ``("devices",)`` or ``stage_axis<i>``.
        A device's memory is multiplied by ``world / devices``, the number of stages when the
        stages are alike: a plan made on the submesh covers every stage's layers, and a
        device holds about its stage's share of them.

        Raises:
            FxparError: ``shape`` is empty, has an axis of no devices, or holds more devices
                than the cluster.
        """
        shape = tuple(int(size) for size in shape)
        devices = math.prod(shape)
        if not shape or min(shape) < 1 or devices > self.world_size:
            raise FxparError(
                f"a stage mesh {shape} must be a non-empty shape of at most the cluster's "
                f"{self.world_size} devices ({self.mesh_shape})"
            )
        world = self.world_size
        share = world // devices if world % devices == 0 else world / devices
        sources = [self.link_axis(math.prod(shape[axis:]))[0] for axis in range(len(shape))]
        links = [self.link(math.prod(shape[axis:])) for axis in range(len(shape))]
        kinds = tuple(
            replace(link, axis=axis)
            for axis, source in enumerate(sources)
            for link in self.collective_links
            if link.axis == source
        )
        if self.mesh_shape[self.ndim - len(shape) :] == shape and len(shape) < self.ndim:
            names = self.axis_names[self.ndim - len(shape) :]
        elif len(shape) == 1:
            names = ("devices",)
        else:
            names = tuple(f"stage_axis{axis}" for axis in range(len(shape)))
        return replace(
            self,
            mesh_shape=shape,
            axis_names=names,
            bandwidth=tuple(bandwidth for bandwidth, _ in links),
            latency=tuple(latency for _, latency in links),
            peer_wait=tuple(
                min(self.peer_wait) if source is None else self.peer_wait[source]
                for source in sources
            ),
            memory=self.memory * share,
            collective_links=kinds,
        )

    def check_process_group(self) -> None:
        """Raise :class:`~fxpar.errors.DistributedError` unless torch.distributed is
        initialized with exactly as many ranks as the mesh has devices."""
        import torch.distributed as dist

        if not dist.is_initialized():
            if "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ:
                raise DistributedError(
                    "this process was started by torchrun (WORLD_SIZE is set) but "
                    "torch.distributed is not initialized: call "
                    "torch.distributed.init_process_group('gloo') (or 'nccl') first"
                )
            raise DistributedError(
                f"{self} needs {self.world_size} processes, but torch.distributed is not "
                "initialized: launch with `torchrun --nproc-per-node N` and call "
                "torch.distributed.init_process_group, or use fxpar.runtime.launch.spawn"
            )
        world = dist.get_world_size()
        if world != self.world_size:
            raise DistributedError(
                f"the process group has {world} ranks but the cluster's mesh {self.mesh_shape} "
                f"has {self.world_size} devices: launch {self.world_size} processes, or choose "
                f"a mesh of {world} devices (e.g. Cluster.from_env())"
            )

    def device_mesh(self):
        """The DeviceMesh for this cluster; needs an initialized default process group whose
        world size equals the mesh's (see :meth:`check_process_group`)."""
        from torch.distributed.device_mesh import init_device_mesh

        self.check_process_group()
        device_type = mesh_device_type(self.device_type)
        return init_device_mesh(device_type, self.mesh_shape, mesh_dim_names=self.axis_names)

    def __str__(self) -> str:
        axes = ", ".join(
            f"{name}={size}" for name, size in zip(self.axis_names, self.mesh_shape, strict=True)
        )
        return f"mesh of {self.world_size} devices ({axes})"


def mesh_device_type(device_type: str) -> str:
    """The device type of a DeviceMesh for ranks on ``device_type`` under the default process
    group: over gloo a GPU's tensors travel through host memory, so the mesh (and the DTensors
    of checkpoints and gathered outputs) is a CPU one (:mod:`fxpar.runtime.devices`)."""
    import torch.distributed as dist

    return "cpu" if dist.get_backend() == "gloo" else device_type


def _env_int(name: str, default: int | None = None) -> int:
    text = os.environ.get(name)
    if text is None:
        if default is not None:
            return default
        raise FxparError(
            f"{name} is not set: Cluster.from_env() reads the environment torchrun sets up; "
            "launch with `torchrun --nproc-per-node N script.py`, or build a Cluster(mesh_shape) "
            "yourself"
        )
    try:
        return int(text)
    except ValueError:
        raise FxparError(f"environment variable {name}={text!r} is not an integer") from None


_FIELD_KINDS = {
    "mesh_shape": "a list of whole numbers >= 1",
    "axis_names": "a list of names",
    "device_type": "a name such as cpu or cuda",
    "bandwidth": "a list of finite numbers > 0",
    "latency": "a list of finite numbers > 0",
    "flops": "a finite number > 0",
    "memory_bandwidth": "a finite number > 0",
    "memory": "a finite number > 0",
    "collective_links": "a list of {kind, axis, latency, bandwidth} objects",
    "op_overhead": "a finite number >= 0",
    "op_slowdown": "an object of op names to finite numbers > 0",
    "op_fixed": "an object of op names to finite numbers >= 0",
    "overlap": "a number from 0 to 1",
    "core_demand": "a finite number > 0",
    "core_delay": "a finite number >= 0",
    "lag_share": "a finite number >= 0",
    "lag_stretch": "a finite number >= 0",
    "peer_wait": "a list of finite numbers >= 0",
}


def _finite(number: object) -> bool:
    return (
        isinstance(number, int | float) and not isinstance(number, bool) and math.isfinite(number)
    )


def _positive(number: object) -> bool:
    return _finite(number) and number > 0  # type: ignore[operator]


def _op_numbers(name: str, value: object, *, zero: bool = False) -> tuple[tuple[str, float], ...]:
    """``value`` (a mapping or ``(op, number)`` pairs) as sorted pairs of distinct op names and
    numbers, each positive (or, with ``zero``, at least 0)."""
    pairs = tuple(value.items()) if isinstance(value, Mapping) else tuple(value)  # type: ignore[arg-type]

    def fits(number: object) -> bool:
        return _finite(number) and number >= 0 if zero else _positive(number)  # type: ignore[operator]

    if not all(
        isinstance(pair, tuple | list) and len(pair) == 2 and isinstance(pair[0], str)
        and fits(pair[1])
        for pair in pairs
    ) or len({op for op, _ in pairs}) != len(pairs):  # fmt: skip
        bound = ">= 0" if zero else "positive"
        raise FxparError(
            f"{name} maps distinct op names (such as 'aten.mm', or '*' for the others) "
            f"to {bound} numbers, got {value!r}"
        )
    return tuple(sorted((op, float(number)) for op, number in pairs))


def _is_json_field(key: str, value: object) -> bool:
    """Whether ``value``, read from JSON, has the type of the cluster's field ``key``."""

    if key == "mesh_shape":
        return isinstance(value, list | tuple) and all(
            type(size) is int and size >= 1 for size in value
        )
    if key == "axis_names":
        return isinstance(value, list | tuple) and all(isinstance(name, str) for name in value)
    if key == "device_type":
        return isinstance(value, str)
    if key in ("bandwidth", "latency"):
        return isinstance(value, list | tuple) and all(_positive(number) for number in value)
    if key == "peer_wait":
        return isinstance(value, list | tuple) and all(
            _finite(number) and number >= 0 for number in value
        )
    if key == "collective_links":
        return isinstance(value, list | tuple) and all(
            isinstance(link, dict)
            and set(link) == {"kind", "axis", "latency", "bandwidth"}
            and isinstance(link["kind"], str)
            and type(link["axis"]) is int
            and _positive(link["latency"])
            and _positive(link["bandwidth"])
            for link in value
        )
    if key in ("op_overhead", "core_delay", "lag_share", "lag_stretch"):
        return _finite(value) and value >= 0  # type: ignore[operator]
    if key == "op_slowdown":
        return isinstance(value, dict) and all(_positive(number) for number in value.values())
    if key == "op_fixed":
        return isinstance(value, dict) and all(
            _finite(number) and number >= 0 for number in value.values()
        )
    if key == "overlap":
        return _finite(value) and 0 <= value <= 1  # type: ignore[operator]
    return _positive(value)
