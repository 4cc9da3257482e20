"""Pipeline parallelism on CPU gloo: bubble, throughput, activation memory, and fxpar beside
``torch.distributed.pipelining``.

For K in {2, 4} stages (one process per stage) and M in {1, 4, 8, 32} micro-batches of a fixed
global batch, one run prints, for 1F1B, (where K divides M) interleaved 1F1B with V=2 model
chunks per stage, and the zero-bubble schedules ZB-H1 (one chunk per stage) and ZB-V (two
chunks per stage in a V):

- the measured idle (bubble) fraction of every device during a step, beside the bubble the
  schedule's own order makes with equal stages and free messages (``modelled_bubble``, forward,
  B and W one unit each): ``(K-1)/(M+K-1)`` for 1F1B, ``(K-1)/(V M+K-1)`` interleaved,
  ``(K-1)/(3M+K-1)`` for ZB-H1, ``(K-1)/(6M+K-1)`` for ZB-V with ``M >= 2K-1``;
- throughput normalized to K=1 (one process running the same M micro-batches one after the
  other), i.e. the pipeline's speedup;
- the peak bytes of saved activations on the busiest stage, without and with remat;
- fxpar's step time and ``torch.distributed.pipelining``'s (same model, stages, micro-batches,
  schedule, on the same processes), and their ratio, both without checking the batch (torch
  does not); and fxpar's step time with its default check that every rank holds the same
  batch. torch's schedules: ``Schedule1F1B`` (``ScheduleGPipe`` where M < K, which its 1F1B
  refuses); ``ScheduleInterleaved1F1B`` over the same 2K chunks; for ZB-H1,
  ``ScheduleInterleavedZeroBubble`` with one stage per rank (torch's ZB1P, the paper's ZB-H1
  order when each rank holds one stage; torch has no single-stage zero-bubble class); for
  ZB-V, ``ScheduleZBVZeroBubble`` over the same 2K chunks in a V (rank r holding chunks r and
  2K-1-r, as fxpar places them). torch splits each backward into B and W with autograd at run
  time, fxpar on the captured graph (``fxpar/pipeline/backward_split.py``).

After the table, one line per (K, M) sets ZB-H1's and ZB-V's mean measured bubble beside
1F1B's. It also writes Gantt charts of one step of each schedule at K=4, M=8
(``--timeline-case`` changes which) as PNGs; ZB schedules draw B orange and W green.

Steps are forward+backward+gradient reduction without the optimizer update, for both
runtimes, whose steps alternate (one of each kind in turn) so that both see the same load on a
shared machine. Every process uses one thread; with more processes than cores (K=4 on a 2-core
machine) stages share cores, which shows as extra idle time and caps the speedup.

    python benchmarks/pipeline.py [--steps 6] [--timeline pipeline_{schedule}.png]
        [--stages 2 4] [--microbatches 1 4 8 32] [--schedules 1f1b interleaved zb-h1 zb-v]
        [--timeline-case 4 8]

A smoke run (about a minute): ``--stages 2 --microbatches 4 --schedules 1f1b zb-h1 zb-v
--steps 1 --timeline-case 2 4``.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fxpar.models import GPT, GPTConfig, gpt_loss
from fxpar.optim import SGD
from fxpar.pipeline import (
    Pipeline,
    PipelineModel,
    bubble_fractions,
    build_schedule,
    modelled_bubble,
    plot_timeline,
)
from fxpar.pipeline.executor import StageTrace
from fxpar.pipeline.schedule import virtual_stage
from fxpar.pipeline.schedules import default_schedules
from fxpar.runtime import fastcall
from fxpar.runtime.launch import spawn

CONFIG = GPTConfig(
    n_layer=8, n_embd=128, n_head=4, vocab_size=256, block_size=32, tie_weights=False
)
BATCH, LENGTH = 32, 32
MICROBATCHES = (1, 4, 8, 32)
STAGES = (2, 4)
TIMELINE_CASE = (4, 8)
CHUNKS = 2  # model chunks per stage in the interleaved rows
SCHEDULES = ("1f1b", "interleaved", "zb-h1", "zb-v")
NAMES = {
    "1f1b": "1F1B",
    "interleaved": f"interleaved 1F1B (V={CHUNKS})",
    "zb-h1": "ZB-H1",
    "zb-v": "ZB-V (2 chunks per stage in a V)",
}


@dataclass(frozen=True)
class Settings:
    """What one run measures: the stage counts, micro-batch counts and schedules of its rows,
    the timed steps per row, and the (K, M) whose steps are drawn."""

    stages: tuple[int, ...] = STAGES
    microbatches: tuple[int, ...] = MICROBATCHES
    schedules: tuple[str, ...] = SCHEDULES
    steps: int = 6
    timeline_case: tuple[int, int] = TIMELINE_CASE


@dataclass
class RankRow:
    """One rank's measurements for one (K, M, schedule)."""

    schedule: str
    count: int
    fxpar_seconds: float
    checked_seconds: float
    torch_seconds: float
    peak_stash: int
    peak_stash_remat: int
    trace: StageTrace


