"""The plan report: where a plan spends its step time and its memory, layer by layer.

:func:`report_data` reads a :class:`~fxpar.planning.plan.Plan` into plain data (dicts, lists,
strings and numbers, JSON-ready); :func:`render_text` turns that into the table of ``Plan.report()``
and :func:`plot` into the picture of ``Plan.plot(path)``. docs/plan_report.md explains the columns.

Nothing here lowers the plan or decides a collective. The collectives listed are those of the
plan's collective schedule (:mod:`fxpar.planning.collective_schedule`), the one the lowering emits
as code for every rank, so they are exactly those of ``fxpar.lower(plan).collectives()``
(:func:`plan_collectives`), found without building a program per rank. :func:`price_schedule`
prices them by the cost model, and prices every edge as the cost model does, per consumer and
without reuse, which is the header's communication time: compute plus that is the solver's
objective. The difference between the two communication figures is what the schedule saves by
reusing conversions.

Every op's compute time and every value's bytes come from the cost and memory model
(:mod:`fxpar.planning.cost`) that the problem builder uses, so the layers' memory adds up to the
solver's and their compute plus the priced communication to its objective. That sum is the
solver's memory row, every gradient and saved activation at once; the header's peak is a moment
of the step instead, the most one device holds at once, walked through the schedule
(:func:`fxpar.planning.peak_memory.peak_memory`), with the largest values alive then.

Layers are module path prefixes: ``blocks.3``, ``transformer.h.3``, ``model.layers.3`` for
numbered layers (:func:`fxpar.planning.cost.numbered_layer`); other modules are cut at the
depth just below the layer container (``wte``, ``transformer.ln_f``, ``model.embed_tokens``,
``lm_head``). ``<inputs>`` holds the batch, ``<root>`` the model's own top-level ops and
``<loss>`` a separate loss function.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch.fx as fx
from torch.distributed.tensor import Partial, Shard

from fxpar import ir
from fxpar.cluster import Cluster
from fxpar.errors import FxparError
from fxpar.ir.program import Program
from fxpar.planning import cost
from fxpar.planning.collective_schedule import CollectiveRecord, schedule_program
from fxpar.planning.peak_memory import peak_memory
from fxpar.planning.step_time import (
    PricedSchedule,
    estimated_step,
    price_schedule,
    step_overlap,
)
from fxpar.rules import coverage
from fxpar.sharding import Sharding, Spec

if TYPE_CHECKING:
    from fxpar.planning.plan import Plan

MEMORY_KINDS = ("params", "grads", "optimizer", "activations")
SHORT_KIND = {
    "all_gather": "AG", "all_reduce": "AR", "reduce_scatter": "RS", "all_to_all": "A2A",
    "all_to_all_rows": "A2Av",
}  # fmt: skip
INPUTS_ROW = "<inputs>"
ROOT_ROW = "<root>"


def compact_spec(spec: Spec | None) -> str:
    """``S(0)R`` for ``(Shard(0), Replicate())``: one token per mesh axis, as plan files and the
    report write specs (:func:`fxpar.planning.plan_file.parse_spec` reads it back)."""
    if spec is None:
        return "-"
    tokens = []
    for placement in spec:
        if isinstance(placement, Shard):
            tokens.append(f"S({placement.dim})")
        elif isinstance(placement, Partial):
            tokens.append("P")
        else:
            tokens.append("R")
    return "".join(tokens)


def plan_collectives(program: Program, cluster: Cluster) -> list[CollectiveRecord]:
    """The collectives ``lower(program, cluster).collectives()`` lists, in the same order,
    without lowering."""
    return list(schedule_program(program, cluster.mesh_shape).records)


# -- layers -------------------------------------------------------------------------------------


def layer_namer(modules: Iterable[str]) -> Callable[[str], str]:
    """A function from a module path to its layer's name (see the module docstring)."""
    containers = [
        layer.container for layer in map(cost.numbered_layer, modules) if layer is not None
    ]
    depth = 1 + min((len(c.split(".")) if c else 0 for c in containers), default=0)

    def name(module: str) -> str:
        if not module:
            return ROOT_ROW
        if module.startswith("<"):
            return module
        layer = cost.numbered_layer(module)
        if layer is not None:
            return layer.name
        return ".".join(module.split(".")[:depth])

    return name


def _layer_class(name: str) -> str:
    """``blocks.*`` for ``blocks.3``: layers that may be collapsed into one row."""
    layer = cost.numbered_layer(name)
    return name if layer is None else layer.pattern


