"""Pipeline schedules as static instruction lists, one per stage.

A stage's list says, in order, what it does with each micro-batch ``m``: receive its input
activations, run its forward, send its activations on, receive the gradients of its outputs,
run its backward, send the gradients of its inputs back, and free what it stashed. Every
replica of a stage runs the same list. Sends never block (the runtime posts them and waits at
the end of the step); receives block, so a list is correct when, with every rank running its
own list, each receive eventually finds its message: :func:`simulate` checks exactly that.

GPipe runs all ``M`` forwards, then all backwards in the same order (micro-batch 0 first), so
stage ``s`` holds the stash of all ``M`` micro-batches at once. 1F1B (PipeDream-flush) lets
stage ``s`` run ``K - s - 1`` warm-up forwards, then alternates one forward and one backward,
and ends with the remaining backwards: at most ``min(K - s, M)`` stashes are alive, for the
same bubble ``(K-1)/(M+K-1)`` when forward and backward times are equal across stages.

Interleaved 1F1B (Megatron-LM's) cuts the model into ``K V`` chunks and gives stage ``s`` the
``V`` chunks ``s, s + K, ..., s + (V-1) K``: an instruction names its chunk (the local index
``c``; its place in the model, the *virtual stage*, is ``c K + s``), and a message from the
last stage's chunk ``c`` goes to stage 0's chunk ``c + 1``. Each stage runs forwards in groups
of ``K`` micro-batches, cycling through its chunks (micro-batches ``0..K-1`` on chunk 0, the
same on chunk 1, ..., then ``K..2K-1`` on chunk 0), and backwards in the same groups from its
last chunk down, with ``(V-1) K + 2 (K-s-1)`` warm-up forwards, then one forward and one
backward in turn. A chunk is ``1/V`` of a stage's work, so the fill and drain shrink ``V``
times: the bubble is about ``(K-1)/(V M + K-1)``, for ``V`` times more messages.

**Zero-bubble schedules** (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024) split each
backward in two: ``backward_input`` (B, the gradients of what the stage received, which the
previous stage waits for) and ``backward_weight`` (W, the gradients of the stage's weights, which
nobody waits for), so W can be moved into the gaps the pipeline would otherwise idle in. A W
follows the B of its micro-batch and chunk, and the stash is freed after the W (only what W
reads need stay from B to W: :mod:`.backward_split`). With forward, B and W taking equal time:

- ZB-H1 is 1F1B with W delayed: stage ``s`` runs the warm-up and the one-forward-one-B order of
  1F1B, but the W of micro-batch ``m`` only after the B of micro-batch ``m + s``, and the W's left
  at the end after its last B. Every stage keeps at most ``K`` stashes, stage 0's 1F1B peak (so
  1F1B's memory), the later stages' W's fill the drain, and every stage ends at once: the
  bubble is ``(K-1)/(3 M + K-1)``, a third of 1F1B's idle time.
- ZB-V gives stage ``s`` two chunks in a V: chunk 0 is virtual stage ``s`` and chunk 1 virtual
  stage ``2K-1-s`` (:data:`Placement` ``"v"``), so the last stage's chunk 0 sends to its own
  chunk 1 and stage 0 computes both the first and the last chunk (the loss). Per stage:
  ``2(K-s)-1`` forwards of chunk 0; ``s`` pairs (forward chunk 1, forward chunk 0); ``K-s``
  triples (forward, B, W) of chunk 1; then rounds of (forward chunk 0 while any is left, B and
  W of chunk 0, forward, B and W of chunk 1) until every forward has run; then ``s`` pairs (B
  chunk 0, B chunk 1), ``K-s`` pairs (B chunk 0, the oldest pending W of chunk 0), and the
  pending W's, chunk 1's first. The lists are built for ``max(M, 2K-1)`` micro-batches (the
  fewest that fill the V) and those past ``M`` left out. A stage keeps at most ``2K`` chunk
  stashes (``K`` stage stashes, 1F1B's stage 0 again), and only the fill is idle:
  ``(K-1)/(6 M + K-1)`` for ``M >= 2K-1``.

The runtime runs both (:class:`~fxpar.pipeline.executor.StageWorker` runs B and W apart, and
hands ZB-V's turn from chunk 0 to chunk 1 of the last stage over inside the process).

Each builder here (``gpipe_lists``, ``one_f_one_b_lists``, ...) is the list function of a
:class:`~fxpar.pipeline.schedules.Schedule` in the default registry
(:mod:`fxpar.pipeline.schedules`), which is where pipelines look schedules up by name.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from fxpar.errors import PipelineError


class Op(enum.Enum):
    RECV_ACTIVATION = "recv_activation"
    FORWARD = "forward"
    SEND_ACTIVATION = "send_activation"
    RECV_GRAD = "recv_grad"
    BACKWARD = "backward"
    """The whole backward: input and weight gradients."""
    BACKWARD_INPUT = "backward_input"
    """B of a zero-bubble schedule: the gradients of what the stage received."""
    BACKWARD_WEIGHT = "backward_weight"
    """W of a zero-bubble schedule: the gradients of the stage's weights, after its B."""
    SEND_GRAD = "send_grad"
    FREE = "free"