def _build() -> tuple[GPT, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = GPT(CONFIG)
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, CONFIG.vocab_size, (BATCH, LENGTH), generator=generator)
    targets = torch.randint(0, CONFIG.vocab_size, (BATCH, LENGTH), generator=generator)
    return model, tokens, targets


def _split_points(num_stages: int) -> tuple[str, ...]:
    per_stage = CONFIG.n_layer // num_stages
    return tuple(f"blocks.{k * per_stage}" for k in range(1, num_stages))


class _TorchStage(nn.Module):
    """The same cut of GPT as fxpar's split points, as a module for torch's pipelining."""

    def __init__(self, model: GPT, stage: int, num_stages: int) -> None:
        super().__init__()
        per_stage = CONFIG.n_layer // num_stages
        self.first, self.last = stage == 0, stage == num_stages - 1
        self.wte = copy.deepcopy(model.wte) if self.first else None
        self.wpe = copy.deepcopy(model.wpe) if self.first else None
        blocks = model.blocks[stage * per_stage : (stage + 1) * per_stage]
        self.blocks = nn.ModuleList(copy.deepcopy(b) for b in blocks)
        self.ln_f = copy.deepcopy(model.ln_f) if self.last else None
        self.head = copy.deepcopy(model.head) if self.last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.wte is not None and self.wpe is not None:
            positions = torch.arange(x.shape[1])
            x = self.wte(x) + self.wpe(positions)
        for block in self.blocks:
            x = block(x)
        if self.ln_f is not None and self.head is not None:
            x = self.head(self.ln_f(x))
        return x


def _timed(*runs: Any, steps: int, warmup: int = 1) -> list[float]:
    """The median step time of each of ``runs``, timed in turn (one step of each, then the
    next round), so that all see the same machine load, which drifts on a shared machine; each
    round starts one further along, so none always runs first or after the same other (a step
    right after another runtime's is slower). After ``warmup`` untimed steps of each
    (first-call allocations, lazy initialization, fxpar's fast copies of its programs)."""
    for _ in range(warmup):
        for step in runs:
            step()
    times: list[list[float]] = [[] for _ in runs]
    for round_ in range(steps):
        for index in range(len(runs)):
            index = (index + round_) % len(runs)
            if dist.is_initialized():
                dist.barrier()
            start = time.perf_counter()
            runs[index]()
            times[index].append(time.perf_counter() - start)
    return [statistics.median(taken) for taken in times]


def _chunks(schedule: str) -> int:
    """Model chunks per stage: V for interleaved 1F1B, two for ZB-V's V, else one."""
    return CHUNKS if schedule == "interleaved" else 2 if schedule == "zb-v" else 1


def _chunks_of(rank: int, world_size: int, schedule: str) -> list[int]:
    """The model chunks ``rank`` holds, in its order: looped (``r, r+K, ...``), or for ZB-V
    in a V (``r`` and ``2K-1-r``), as fxpar places them."""
    placement = default_schedules()[schedule].placement
    return [virtual_stage(rank, chunk, world_size, placement) for chunk in range(_chunks(schedule))]