@dataclass
class _Layer:
    name: str
    first: int
    weights: dict[str, str] = field(default_factory=dict)
    output: fx.Node | None = None
    compute: float = 0.0
    collectives: Counter[tuple[str, int]] = field(default_factory=Counter)
    collective_bytes: Counter[tuple[str, int]] = field(default_factory=Counter)
    collective_seconds: defaultdict[tuple[str, int], float] = field(
        default_factory=lambda: defaultdict(float)
    )
    memory: dict[str, float] = field(default_factory=lambda: dict.fromkeys(MEMORY_KINDS, 0.0))


def report_data(plan: Plan) -> dict[str, Any]:
    """The plan report as plain data: ``header``, ``layers`` (one entry per layer, in model
    order), ``devices`` (memory per rank) and ``no_rule`` (ops without a sharding rule, which
    run replicated, with their node counts). Every number is per device."""
    program, cluster = plan.program, plan.cluster
    states = plan.options.optimizer_states
    found = price_schedule(program, cluster, shared=plan.layout.shares, optimizer_states=states)
    names = {node: name for name, node in program.placeholders().items()}
    inputs = set(program.signature.inputs)
    # Random inputs sit in the layer of the module that draws them, counted like activations.
    step_inputs = set(program.signature.step_inputs)
    gradients = set(program.signature.gradients)
    optimizer_states = plan.options.optimizer_states
    regions = {node: ir.require(node, ir.Region) for node in program.graph.nodes}
    layer_of_module = layer_namer({r.module for r in regions.values()})
    layers: dict[str, _Layer] = {}
    layer_of: dict[fx.Node, _Layer] = {}
    for index, node in enumerate(program.graph.nodes):
        if node.op == "output":
            continue
        name = INPUTS_ROW if names.get(node) in inputs else layer_of_module(regions[node].module)
        # Model order: a layer sits where its forward starts (its weights come earlier), the
        # batch first; a layer without forward ops after all others.
        first = index if regions[node].phase is ir.Phase.FORWARD else index + (1 << 40)
        if name == INPUTS_ROW:
            first = -1
        layer = layers.setdefault(name, _Layer(name, first))
        layer.first = min(layer.first, first)
        layer_of[node] = layer

    saved = cost.saved_outputs(program.graph.nodes)
    for node, layer in layer_of.items():
        if node.op == "placeholder":
            spec = found.specs[node][0]
            assert spec is not None
            nbytes = float(cost.local_bytes(ir.require(node, ir.ValueMeta).tensor, spec, cluster))
            name = names[node]
            if name in step_inputs:
                layer.memory["activations"] += nbytes
                continue
            prefix = layer.name + "."
            layer.weights[name.removeprefix(prefix) if name.startswith(prefix) else name] = (
                compact_spec(spec)
            )
            kept = cost.parameter_memory(nbytes, name in gradients, optimizer_states)
            for kind, kind_bytes in kept.items():
                layer.memory[kind] += kind_bytes
            continue
        layer.compute += found.compute.get(node, 0.0)
        if node in saved and ir.get(node, Sharding) is not None:
            value = ir.require(node, ir.ValueMeta)
            layer.memory["activations"] += cost.saved_bytes(
                value, found.specs[node], saved[node], cluster
            )
        if regions[node].phase is ir.Phase.FORWARD and any(
            user.op == "output"
            or (regions[user].phase is ir.Phase.FORWARD and layer_of[user] is not layer)
            for user in node.users
        ):
            layer.output = node  # the last such node in graph order: the layer's result

    nodes = {node.name: node for node in program.graph.nodes}
    for record, seconds in zip(found.records, found.record_seconds, strict=True):
        # A collective belongs to the layer that runs it; the synchronisation of an output
        # (a gradient) to the layer that computed it.
        where = record.tensor if record.phase is ir.Phase.OUTPUT else record.consumer
        layer = layer_of[nodes[where]]
        key = (record.kind, record.axis)
        layer.collectives[key] += 1
        layer.collective_bytes[key] += record.bytes
        layer.collective_seconds[key] += seconds

    order = list(program.graph.nodes)
    overlap = step_overlap(found, order)
    peak = peak_memory(
        program, cluster, found.schedule, optimizer_states=plan.options.optimizer_states
    )
    ordered = sorted(layers.values(), key=lambda layer: layer.first)
    layer_rows = [_layer_row(layer, found, cluster) for layer in ordered]
    compute = sum(found.compute.values())
    memory_total = {kind: sum(row["memory"][kind] for row in layer_rows) for kind in MEMORY_KINDS}
    solution = plan.solution
    header = {
        "solver": solution.solver,
        "status": solution.status,
        "gap": None if math.isnan(solution.gap) else solution.gap,
        "solve_seconds": solution.seconds,
        "cluster": str(cluster),
        "mesh_shape": list(cluster.mesh_shape),
        "axis_names": list(cluster.axis_names),
        "estimated_seconds": estimated_step(found, order, cluster.hidden_share, overlap),
        "hidden_share": cluster.hidden_share,
        "objective_seconds": solution.objective,
        "compute_seconds": compute,
        "communication_seconds": found.edge_seconds,
        "exposed_seconds": overlap.exposed,
        "hidden_seconds": overlap.hidden,
        "lag_seconds": found.lag,
        "update_seconds": found.update,
        "copy_seconds": found.copies,
        "collectives": len(found.records),
        "collective_bytes": sum(r.bytes for r in found.records),
        "collective_seconds": sum(found.record_seconds),
        "memory_bytes": sum(memory_total.values()),
        "memory": memory_total,
        "peak_bytes": peak.peak_bytes,
        "peak_at": peak.peak_node,
        "peak_input_bytes": peak.input_bytes,
        "peak_largest": [list(item) for item in peak.largest],
        "memory_limit_bytes": plan.problem.memory_limit,
        "device_memory_bytes": cluster.memory,
        "graph_nodes": plan.stats.get("graph_nodes", 0),
        "decision_nodes": plan.stats.get("decision_nodes", 0),
        "layers_merged": plan.stats.get("layers_merged", 0),
        **_precision_and_remat(plan.program),
    }
    # Every split is even, so every rank holds the same bytes; one entry per rank all the same
    # keeps the picture honest about the mesh (pipeline stages will make them differ).
    devices = [
        {"rank": rank, "coordinate": list(coordinate), "memory": dict(memory_total)}
        for rank, coordinate in enumerate(cluster.coordinates())
    ]
    # An op without a sharding rule runs replicated, and the plan report says so.
    fallback = coverage(program, plan.rules).fallback
    unruled = {op: count for op, (count, _) in sorted(fallback.items())}
    return {"header": header, "layers": layer_rows, "devices": devices, "no_rule": unruled}