Placement = Literal["loop", "v"]
"""Where a stage's chunks sit in the model: ``"loop"``, chunk ``c`` of stage ``s`` is virtual
stage ``c K + s`` (one chunk per stage, and the interleaved schedule); ``"v"``, chunk 0 is
virtual stage ``s`` and chunk 1 is ``2K-1-s`` (ZB-V)."""


def virtual_stage(stage: int, chunk: int, num_stages: int, placement: Placement = "loop") -> int:
    """The place in the model of chunk ``chunk`` of stage ``stage``."""
    if placement == "v":
        return stage if chunk == 0 else 2 * num_stages - 1 - stage
    return chunk * num_stages + stage


def stage_and_chunk(
    virtual: int, num_stages: int, placement: Placement = "loop"
) -> tuple[int, int]:
    """The stage and chunk of virtual stage ``virtual``: :func:`virtual_stage` undone."""
    if placement == "v":
        return (virtual, 0) if virtual < num_stages else (2 * num_stages - 1 - virtual, 1)
    chunk, stage = divmod(virtual, num_stages)
    return stage, chunk


@dataclass(frozen=True)
class Instruction:
    op: Op
    microbatch: int
    chunk: int = 0
    """Which of the stage's model chunks it is for (0 but in the interleaved schedule)."""

    def __str__(self) -> str:
        chunk = f", chunk {self.chunk}" if self.chunk else ""
        return f"{self.op.value}({self.microbatch}{chunk})"


StageSchedule = tuple[Instruction, ...]


def gpipe_lists(
    num_stages: int, num_microbatches: int, chunks: int = 1
) -> tuple[StageSchedule, ...]:
    """GPipe's lists: every forward, then every backward in micro-batch order."""
    return tuple(_gpipe_list(stage, num_stages, num_microbatches) for stage in range(num_stages))


def one_f_one_b_lists(
    num_stages: int, num_microbatches: int, chunks: int = 1
) -> tuple[StageSchedule, ...]:
    """1F1B's lists: ``K - s - 1`` warm-up forwards on stage ``s``, then one forward and one
    backward in turn."""
    return tuple(
        _one_f_one_b_list(stage, num_stages, num_microbatches) for stage in range(num_stages)
    )


def interleaved_lists(
    num_stages: int, num_microbatches: int, chunks: int
) -> tuple[StageSchedule, ...]:
    """Interleaved 1F1B's lists over ``chunks`` model chunks per stage (module docstring)."""
    return tuple(
        _interleaved_list(stage, num_stages, chunks, num_microbatches)
        for stage in range(num_stages)
    )


def zb_h1_lists(
    num_stages: int, num_microbatches: int, chunks: int = 1
) -> tuple[StageSchedule, ...]:
    """ZB-H1's lists (module docstring)."""
    return tuple(_zb_h1_list(stage, num_stages, num_microbatches) for stage in range(num_stages))


def zb_v_lists(
    num_stages: int, num_microbatches: int, chunks: int = 2
) -> tuple[StageSchedule, ...]:
    """ZB-V's lists over two chunks per stage in a V (module docstring)."""
    return tuple(_zb_v_list(stage, num_stages, num_microbatches) for stage in range(num_stages))