def _modelled(num_stages: int, count: int, schedule: str) -> float:
    """The mean bubble the schedule's order makes with forward, B and W one unit each and
    messages free (:func:`fxpar.pipeline.modelled_bubble`)."""
    lists = build_schedule(schedule, num_stages, count, _chunks(schedule))  # type: ignore[arg-type]
    placement = default_schedules()[schedule].placement
    return statistics.mean(modelled_bubble(lists, placement=placement))


def _fxpar_model(
    num_stages: int, count: int, schedule: str, remat: bool
) -> tuple[PipelineModel, Any]:
    model, tokens, targets = _build()
    chunks = _chunks(schedule)
    pipeline = Pipeline(
        stages=_split_points(num_stages * chunks),
        microbatches=count,
        schedule=schedule,  # type: ignore[arg-type]
        remat=remat,
        virtual_stages=chunks,
    )
    pipelined = PipelineModel(
        model, pipeline, (tokens,), gpt_loss, example_targets=(targets,), optimizer=SGD()
    )
    return pipelined, lambda: pipelined.compute_gradients(tokens, targets)


def _measure(rank: int, world_size: int, settings: Settings) -> list[RankRow]:
    torch.set_num_threads(1)
    steps = settings.steps
    rows = []
    for count, schedule in _cases(world_size, settings):
        pipelined, step = _fxpar_model(world_size, count, schedule, remat=False)
        torch_step = _torch_step(rank, world_size, count, schedule)
        # torch checks nothing of the batch: fxpar's ranks-hold-the-same-batch check (one
        # all-gather per step) is timed apart.
        fxpar_seconds, checked_seconds, torch_seconds = _timed(
            _unchecked(pipelined, step), step, torch_step, steps=steps, warmup=_warmup(2 * count)
        )
        trace = pipelined.trace
        assert trace is not None
        remat, remat_step = _fxpar_model(world_size, count, schedule, remat=True)
        remat_step()
        assert remat.trace is not None
        rows.append(
            RankRow(
                schedule=schedule,
                count=count,
                fxpar_seconds=fxpar_seconds,
                checked_seconds=checked_seconds,
                torch_seconds=torch_seconds,
                peak_stash=trace.peak_stash_bytes,
                peak_stash_remat=remat.trace.peak_stash_bytes,
                trace=trace,
            )
        )
    return rows