def _layer_row(layer: _Layer, found: PricedSchedule, cluster: Cluster) -> dict[str, Any]:
    output: dict[str, Any] | None = None
    if layer.output is not None:
        meta = ir.require(layer.output, ir.ValueMeta).outputs[0]
        output = {
            "node": layer.output.name,
            "spec": compact_spec(found.specs[layer.output][0]),
            "shape": None if meta is None else [ir.evaluate(s) for s in meta.shape],
        }
    collectives = [
        {
            "kind": kind,
            "axis": axis,
            "axis_name": cluster.axis_names[axis],
            "count": count,
            "bytes": layer.collective_bytes[(kind, axis)],
            "seconds": layer.collective_seconds[(kind, axis)],
        }
        for (kind, axis), count in sorted(layer.collectives.items())
    ]
    return {
        "name": layer.name,
        "weights": dict(layer.weights),
        "output": output,
        "compute_seconds": layer.compute,
        "collectives": collectives,
        "memory": dict(layer.memory),
    }


# -- text ---------------------------------------------------------------------------------------

_COLUMNS = ("layer", "compute ms", "collectives", "comm", "comm ms", "memory", "output")
_LEFT = {0, 6}
_INDENT = "    "


def _hidden_line(header: Mapping[str, Any], pad: str) -> list[str]:
    """What share of the communication behind compute the estimate takes off, where any."""
    share = header["hidden_share"]
    if not share:
        return []
    return [f"{pad}the estimate takes {share:.0%} of it off (the cluster's hidden share)"]


def _lag_line(header: Mapping[str, Any], pad: str) -> list[str]:
    """What the estimate adds for the wait for the slowest rank, and what of its compute is
    outside the graph's ops, where any."""
    lines = []
    lag = header.get("lag_seconds", 0.0)
    if lag:
        lines.append(f"{pad}and {_ms(lag)} ms waiting for the slowest rank (ranks share cores)")
    update, copies = header.get("update_seconds", 0.0), header.get("copy_seconds", 0.0)
    if update or copies:
        lines.append(
            f"{pad}outside the ops: the optimizer's update {_ms(update)} ms, packing buckets "
            f"{_ms(copies)} ms"
        )
    return lines