def _forward(m: int, chunk: int, virtual: int, chunks: int) -> list[Instruction]:
    """Receive, run and send on one forward of virtual stage ``virtual`` of ``chunks``."""
    steps = [Instruction(Op.RECV_ACTIVATION, m, chunk)] if virtual > 0 else []
    steps.append(Instruction(Op.FORWARD, m, chunk))
    if virtual < chunks - 1:
        steps.append(Instruction(Op.SEND_ACTIVATION, m, chunk))
    return steps


def _backward(m: int, chunk: int, virtual: int, chunks: int) -> list[Instruction]:
    """Receive, run, send and free on one backward of virtual stage ``virtual``."""
    return [
        *_backward_input(m, chunk, virtual, chunks, Op.BACKWARD),
        Instruction(Op.FREE, m, chunk),
    ]


def _backward_input(
    m: int, chunk: int, virtual: int, chunks: int, op: Op = Op.BACKWARD_INPUT
) -> list[Instruction]:
    """Receive the output gradients, run ``op``, send the input gradients (no free)."""
    steps = [Instruction(Op.RECV_GRAD, m, chunk)] if virtual < chunks - 1 else []
    steps.append(Instruction(op, m, chunk))
    if virtual > 0:
        steps.append(Instruction(Op.SEND_GRAD, m, chunk))
    return steps


def _backward_weight(m: int, chunk: int) -> list[Instruction]:
    """The weight gradients of a B already run, then the stash freed."""
    return [Instruction(Op.BACKWARD_WEIGHT, m, chunk), Instruction(Op.FREE, m, chunk)]


def _gpipe_list(stage: int, num_stages: int, count: int) -> StageSchedule:
    instructions: list[Instruction] = []
    for m in range(count):
        instructions += _forward(m, 0, stage, num_stages)
    for m in range(count):
        instructions += _backward(m, 0, stage, num_stages)
    return tuple(instructions)


def _one_f_one_b_list(stage: int, num_stages: int, count: int) -> StageSchedule:
    def forward(m: int) -> list[Instruction]:
        return _forward(m, 0, stage, num_stages)

    def backward(m: int) -> list[Instruction]:
        return _backward(m, 0, stage, num_stages)

    return _one_forward_one_backward(forward, backward, count, num_stages - stage - 1)


def _interleaved_list(stage: int, num_stages: int, chunks: int, count: int) -> StageSchedule:
    """Stage ``stage``'s interleaved 1F1B list (see the module docstring)."""
    total = count * chunks  # forwards (and backwards) this stage runs

    def unit(k: int, backward: bool) -> tuple[int, int, int]:
        """The ``k``-th forward (or backward) of this stage: micro-batch, chunk, virtual."""
        group, offset = divmod(k, num_stages)
        chunk = group % chunks
        chunk = chunks - 1 - chunk if backward else chunk
        m = group // chunks * num_stages + offset
        return m, chunk, chunk * num_stages + stage

    virtual_count = num_stages * chunks

    def forward(k: int) -> list[Instruction]:
        return _forward(*unit(k, False), virtual_count)

    def backward(k: int) -> list[Instruction]:
        return _backward(*unit(k, True), virtual_count)

    warmup = (chunks - 1) * num_stages + 2 * (num_stages - stage - 1)
    return _one_forward_one_backward(forward, backward, total, warmup)


def _one_forward_one_backward(
    forward: Callable[[int], list[Instruction]],
    backward: Callable[[int], list[Instruction]],
    total: int,
    warmup: int,
) -> StageSchedule:
    """``warmup`` forwards (at most ``total``), then one forward and one backward in turn, then
    the remaining backwards: the ``k``-th forward and backward of ``total`` each."""
    warmup = min(warmup, total)
    instructions: list[Instruction] = []
    for k in range(warmup):
        instructions += forward(k)
    for k in range(total - warmup):
        instructions += forward(warmup + k)
        instructions += backward(k)
    for k in range(total - warmup, total):
        instructions += backward(k)
    return tuple(instructions)


def _zb_h1_list(stage: int, num_stages: int, count: int) -> StageSchedule:
    """Stage ``stage``'s ZB-H1 list: 1F1B's order of forwards and B's, each W run after the B
    ``stage`` micro-batches later (see the module docstring)."""
    pending: deque[int] = deque()  # micro-batches whose B ran and whose W waits

    def forward(m: int) -> list[Instruction]:
        return _forward(m, 0, stage, num_stages)

    def backward(m: int) -> list[Instruction]:
        steps = _backward_input(m, 0, stage, num_stages)
        pending.append(m)
        if len(pending) > stage:
            steps += _backward_weight(pending.popleft(), 0)
        return steps

    instructions = list(_one_forward_one_backward(forward, backward, count, num_stages - stage - 1))
    while pending:
        instructions += _backward_weight(pending.popleft(), 0)
    return tuple(instructions)


