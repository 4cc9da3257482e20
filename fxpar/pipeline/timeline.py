"""Reading a pipelined step: idle (bubble) fraction per device and a Gantt chart.

Every rank records its instructions' start and end times (:class:`~.executor.StageTrace`);
gather the traces of all ranks (e.g. as :func:`fxpar.runtime.launch.spawn`'s return values)
and pass them here. Times are ``time.perf_counter`` values, one clock for all processes of one
machine; traces from several machines would need their clocks aligned first.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from fxpar.pipeline.executor import StageTrace
from fxpar.pipeline.options import PipelineError

_COLORS = {
    "forward": "#4C72B0",
    "backward": "#DD8452",
    "backward_input": "#DD8452",
    "backward_weight": "#55A868",
}


def step_window(traces: Sequence[StageTrace]) -> tuple[float, float]:
    """The step as all ranks saw it: from the first start to the last end."""
    return min(t.start for t in traces), max(t.end for t in traces)


def bubble_fractions(traces: Sequence[StageTrace]) -> list[float]:
    """Per rank, the part of the whole step's wall time it spent not running a forward or a
    backward (waiting for a neighbour, or sending): the measured pipeline bubble. The ideal
    for ``K`` stages of equal cost and ``M`` micro-batches is ``(K-1)/(M+K-1)``, with ``V``
    interleaved chunks per stage ``(K-1)/(V M+K-1)`` (:func:`ideal_bubble`)."""
    start, end = step_window(traces)
    return [trace.idle_fraction(start, end) for trace in traces]


def ideal_bubble(num_stages: int, num_microbatches: int, virtual_stages: int = 1) -> float:
    """The idle share of a step of ``K`` stages of equal cost over ``M`` micro-batches:
    ``(K-1)/(M+K-1)``. With ``V`` chunks per stage (interleaved 1F1B) each chunk is ``1/V``
    of a stage, and the fill and drain take ``K-1`` chunk slots of ``V M + K - 1``."""
    slots = virtual_stages * num_microbatches
    return (num_stages - 1) / (slots + num_stages - 1)


def plot_timeline(
    traces: Sequence[StageTrace], path: str | os.PathLike[str], *, title: str = ""
) -> None:
    """Write a Gantt chart of one step: a row per rank, a bar per forward (blue) and backward
    (orange; a zero-bubble schedule's B orange and W green) labelled with its micro-batch
    (and ``/c`` its chunk, for chunks after a stage's first); gaps are the bubble. Needs
    matplotlib (``pip install fxpar[plot]``)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError as error:  # pragma: no cover - depends on the environment
        raise PipelineError("plot_timeline needs matplotlib: pip install 'fxpar[plot]'") from error
    start, end = step_window(traces)
    ordered = sorted(traces, key=lambda t: t.rank)
    figure, axes = plt.subplots(figsize=(12, 0.6 * len(ordered) + 1.5))
    for row, trace in enumerate(ordered):
        for event in trace.events:
            color = _COLORS.get(event.op)
            if color is None:
                continue
            left, width = (event.start - start) * 1e3, (event.end - event.start) * 1e3
            axes.barh(row, width, left=left, height=0.8, color=color, edgecolor="black", lw=0.3)
            if width > (end - start) * 1e3 / 80:
                axes.text(
                    left + width / 2,
                    row,
                    f"{event.microbatch}/{event.chunk}" if event.chunk else str(event.microbatch),
                    ha="center",
                    va="center",
                    fontsize=7,
                    color="white",
                )
    axes.set_yticks(range(len(ordered)))
    axes.set_yticklabels([f"rank {t.rank} (stage {t.stage})" for t in ordered])
    axes.invert_yaxis()
    axes.set_xlabel("time in step (ms)")
    axes.set_title(title or "pipeline timeline")
    shown = {event.op for trace in ordered for event in trace.events}
    handles = [Patch(color=c, label=op) for op, c in _COLORS.items() if op in shown]
    # Outside the axes, right of them: inside, it hid the last stage's final bars.
    axes.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    figure.tight_layout()
    figure.savefig(os.fspath(path), dpi=120)
    plt.close(figure)