def _size(nbytes: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(nbytes) >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes:.0f} B"


def _precision_and_remat(program: Program) -> dict[str, Any]:
    """What mixed precision and rematerialization did to the step, for the report's header."""
    found: dict[str, Any] = {}
    for node in program.graph.nodes:
        cast = ir.get(node, ir.PrecisionCast) if node.op == "call_function" else None
        if cast is not None:
            dtype = str(ir.require(node, ir.ValueMeta).tensor.dtype).removeprefix("torch.")
            key = {
                ir.CastRole.PARAMETER: "compute_dtype",
                ir.CastRole.TO_REDUCE: "reduce_dtype",
                ir.CastRole.FROM_REDUCE: "master_dtype",
            }[cast.role]
            found.setdefault(key, dtype)
    remat = program.get(ir.Rematerialized)
    if remat is not None and remat.recomputed_ops:
        found["recomputed_layers"] = list(remat.layers)
        found["checkpoint_calls"] = len(remat.checkpoint_calls)
        found["recomputed_ops"] = remat.recomputed_ops
    return found


def _precision_and_remat_lines(header: Mapping[str, Any]) -> list[str]:
    lines = []
    if "compute_dtype" in header:
        reduce = header.get("reduce_dtype", header["compute_dtype"])
        lines.append(
            f"precision       {header['compute_dtype']} compute, "
            f"{header.get('master_dtype', reduce)} master weights, gradients summed in {reduce}"
        )
    if "recomputed_ops" in header:
        layers = header["recomputed_layers"]
        shown = ", ".join(layers[:4]) + (", ..." if len(layers) > 4 else "")
        lines.append(
            f"recomputed      {header['recomputed_ops']} forward ops again in the backward: "
            f"{len(layers)} layers{' (' + shown + ')' if layers else ''}, "
            f"{header['checkpoint_calls']} torch.utils.checkpoint calls"
        )
    return lines


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f}"