def _zb_v_list(stage: int, num_stages: int, count: int) -> StageSchedule:
    """Stage ``stage``'s ZB-V list, the phases of the module docstring, built for at least
    ``2K - 1`` micro-batches (the fewest that fill the V) and cut back to ``count``."""
    built = max(count, 2 * num_stages - 1)
    virtual = (stage, 2 * num_stages - 1 - stage)  # of chunks 0 and 1
    chunks = 2 * num_stages
    forwards, inputs, weights = [0, 0], [0, 0], [0, 0]  # run so far, per chunk
    steps: list[Instruction] = []

    def forward(chunk: int) -> None:
        steps.extend(_forward(forwards[chunk], chunk, virtual[chunk], chunks))
        forwards[chunk] += 1

    def backward_input(chunk: int) -> None:
        steps.extend(_backward_input(inputs[chunk], chunk, virtual[chunk], chunks))
        inputs[chunk] += 1

    def backward_weight(chunk: int) -> None:
        steps.extend(_backward_weight(weights[chunk], chunk))
        weights[chunk] += 1

    for _ in range(2 * (num_stages - stage) - 1):
        forward(0)
    for _ in range(stage):
        forward(1)
        forward(0)
    for _ in range(num_stages - stage):
        forward(1)
        backward_input(1)
        backward_weight(1)
    while forwards[1] < forwards[0] or forwards[0] < built:
        if forwards[0] < built:
            forward(0)
        backward_input(0)
        backward_weight(0)
        forward(1)
        backward_input(1)
        backward_weight(1)
    for _ in range(stage):
        backward_input(0)
        backward_input(1)
    for _ in range(num_stages - stage):
        backward_input(0)
        backward_weight(0)
    for chunk in (1, 0):
        while weights[chunk] < built:
            backward_weight(chunk)
    return tuple(step for step in steps if step.microbatch < count)


def forward_only(instructions: Sequence[Instruction]) -> StageSchedule:
    """The forward half of a stage's list, in its order: receive, forward and send activations
    of every micro-batch, without the backward, the gradients' messages or the frees. Taken
    from every stage's list together, the lists still cannot deadlock (:func:`simulate`)."""
    kept = (Op.RECV_ACTIVATION, Op.FORWARD, Op.SEND_ACTIVATION)
    return tuple(instruction for instruction in instructions if instruction.op in kept)


def max_in_flight(instructions: Sequence[Instruction]) -> int:
    """The most micro-batches whose forward has run and whose stash is not yet freed (with
    interleaving, each chunk's stash of a micro-batch counts once: about ``1/V`` of a stage's)."""
    alive = peak = 0
    for instruction in instructions:
        if instruction.op is Op.FORWARD:
            alive += 1
            peak = max(peak, alive)
        elif instruction.op is Op.FREE:
            alive -= 1
    return peak