def _warmup(calls_per_round: int) -> int:
    """Untimed rounds enough for every unit to reach the steady state of a long training: the
    runtime runs a program's fast copy only once it has run ``COPY_AFTER_CALLS`` times, and a
    round runs each unit ``calls_per_round`` times (once per micro-batch of each fxpar step)."""
    return max(1, -(-(fastcall.COPY_AFTER_CALLS + 1) // calls_per_round))


def _unchecked(pipelined: PipelineModel, step: Any) -> Any:
    """``step`` without the check that every rank holds the same batch."""

    def run() -> None:
        pipelined.check_batches = False
        try:
            step()
        finally:
            pipelined.check_batches = True

    return run


def _cases(num_stages: int, settings: Settings) -> list[tuple[int, str]]:
    """(M, schedule) in the order they run and print: interleaving needs K to divide M."""
    return [
        (count, schedule)
        for count in settings.microbatches
        for schedule in settings.schedules
        if schedule != "interleaved" or count % num_stages == 0
    ]


def _torch_step(rank: int, world_size: int, count: int, schedule: str) -> Any:
    """One step of ``torch.distributed.pipelining`` on this rank's stages, as a function."""
    from torch.distributed.pipelining import PipelineStage

    model, tokens, targets = _build()
    pieces = world_size * _chunks(schedule)
    chunks = _chunks_of(rank, world_size, schedule)
    modules = [_TorchStage(model, chunk, pieces) for chunk in chunks]
    stages = [
        PipelineStage(module, chunk, pieces, torch.device("cpu"))
        for chunk, module in zip(chunks, modules, strict=True)
    ]
    runner = _torch_schedule(schedule, stages, count, world_size)

    def step() -> None:
        for module in modules:
            module.zero_grad(set_to_none=True)
        arguments: dict[str, Any] = {}
        if 0 in chunks:
            arguments["args"] = (tokens,)
        if pieces - 1 in chunks:
            arguments.update(target=targets, losses=[])
        runner.step(*arguments.pop("args", ()), **arguments)

    return step


def _torch_schedule(schedule: str, stages: list[Any], count: int, world_size: int) -> Any:
    """torch's schedule closest to fxpar's ``schedule`` over this rank's ``stages``."""
    from torch.distributed.pipelining import (
        Schedule1F1B,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
        ScheduleInterleavedZeroBubble,
        ScheduleZBVZeroBubble,
    )

    if schedule == "interleaved":
        return ScheduleInterleaved1F1B(stages, count, loss_fn=gpt_loss)
    if schedule == "zb-h1":
        # ZB1P with one stage per rank: torch's ZB-H1.
        return ScheduleInterleavedZeroBubble(stages, count, loss_fn=gpt_loss)
    if schedule == "zb-v":
        return ScheduleZBVZeroBubble(stages, count, loss_fn=gpt_loss)
    # torch's 1F1B refuses M < K; with a single micro-batch both are the same order.
    kind = Schedule1F1B if count >= world_size else ScheduleGPipe
    return kind(stages[0], count, loss_fn=gpt_loss)


def _single_device_seconds(count: int, steps: int) -> float:
    torch.set_num_threads(1)
    model, tokens, targets = _build()
    pipelined = PipelineModel(
        model,
        Pipeline(stages=1, microbatches=count),
        (tokens,),
        gpt_loss,
        example_targets=(targets,),
        optimizer=SGD(),
    )
    (seconds,) = _timed(
        lambda: pipelined.compute_gradients(tokens, targets), steps=steps, warmup=_warmup(count)
    )
    return seconds


def _settings() -> tuple[Settings, str]:
    """The run's settings and the timeline path pattern, from the command line."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=6, help="timed steps per case (median)")
    parser.add_argument(
        "--timeline", default="pipeline_{schedule}.png", help="PNG path, {schedule} filled in"
    )
    parser.add_argument("--stages", type=int, nargs="+", default=list(STAGES), help="K values")
    parser.add_argument(
        "--microbatches", type=int, nargs="+", default=list(MICROBATCHES), help="M values"
    )
    parser.add_argument(
        "--schedules", nargs="+", choices=SCHEDULES, default=list(SCHEDULES), help="schedules"
    )
    parser.add_argument(
        "--timeline-case",
        type=int,
        nargs=2,
        default=list(TIMELINE_CASE),
        metavar=("K", "M"),
        help="the stages and micro-batches whose step is drawn, for every schedule",
    )
    args = parser.parse_args()
    settings = Settings(
        stages=tuple(args.stages),
        microbatches=tuple(args.microbatches),
        schedules=tuple(s for s in SCHEDULES if s in args.schedules),
        steps=args.steps,
        timeline_case=(args.timeline_case[0], args.timeline_case[1]),
    )
    return settings, args.timeline


def _print_row(
    num_stages: int, count: int, schedule: str, rows: Sequence[RankRow], single: float
) -> float:
    """Print one (K, M, schedule) row from every rank's measurements (``single``: the K=1
    step time at the same M); its mean bubble."""
    bubbles = bubble_fractions([row.trace for row in rows])
    fxpar_seconds = max(row.fxpar_seconds for row in rows)
    torch_seconds = max(row.torch_seconds for row in rows)
    checked_seconds = max(row.checked_seconds for row in rows)
    print(
        f"{num_stages:>2} {count:>3} {schedule:<11} | "
        f"{' '.join(f'{b:.2f}' for b in bubbles):<30} "
        f"{statistics.mean(bubbles):>5.2f} {_modelled(num_stages, count, schedule):>5.2f} | "
        f"{single / fxpar_seconds:>6.2f}x | "
        f"{max(r.peak_stash for r in rows) / 1024:>9.0f} "
        f"{max(r.peak_stash_remat for r in rows) / 1024:>9.0f} | "
        f"{fxpar_seconds * 1e3:>8.1f} {torch_seconds * 1e3:>8.1f} "
        f"{fxpar_seconds / torch_seconds:>5.2f} | {checked_seconds * 1e3:>8.1f}"
    )
    return statistics.mean(bubbles)


def _print_bubbles(bubbles: dict[tuple[int, int, str], float]) -> None:
    """One line per (K, M) that ran 1F1B and a zero-bubble schedule: their mean measured
    bubbles side by side, and whether each zero-bubble one is below 1F1B's."""
    for (num_stages, count, schedule), base in bubbles.items():
        if schedule != "1f1b":
            continue
        others = [
            f"{s} {bubbles[num_stages, count, s]:.2f} "
            f"({'below' if bubbles[num_stages, count, s] < base else 'NOT below'})"
            for s in ("zb-h1", "zb-v")
            if (num_stages, count, s) in bubbles
        ]
        if others:
            print(f"K={num_stages} M={count}: 1f1b {base:.2f}, " + ", ".join(others))


def main() -> None:
    settings, timeline = _settings()
    single = {
        count: _single_device_seconds(count, settings.steps) for count in settings.microbatches
    }
    print(
        f"GPT {CONFIG.n_layer} layers, width {CONFIG.n_embd}, batch {BATCH}x{LENGTH} tokens, "
        f"{', '.join(NAMES[s] for s in settings.schedules)}, CPU gloo, 1 thread per process, "
        f"{settings.steps} timed steps (median)"
    )
    header = (
        f"{'K':>2} {'M':>3} {'schedule':<11} | {'bubble per device (measured)':<30} "
        f"{'mean':>5} {'model':>5} | "
        f"{'speedup':>7} | {'stash KiB':>9} {'remat KiB':>9} | {'fxpar ms':>8} "
        f"{'torch ms':>8} {'ratio':>5} | {'checked':>8}"
    )
    print(header)
    print("-" * len(header))
    bubbles: dict[tuple[int, int, str], float] = {}
    drawn = []
    for num_stages in settings.stages:
        per_rank = spawn(_measure, num_stages, settings)
        for index, (count, schedule) in enumerate(_cases(num_stages, settings)):
            rows = [ranks[index] for ranks in per_rank]
            bubbles[num_stages, count, schedule] = _print_row(
                num_stages, count, schedule, rows, single[count]
            )
            if (num_stages, count) == settings.timeline_case:
                path = timeline.format(schedule=schedule)
                plot_timeline(
                    [row.trace for row in rows],
                    path,
                    title=f"fxpar {NAMES[schedule]}, K={num_stages} stages, M={count} "
                    "micro-batches",
                )
                drawn.append(path)
    print(
        "\nbubble: idle share of the step's wall time per device; model: the mean bubble of the "
        "schedule's order with forward, B and W one unit each and free messages "
        "(modelled_bubble: (K-1)/(M+K-1) for 1F1B, (K-1)/(2M+K-1) interleaved, (K-1)/(3M+K-1) "
        "ZB-H1, (K-1)/(6M+K-1) ZB-V from M >= 2K-1); "
        "speedup: K=1 step time at the same M / this step time; stash: peak saved-activation "
        "bytes on the busiest stage (under ZB, with what B keeps for W); ratio: fxpar / "
        "torch.distributed.pipelining step time, "
        "both checking nothing of the batch (checked: fxpar's step time with its default "
        "check that every rank holds the same batch, one all-gather per step) "
        "(torch's Schedule1F1B, ScheduleGPipe where M < K, which its Schedule1F1B refuses; "
        "ScheduleInterleaved1F1B for interleaved; ScheduleInterleavedZeroBubble with one stage "
        "per rank for zb-h1; ScheduleZBVZeroBubble for zb-v)"
    )
    print("\nmean measured bubble, zero-bubble schedules beside 1F1B at the same K and M:")
    _print_bubbles(bubbles)
    if drawn:
        case = settings.timeline_case
        print(f"timelines of a step (K={case[0]}, M={case[1]}): {', '.join(drawn)}")


if __name__ == "__main__":
    main()