def _collapse(rows: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    """Runs of consecutive identical numbered layers as one row each, with its label."""
    groups: list[list[dict[str, Any]]] = []
    for row in rows:
        previous = groups[-1][-1] if groups else None
        if (
            previous is not None
            and _layer_class(row["name"]) == _layer_class(previous["name"]) != row["name"]
            and _same_layer(row, previous)
        ):
            groups[-1].append(row)
        else:
            groups.append([row])
    labelled = []
    for group in groups:
        first, last = group[0]["name"], group[-1]["name"]
        if len(group) == 1:
            labelled.append((first, group[0]))
        else:
            layer = cost.numbered_layer(last)
            assert layer is not None  # only numbered layers are collapsed
            span = f"{first}-{layer.index}"
            labelled.append((f"{span} (x{len(group)}, identical)", group[0]))
    return labelled


def _same_layer(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    def shape(row: Mapping[str, Any]) -> tuple[object, ...]:
        output = row["output"] or {}
        return (
            row["weights"], output.get("spec"), output.get("shape"), row["compute_seconds"],
            row["collectives"], row["memory"],
        )  # fmt: skip

    return shape(a) == shape(b)


def render_text(data: Mapping[str, Any], width: int = 100) -> str:
    """``Plan.report()``: the header, then one row per layer (identical consecutive layers
    collapsed) with its collectives by kind and its weights' placements underneath, then the
    totals."""
    header = data["header"]
    axis_names = header["axis_names"]
    gap = "" if header["gap"] is None else f", gap {header['gap']:.2g}"
    limit = header["memory_limit_bytes"]
    memory = header["memory"]
    used = header["memory_bytes"]
    share = f" ({100 * used / limit:.1f}%)" if limit else ""
    pad = " " * 16
    lag = header.get("lag_seconds", 0.0)
    # The optimizer's update and the buckets' copies: compute outside the graph's ops.
    outside = header.get("update_seconds", 0.0) + header.get("copy_seconds", 0.0)
    lines = [
        f"plan: {header['solver']}, {header['status']}{gap}, on {header['cluster']}",
        f"estimated step  {_ms(header['estimated_seconds'])} ms: compute "
        f"{_ms(header['compute_seconds'])} ms + communication "
        f"{_ms(header['estimated_seconds'] - header['compute_seconds'] - outside)} ms as lowered"
        + (f" + update and copies {_ms(outside)} ms" if outside else ""),
        f"solver's price  {_ms(header['objective_seconds'])} ms: communication "
        f"{_ms(header['communication_seconds'])} ms priced edge by edge",
        f"collectives     {header['collectives']} as lowered, {_size(header['collective_bytes'])}"
        f" and {_ms(header['collective_seconds'])} ms per device,",
        f"{pad}{_ms(header['hidden_seconds'])} ms of it behind compute and "
        f"{_ms(header['exposed_seconds'])} ms exposed: step "
        f"{_ms(header['compute_seconds'] + outside + header['exposed_seconds'] + lag)}"
        " ms if overlapped",
        *_hidden_line(header, pad),
        *_lag_line(header, pad),
        f"memory          {_size(used)} per device of {_size(limit or 0)} allowed{share}:",
        pad + ", ".join(f"{kind} {_size(memory[kind])}" for kind in MEMORY_KINDS),
        f"peak            {_size(header['peak_bytes'])} per device at once (at "
        f"{header['peak_at']}), {_size(header['peak_input_bytes'])} of it the inputs;",
        *_wrap(
            ["largest besides:"]
            + [f"{name} {_size(nbytes)}" for name, nbytes in header["peak_largest"]],
            width,
            pad,
        ),
        f"graph           {header['graph_nodes']} nodes, {header['decision_nodes']} decisions, "
        f"{header['layers_merged']} merged with repeated layers",
        *_precision_and_remat_lines(header),
        "",
    ]
    body: list[tuple[str, ...]] = []
    details: list[list[str]] = []
    for label, row in _collapse(list(data["layers"])):
        body.append(_cells(label, row))
        details.append(_details(row, axis_names, width))
    totals = _merged_collectives(data["layers"])
    total: dict[str, Any] = {
        "compute_seconds": header["compute_seconds"],
        "collectives": totals,
        "memory": memory,
        "output": None,
    }
    footer = _cells("total", total)
    widths = [max(len(c) for c in column) for column in zip(_COLUMNS, *body, footer, strict=True)]

    def render(cells: tuple[str, ...]) -> str:
        parts = [
            cell.ljust(w) if i in _LEFT else cell.rjust(w)
            for i, (cell, w) in enumerate(zip(cells, widths, strict=True))
        ]
        return "  ".join(parts).rstrip()

    rule = "  ".join("-" * w for w in widths)
    lines += [render(_COLUMNS), rule]
    for cells, extra in zip(body, details, strict=True):
        lines.append(render(cells))
        lines += extra
    lines += [rule, render(footer)]
    lines += _wrap(["collectives:", *_kinds(totals, axis_names)], width, _INDENT)
    legend = "AG all-gather, AR all-reduce, RS reduce-scatter, A2A all-to-all, "
    if any(c["kind"] == "all_to_all_rows" for c in totals):
        legend += "A2Av all-to-all of routed rows, "
    lines += [
        "",
        "Per device. A collapsed row shows one of its layers; the total counts all of them.",
        legend + "(mesh axis).",
    ]
    if data.get("no_rule"):
        ops = [f"{op} x{count}" for op, count in data["no_rule"].items()]
        lines += _wrap(["run replicated (no sharding rule):", *ops], width, "")
    return "\n".join(lines)


def _kinds(collectives: Iterable[Mapping[str, Any]], axis_names: list[str]) -> list[str]:
    return [
        f"{c['count']} {SHORT_KIND.get(c['kind'], c['kind'])}({axis_names[c['axis']]})"
        for c in collectives
    ]


def _details(row: Mapping[str, Any], axis_names: list[str], width: int) -> list[str]:
    """The lines under a row: its collectives by kind and axis, its weights' placements."""
    lines = []
    if row["collectives"]:
        lines += _wrap(["collectives:", *_kinds(row["collectives"], axis_names)], width, _INDENT)
    if row["weights"]:
        weights = [f"{name} {spec}" for name, spec in row["weights"].items()]
        lines += _wrap(["weights:", *weights], width, _INDENT)
    return lines


def _merged_collectives(rows: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    merged: dict[tuple[str, int], dict[str, Any]] = {}
    for row in rows:
        for entry in row["collectives"]:
            key = (entry["kind"], entry["axis"])
            into = merged.setdefault(key, {**entry, "count": 0, "bytes": 0, "seconds": 0.0})
            into["count"] += entry["count"]
            into["bytes"] += entry["bytes"]
            into["seconds"] += entry["seconds"]
    return [merged[key] for key in sorted(merged)]


def _cells(label: str, row: Mapping[str, Any]) -> tuple[str, ...]:
    collectives = row["collectives"]
    output = row["output"]
    shown = "-" if output is None else f"{output['spec']} {output['shape']}"
    return (
        label,
        _ms(row["compute_seconds"]),
        str(sum(c["count"] for c in collectives)) if collectives else "-",
        _size(sum(c["bytes"] for c in collectives)) if collectives else "-",
        _ms(sum(c["seconds"] for c in collectives)) if collectives else "-",
        _size(sum(row["memory"].values())),
        shown,
    )


def _wrap(items: list[str], width: int, indent: str) -> list[str]:
    """``items`` on lines of at most ``width`` columns; continuation lines indent further."""
    lines: list[str] = []
    current = ""
    for item in items:
        candidate = f"{current}  {item}" if current else indent + item
        if current and len(candidate) > width:
            lines.append(current)
            candidate = indent * 2 + item
        current = candidate
    if current:
        lines.append(current)
    return lines


# -- picture ------------------------------------------------------------------------------------


def plot(data: Mapping[str, Any], path: str | Path) -> Path:
    """A PNG: memory per rank by kind against the limit, and communication time per layer by
    collective kind and mesh axis. Needs matplotlib (``pip install "fxpar[plot]"``)."""
    try:
        import matplotlib

        matplotlib.use("Agg", force=False)
        import matplotlib.pyplot as plt
    except ImportError as error:
        raise FxparError(
            'Plan.plot needs matplotlib: pip install "fxpar[plot]" (or use Plan.report() for '
            "the same numbers as text)"
        ) from error
    header = data["header"]
    devices = data["devices"]
    layers = list(data["layers"])
    figure, (memory_axes, comm_axes) = plt.subplots(
        1, 2, figsize=(6 + 0.25 * len(layers), 4.5), width_ratios=(1, 2.5)
    )
    try:
        ranks = [str(tuple(device["coordinate"])) for device in devices]
        most = max((sum(device["memory"].values()) for device in devices), default=0.0)
        unit, scale = next(
            ((u, f) for u, f in (("GiB", 2**30), ("MiB", 2**20)) if most >= f), ("KiB", 2**10)
        )
        bottom = [0.0] * len(devices)
        for kind in MEMORY_KINDS:
            values = [device["memory"][kind] / scale for device in devices]
            memory_axes.bar(ranks, values, bottom=bottom, label=kind)
            bottom = [b + v for b, v in zip(bottom, values, strict=True)]
        limit = header["memory_limit_bytes"]
        if limit and limit <= 4 * most:
            memory_axes.axhline(limit / scale, color="black", linestyle="--", label="limit")
        title = "memory per device"
        if limit and limit > 4 * most:
            # A limit far above the bars would squash them flat: say it instead of drawing it.
            title += f"\n(limit {_size(limit)}, off scale)"
        memory_axes.set_title(title)
        memory_axes.set_xlabel("device (mesh coordinate)")
        memory_axes.set_ylabel(unit)
        memory_axes.tick_params(axis="x", labelrotation=90)
        memory_axes.legend(fontsize="small")

        names = [layer["name"] for layer in layers]
        keys = sorted({(c["kind"], c["axis"]) for layer in layers for c in layer["collectives"]})
        bottom = [0.0] * len(layers)
        for kind, axis in keys:
            values = [
                sum(
                    c["seconds"] * 1e3
                    for c in layer["collectives"]
                    if (c["kind"], c["axis"]) == (kind, axis)
                )
                for layer in layers
            ]
            label = f"{SHORT_KIND.get(kind, kind)} ({header['axis_names'][axis]})"
            comm_axes.bar(names, values, bottom=bottom, label=label)
            bottom = [b + v for b, v in zip(bottom, values, strict=True)]
        if not keys:
            comm_axes.bar(names, [0.0] * len(names))
            comm_axes.text(0.5, 0.5, "no collectives", ha="center", transform=comm_axes.transAxes)
        else:
            comm_axes.legend(fontsize="small")
        comm_axes.set_title("communication per layer (estimated, per device)")
        comm_axes.set_ylabel("ms")
        comm_axes.tick_params(axis="x", labelrotation=90)
        figure.suptitle(f"{header['solver']} plan on {header['cluster']}", fontsize="medium")
        figure.tight_layout()
        target = Path(path)
        figure.savefig(target, format="png", dpi=100)
    finally:
        plt.close(figure)
    return target


__all__ = [
    "MEMORY_KINDS",
    "PricedSchedule",
    "compact_spec",
    "layer_namer",
    "plan_collectives",
    "plot",
    "price_schedule",
    "render_text",
    "report_data",
]