def simulate(
    schedules: Sequence[Sequence[Instruction]], placement: Placement = "loop"
) -> list[list[tuple[int, Instruction]]]:
    """Run every stage's list against the others with non-blocking sends and blocking receives.

    With ``V`` chunks per stage (the largest chunk named, plus one; 2 for ``placement="v"``),
    messages go between a virtual stage (:func:`virtual_stage`) and its neighbours: looped, the
    last stage's chunk ``c`` sends to stage 0's chunk ``c + 1`` and back; in a V, the last
    stage's chunk 0 sends to its own chunk 1.

    Returns the order in which instructions completed, as rounds of ``(stage, instruction)``
    (a round is what all stages could do without waiting on each other).

    Raises:
        PipelineError: a receive gets another micro-batch's message than it expects, a stage
            runs a backward (or a B) before its forward, a W before its B, frees what it
            never computed or a stash whose W has not run, or the ranks deadlock (the message
            names what each blocked stage waits for).
    """
    num_stages = len(schedules)
    pipe = _Pipe(num_stages, _chunk_count(schedules, placement), placement)
    queues: dict[tuple[int, int], deque[int]] = {}
    cursor = [0] * num_stages
    progress: list[dict[tuple[int, int], Op]] = [{} for _ in range(num_stages)]
    rounds: list[list[tuple[int, Instruction]]] = []
    while any(cursor[s] < len(schedules[s]) for s in range(num_stages)):
        done: list[tuple[int, Instruction]] = []
        for stage in range(num_stages):
            while cursor[stage] < len(schedules[stage]):
                instruction = schedules[stage][cursor[stage]]
                if not _try(stage, instruction, pipe, queues, progress[stage]):
                    break
                done.append((stage, instruction))
                cursor[stage] += 1
        if not done:
            waiting = [
                f"stage {s} at {schedules[s][cursor[s]]}"
                for s in range(num_stages)
                if cursor[s] < len(schedules[s])
            ]
            raise PipelineError(f"the schedule deadlocks: {', '.join(waiting)}")
        rounds.append(done)
    leftovers = {k: list(v) for k, v in queues.items() if v}
    if leftovers:
        raise PipelineError(f"messages sent but never received: {leftovers}")
    return rounds


def _chunk_count(schedules: Sequence[Sequence[Instruction]], placement: Placement) -> int:
    named = 1 + max((i.chunk for instructions in schedules for i in instructions), default=0)
    if placement == "v":
        if named > 2:
            raise PipelineError(f"a V places two chunks per stage, but chunk {named - 1} is named")
        return 2
    return named


@dataclass(frozen=True)
class _Pipe:
    """The shape the lists run on: stages, chunks per stage, and where chunks sit."""

    num_stages: int
    chunks: int
    placement: Placement

    @property
    def count(self) -> int:
        return self.num_stages * self.chunks

    def virtual(self, stage: int, chunk: int) -> int:
        return virtual_stage(stage, chunk, self.num_stages, self.placement)

    def describe(self, virtual: int) -> str:
        stage, chunk = stage_and_chunk(virtual, self.num_stages, self.placement)
        return f"stage {stage}" + (f" (chunk {chunk})" if self.chunks > 1 else "")


# What a (chunk, micro-batch) must have run last before each compute op, and what it has run
# after it: a stash is alive from its forward to its free, and its free follows its backward
# or its W.
_NEEDS = {
    Op.FORWARD: (None,),
    Op.BACKWARD: (Op.FORWARD,),
    Op.BACKWARD_INPUT: (Op.FORWARD,),
    Op.BACKWARD_WEIGHT: (Op.BACKWARD_INPUT,),
    Op.FREE: (Op.BACKWARD, Op.BACKWARD_WEIGHT),
}


def _try(
    stage: int,
    instruction: Instruction,
    pipe: _Pipe,
    queues: dict[tuple[int, int], deque[int]],
    progress: dict[tuple[int, int], Op],
) -> bool:
    """Perform ``instruction`` if it need not wait; False if it must."""
    op, m = instruction.op, instruction.microbatch
    virtual = pipe.virtual(stage, instruction.chunk)
    # Queue keys: (source, destination) virtual stages; activations flow up, gradients down.
    if op is Op.SEND_ACTIVATION or op is Op.SEND_GRAD:
        peer = virtual + 1 if op is Op.SEND_ACTIVATION else virtual - 1
        _check_peer(peer, pipe.count, instruction)
        queues.setdefault((virtual, peer), deque()).append(m)
    elif op is Op.RECV_ACTIVATION or op is Op.RECV_GRAD:
        source = virtual - 1 if op is Op.RECV_ACTIVATION else virtual + 1
        _check_peer(source, pipe.count, instruction)
        queue = queues.get((source, virtual))
        if not queue:
            return False
        arrived = queue.popleft()
        if arrived != m:
            raise PipelineError(
                f"stage {stage} expects micro-batch {m} in {instruction} but "
                f"{pipe.describe(source)} sent micro-batch {arrived} first"
            )
    else:
        _advance(stage, instruction, progress)
    return True


