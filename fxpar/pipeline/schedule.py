"""Pipeline schedules as static instruction lists, one per stage.

A stage's list says, in order, what it does with each micro-batch ``m``: receive its input
activations, run its forward, send its activations on, receive the gradients of its outputs,
run its backward, send the gradients of its inputs back, and free what it stashed. Every
replica of a stage runs the same list. Sends never block (the runtime posts them and waits at
the end of the step); receives block, so a list is correct when, with every rank running its
own list, each receive eventually finds its message: :func:`simulate` checks exactly that.

GPipe runs all ``M`` forwards, then all backwards, so stage ``s`` holds the stash of all ``M``
micro-batches at once. 1F1B (PipeDream-flush) lets stage ``s`` run ``K - s - 1`` warm-up
forwards, then alternates one forward and one backward, and ends with the remaining backwards:
at most ``min(K - s, M)`` stashes are alive, for the same bubble ``(K-1)/(M+K-1)`` when forward
and backward times are equal across stages.

Interleaved 1F1B (Megatron-LM's) cuts the model into ``K V`` chunks and gives stage ``s`` the
``V`` chunks ``s, s + K, ..., s + (V-1) K``: an instruction names its chunk (the local index
``c``; its place in the model, the *virtual stage*, is ``c K + s``), and a message from the
last stage's chunk ``c`` goes to stage 0's chunk ``c + 1``. Each stage runs forwards in groups
of ``K`` micro-batches, cycling through its chunks (micro-batches ``0..K-1`` on chunk 0, the
same on chunk 1, ..., then ``K..2K-1`` on chunk 0), and backwards in the same groups from its
last chunk down, with ``(V-1) K + 2 (K-s-1)`` warm-up forwards, then one forward and one
backward in turn. A chunk is ``1/V`` of a stage's work, so the fill and drain shrink ``V``
times: the bubble is about ``(K-1)/(V M + K-1)``, for ``V`` times more messages.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from fxpar.pipeline.options import SCHEDULES, PipelineError, ScheduleName


class Op(enum.Enum):
    RECV_ACTIVATION = "recv_activation"
    FORWARD = "forward"
    SEND_ACTIVATION = "send_activation"
    RECV_GRAD = "recv_grad"
    BACKWARD = "backward"
    SEND_GRAD = "send_grad"
    FREE = "free"


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


def build_schedule(
    name: ScheduleName, num_stages: int, num_microbatches: int, virtual_stages: int = 1
) -> tuple[StageSchedule, ...]:
    """The instruction list of every stage, by stage (``virtual_stages``: chunks per stage,
    for ``"interleaved"``).

    Raises:
        PipelineError: an unknown schedule name, a non-positive count, or an interleaved
            schedule whose micro-batches are not a multiple of its stages.
    """
    if name not in SCHEDULES:
        raise PipelineError(f"unknown schedule {name!r}; choose one of {SCHEDULES}")
    if num_stages < 1 or num_microbatches < 1:
        raise PipelineError(
            f"a pipeline needs at least one stage and one micro-batch, got {num_stages} stages "
            f"and {num_microbatches} micro-batches"
        )
    if name == "interleaved":
        if virtual_stages < 1:
            raise PipelineError(f"a stage needs at least one chunk, got {virtual_stages}")
        if num_microbatches % num_stages:
            raise PipelineError(
                f"the interleaved schedule runs micro-batches in groups of one per stage: "
                f"{num_microbatches} micro-batches are not a multiple of {num_stages} stages"
            )
        return tuple(
            _interleaved_list(stage, num_stages, virtual_stages, num_microbatches)
            for stage in range(num_stages)
        )
    if virtual_stages != 1:
        raise PipelineError(f"the {name} schedule runs one chunk per stage, not {virtual_stages}")
    return tuple(
        _stage_list(name, stage, num_stages, num_microbatches) for stage in range(num_stages)
    )


def _forward(m: int, chunk: int, virtual: int, chunks: int) -> list[Instruction]:
    """Receive, run and send on one forward of virtual stage ``virtual`` of ``chunks``."""
    steps = [Instruction(Op.RECV_ACTIVATION, m, chunk)] if virtual > 0 else []
    steps.append(Instruction(Op.FORWARD, m, chunk))
    if virtual < chunks - 1:
        steps.append(Instruction(Op.SEND_ACTIVATION, m, chunk))
    return steps


def _backward(m: int, chunk: int, virtual: int, chunks: int) -> list[Instruction]:
    steps = [Instruction(Op.RECV_GRAD, m, chunk)] if virtual < chunks - 1 else []
    steps.append(Instruction(Op.BACKWARD, m, chunk))
    if virtual > 0:
        steps.append(Instruction(Op.SEND_GRAD, m, chunk))
    return [*steps, Instruction(Op.FREE, m, chunk)]


def _stage_list(name: ScheduleName, stage: int, num_stages: int, count: int) -> StageSchedule:
    def forward(m: int) -> list[Instruction]:
        return _forward(m, 0, stage, num_stages)

    def backward(m: int) -> list[Instruction]:
        return _backward(m, 0, stage, num_stages)

    if name == "gpipe":
        instructions: list[Instruction] = []
        for m in range(count):
            instructions += forward(m)
        for m in range(count):
            instructions += backward(m)
        return tuple(instructions)
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


def simulate(schedules: Sequence[Sequence[Instruction]]) -> list[list[tuple[int, Instruction]]]:
    """Run every stage's list against the others with non-blocking sends and blocking receives.

    With ``V`` chunks per stage (the largest chunk named, plus one), messages go between
    virtual stages ``c K + s`` and its neighbours, so the last stage's chunk ``c`` sends to
    stage 0's chunk ``c + 1`` and back.

    Returns the order in which instructions completed, as rounds of ``(stage, instruction)``
    (a round is what all stages could do without waiting on each other).

    Raises:
        PipelineError: a receive gets another micro-batch's message than it expects, a stage
            runs a backward before its forward or frees what it never computed, or the ranks
            deadlock (the message names what each blocked stage waits for).
    """
    num_stages = len(schedules)
    chunks = 1 + max((i.chunk for instructions in schedules for i in instructions), default=0)
    queues: dict[tuple[int, int], deque[int]] = {}
    cursor = [0] * num_stages
    forwarded: list[set[tuple[int, int]]] = [set() for _ in range(num_stages)]
    rounds: list[list[tuple[int, Instruction]]] = []
    while any(cursor[s] < len(schedules[s]) for s in range(num_stages)):
        done: list[tuple[int, Instruction]] = []
        for stage in range(num_stages):
            while cursor[stage] < len(schedules[stage]):
                instruction = schedules[stage][cursor[stage]]
                if not _try(stage, instruction, num_stages, chunks, queues, forwarded[stage]):
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


def _try(
    stage: int,
    instruction: Instruction,
    num_stages: int,
    chunks: int,
    queues: dict[tuple[int, int], deque[int]],
    forwarded: set[tuple[int, int]],
) -> bool:
    """Perform ``instruction`` if it need not wait; False if it must."""
    op, m = instruction.op, instruction.microbatch
    key = (instruction.chunk, m)
    virtual, count = instruction.chunk * num_stages + stage, num_stages * chunks
    # Queue keys: (source, destination) virtual stages; activations flow up, gradients down.
    if op is Op.SEND_ACTIVATION:
        _check_peer(virtual + 1, count, instruction)
        queues.setdefault((virtual, virtual + 1), deque()).append(m)
    elif op is Op.SEND_GRAD:
        _check_peer(virtual - 1, count, instruction)
        queues.setdefault((virtual, virtual - 1), deque()).append(m)
    elif op in (Op.RECV_ACTIVATION, Op.RECV_GRAD):
        source = virtual - 1 if op is Op.RECV_ACTIVATION else virtual + 1
        _check_peer(source, count, instruction)
        queue = queues.get((source, virtual))
        if not queue:
            return False
        arrived = queue.popleft()
        if arrived != m:
            raise PipelineError(
                f"stage {stage} expects micro-batch {m} in {instruction} but "
                f"{_describe(source, num_stages, chunks)} sent micro-batch {arrived} first"
            )
    elif op is Op.FORWARD:
        forwarded.add(key)
    elif op is Op.BACKWARD and key not in forwarded:
        raise PipelineError(f"stage {stage} runs {instruction} before its forward")
    elif op is Op.FREE:
        if key not in forwarded:
            raise PipelineError(f"stage {stage} frees {instruction} it never computed")
        forwarded.discard(key)
    return True


def _describe(virtual: int, num_stages: int, chunks: int) -> str:
    chunk, stage = divmod(virtual, num_stages)
    return f"stage {stage}" + (f" (chunk {chunk})" if chunks > 1 else "")


def _check_peer(peer: int, count: int, instruction: Instruction) -> None:
    if not 0 <= peer < count:
        raise PipelineError(f"{instruction} has no peer stage {peer} in a {count}-stage pipe")


def modelled_bubble(
    schedules: Sequence[Sequence[Instruction]], forward: float = 1.0, backward: float = 2.0
) -> list[float]:
    """Per stage, the idle share of a step run by ``schedules`` on devices that take
    ``forward`` and ``backward`` time for a stage's forward and backward of one micro-batch
    (``1/V`` of that per chunk, with ``V`` chunks per stage) and exchange messages in no time:
    the bubble the order itself makes. 1F1B's is ``(K-1)/(M+K-1)``, interleaved 1F1B's
    ``(K-1)/(V M+K-1)`` (:func:`fxpar.pipeline.ideal_bubble`); a measured bubble above it is
    the machine's (messages, stages of unequal cost, shared cores).

    Raises:
        PipelineError: the lists deadlock (check them with :func:`simulate` first).
    """
    num_stages = len(schedules)
    chunks = 1 + max((i.chunk for instructions in schedules for i in instructions), default=0)
    took = {Op.FORWARD: forward / chunks, Op.BACKWARD: backward / chunks}
    clock, busy, cursor = [0.0] * num_stages, [0.0] * num_stages, [0] * num_stages
    arrivals: dict[tuple[Op, int, int], float] = {}  # (receive, virtual stage, m) -> time
    progressed = True
    while progressed:
        progressed = False
        for stage, instructions in enumerate(schedules):
            while cursor[stage] < len(instructions):
                instruction = instructions[cursor[stage]]
                op, m = instruction.op, instruction.microbatch
                virtual = instruction.chunk * num_stages + stage
                if op in (Op.RECV_ACTIVATION, Op.RECV_GRAD):
                    arrival = arrivals.get((op, virtual, m))
                    if arrival is None:
                        break
                    clock[stage] = max(clock[stage], arrival)
                elif op in took:
                    clock[stage] += took[op]
                    busy[stage] += took[op]
                elif op is Op.SEND_ACTIVATION:
                    arrivals[(Op.RECV_ACTIVATION, virtual + 1, m)] = clock[stage]
                elif op is Op.SEND_GRAD:
                    arrivals[(Op.RECV_GRAD, virtual - 1, m)] = clock[stage]
                cursor[stage] += 1
                progressed = True
    if any(cursor[s] < len(schedules[s]) for s in range(num_stages)):
        raise PipelineError("the schedule deadlocks: simulate() says where")
    end = max(clock, default=0.0)
    return [1.0 - time / end if end else 0.0 for time in busy]