def _advance(stage: int, instruction: Instruction, progress: dict[tuple[int, int], Op]) -> None:
    """Record a compute or a free of a (chunk, micro-batch), checking it comes in its turn."""
    key = (instruction.chunk, instruction.microbatch)
    last = progress.get(key)
    if last not in _NEEDS[instruction.op]:
        if instruction.op is Op.FREE:
            what = "it never computed" if last is None else "before its backward or W"
            raise PipelineError(f"stage {stage} frees {instruction} {what}")
        if instruction.op is Op.FORWARD:
            raise PipelineError(f"stage {stage} runs {instruction} twice")
        needed = _NEEDS[instruction.op][0]
        assert needed is not None
        raise PipelineError(f"stage {stage} runs {instruction} before its {needed.value}")
    if instruction.op is Op.FREE:
        del progress[key]
    else:
        progress[key] = instruction.op


def _check_peer(peer: int, count: int, instruction: Instruction) -> None:
    if not 0 <= peer < count:
        raise PipelineError(f"{instruction} has no peer stage {peer} in a {count}-stage pipe")


@dataclass(frozen=True)
class StageTimes:
    """How long one stage takes per micro-batch: its forward, and its backward's B (input
    gradients) and W (weight gradients); a whole backward takes ``input + weight``. With
    ``V`` chunks per stage, each chunk takes ``1/V`` of each."""

    forward: float
    input: float
    weight: float


def replay(
    schedules: Sequence[Sequence[Instruction]],
    times: Sequence[StageTimes],
    *,
    placement: Placement = "loop",
) -> tuple[float, list[float]]:
    """Run ``schedules`` on stages that take ``times`` (one per stage) and exchange messages
    in no time: the step's length, and each stage's busy time. A receive waits for its
    message; nothing else waits.

    Raises:
        PipelineError: the lists deadlock (check them with :func:`simulate` first), or
            ``times`` has not one entry per stage.
    """
    num_stages = len(schedules)
    if len(times) != num_stages:
        raise PipelineError(f"{len(times)} stage times for {num_stages} stages")
    pipe = _Pipe(num_stages, _chunk_count(schedules, placement), placement)
    took = _durations(times, pipe.chunks)
    clock, busy, cursor = [0.0] * num_stages, [0.0] * num_stages, [0] * num_stages
    arrivals: dict[tuple[Op, int, int], float] = {}  # (receive, virtual stage, m) -> time
    progressed = True
    while progressed:
        progressed = False
        for stage, instructions in enumerate(schedules):
            while cursor[stage] < len(instructions):
                instruction = instructions[cursor[stage]]
                op, m = instruction.op, instruction.microbatch
                virtual = pipe.virtual(stage, instruction.chunk)
                if op in (Op.RECV_ACTIVATION, Op.RECV_GRAD):
                    arrival = arrivals.get((op, virtual, m))
                    if arrival is None:
                        break
                    clock[stage] = max(clock[stage], arrival)
                elif op in took[stage]:
                    clock[stage] += took[stage][op]
                    busy[stage] += took[stage][op]
                elif op is Op.SEND_ACTIVATION:
                    arrivals[(Op.RECV_ACTIVATION, virtual + 1, m)] = clock[stage]
                elif op is Op.SEND_GRAD:
                    arrivals[(Op.RECV_GRAD, virtual - 1, m)] = clock[stage]
                cursor[stage] += 1
                progressed = True
    if any(cursor[s] < len(schedules[s]) for s in range(num_stages)):
        raise PipelineError("the schedule deadlocks: simulate() says where")
    return max(clock, default=0.0), busy


def replay_shared(
    schedules: Sequence[Sequence[Instruction]],
    times: Sequence[StageTimes],
    speed: Callable[[frozenset[int]], float],
    *,
    placement: Placement = "loop",
    delay: float = 0.0,
) -> float:
    """The step's length when :func:`replay`'s stages share one machine's cores: while the
    stages of a set compute at once, each runs ``speed(set)`` times as fast as ``times`` says
    (``times`` are what an op takes when every stage computes; messages take no time), once
    the set has computed ``delay`` seconds at the speed of all (1): where another set starts
    computing, the scheduler hands it the idle stages' cores after a slice or so. Ranks that
    are processes of one host (:attr:`fxpar.Cluster.core_demand`,
    :attr:`~fxpar.Cluster.core_delay`) compute faster while a pipeline's other stages idle;
    with ``speed`` always 1 this is :func:`replay`'s step.

    Raises:
        PipelineError: the lists deadlock, ``times`` has not one entry per stage, or
            ``speed`` is not positive.
    """
    num_stages = len(schedules)
    if len(times) != num_stages:
        raise PipelineError(f"{len(times)} stage times for {num_stages} stages")
    pipe = _Pipe(num_stages, _chunk_count(schedules, placement), placement)
    took = _durations(times, pipe.chunks)
    cursor = [0] * num_stages
    left: list[float | None] = [None] * num_stages  # work left of the op a stage computes
    arrived: set[tuple[Op, int, int]] = set()
    now = 0.0
    running: frozenset[int] = frozenset()
    sped_up_at = 0.0  # when the set computing now gets its own speed
    while True:
        progressed = True
        while progressed:  # run every stage up to its next op or a message not yet sent
            progressed = False
            for stage, instructions in enumerate(schedules):
                while left[stage] is None and cursor[stage] < len(instructions):
                    instruction = instructions[cursor[stage]]
                    op, m = instruction.op, instruction.microbatch
                    virtual = pipe.virtual(stage, instruction.chunk)
                    if op in took[stage]:
                        left[stage] = took[stage][op]
                        break
                    if op in (Op.RECV_ACTIVATION, Op.RECV_GRAD) and (op, virtual, m) not in arrived:
                        break
                    if op is Op.SEND_ACTIVATION:
                        arrived.add((Op.RECV_ACTIVATION, virtual + 1, m))
                    elif op is Op.SEND_GRAD:
                        arrived.add((Op.RECV_GRAD, virtual - 1, m))
                    cursor[stage] += 1
                    progressed = True
        computing = frozenset(s for s, work in enumerate(left) if work is not None)
        if not computing:
            break
        rate = speed(computing)
        if not rate > 0:
            raise PipelineError(f"stages {sorted(computing)} computing at speed {rate}")
        if computing != running:
            running, sped_up_at = computing, now + delay
        first = min(left[s] or 0.0 for s in computing)  # the op that ends first
        if rate > 1 and sped_up_at - now > 1e-9 * delay:
            first = min(first, sped_up_at - now)  # at the speed of all until then
            rate = 1.0
        now += first / rate
        for s in computing:
            work = (left[s] or 0.0) - first
            left[s] = work if work > 1e-12 * first else None
            if left[s] is None:
                cursor[s] += 1
    if any(cursor[s] < len(schedules[s]) for s in range(num_stages)):
        raise PipelineError("the schedule deadlocks: simulate() says where")
    return now


def _durations(times: Sequence[StageTimes], chunks: int) -> list[dict[Op, float]]:
    """Per stage, how long each of its compute ops takes on a chunk."""
    return [
        {
            Op.FORWARD: each.forward / chunks,
            Op.BACKWARD: (each.input + each.weight) / chunks,
            Op.BACKWARD_INPUT: each.input / chunks,
            Op.BACKWARD_WEIGHT: each.weight / chunks,
        }
        for each in times
    ]


def modelled_bubble(
    schedules: Sequence[Sequence[Instruction]],
    forward: float = 1.0,
    backward: float = 2.0,
    *,
    weight: float | None = None,
    placement: Placement = "loop",
) -> list[float]:
    """Per stage, the idle share of a step run by ``schedules`` on devices that take
    ``forward`` and ``backward`` time for a stage's forward and backward of one micro-batch
    (``1/V`` of that per chunk, with ``V`` chunks per stage) and exchange messages in no time
    (:func:`replay`): the bubble the order itself makes. Of the backward, ``weight`` (half by
    default) is its W and the rest its B, in the lists that split it. 1F1B's is
    ``(K-1)/(M+K-1)``, interleaved 1F1B's ``(K-1)/(V M+K-1)``
    (:func:`fxpar.pipeline.ideal_bubble`), and with forward, B and W equal ZB-H1's
    ``(K-1)/(3 M+K-1)`` and ZB-V's ``(K-1)/(6 M+K-1)`` for ``M >= 2K-1``; a measured bubble
    above it is the machine's (messages, stages of unequal cost, shared cores).

    Raises:
        PipelineError: the lists deadlock (check them with :func:`simulate` first).
    """
    weight = backward / 2 if weight is None else weight
    times = [StageTimes(forward, backward - weight, weight)] * len(schedules)
    end, busy = replay(schedules, times, placement=placement)
    return [1.0 - time / end if end else 0.0 for time in busy]
