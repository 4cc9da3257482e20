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
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Sequence
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

    def __str__(self) -> str:
        return f"{self.op.value}({self.microbatch})"


StageSchedule = tuple[Instruction, ...]


def build_schedule(
    name: ScheduleName, num_stages: int, num_microbatches: int
) -> tuple[StageSchedule, ...]:
    """The instruction list of every stage, by stage.

    Raises:
        PipelineError: an unknown schedule name or a non-positive count.
    """
    if name not in SCHEDULES:
        raise PipelineError(f"unknown schedule {name!r}; choose one of {SCHEDULES}")
    if num_stages < 1 or num_microbatches < 1:
        raise PipelineError(
            f"a pipeline needs at least one stage and one micro-batch, got {num_stages} stages "
            f"and {num_microbatches} micro-batches"
        )
    return tuple(
        _stage_list(name, stage, num_stages, num_microbatches) for stage in range(num_stages)
    )


def _stage_list(name: ScheduleName, stage: int, num_stages: int, count: int) -> StageSchedule:
    first, last = stage == 0, stage == num_stages - 1

    def forward(m: int) -> list[Instruction]:
        steps = [] if first else [Instruction(Op.RECV_ACTIVATION, m)]
        steps.append(Instruction(Op.FORWARD, m))
        return steps if last else [*steps, Instruction(Op.SEND_ACTIVATION, m)]

    def backward(m: int) -> list[Instruction]:
        steps = [] if last else [Instruction(Op.RECV_GRAD, m)]
        steps.append(Instruction(Op.BACKWARD, m))
        if not first:
            steps.append(Instruction(Op.SEND_GRAD, m))
        return [*steps, Instruction(Op.FREE, m)]

    instructions: list[Instruction] = []
    if name == "gpipe":
        for m in range(count):
            instructions += forward(m)
        for m in range(count):
            instructions += backward(m)
        return tuple(instructions)
    warmup = min(num_stages - stage - 1, count)
    for m in range(warmup):
        instructions += forward(m)
    for m in range(count - warmup):
        instructions += forward(warmup + m)
        instructions += backward(m)
    for m in range(count - warmup, count):
        instructions += backward(m)
    return tuple(instructions)


def forward_only(instructions: Sequence[Instruction]) -> StageSchedule:
    """The forward half of a stage's list, in its order: receive, forward and send activations
    of every micro-batch, without the backward, the gradients' messages or the frees. Taken
    from every stage's list together, the lists still cannot deadlock (:func:`simulate`)."""
    kept = (Op.RECV_ACTIVATION, Op.FORWARD, Op.SEND_ACTIVATION)
    return tuple(instruction for instruction in instructions if instruction.op in kept)


def max_in_flight(instructions: Sequence[Instruction]) -> int:
    """The most micro-batches whose forward has run and whose stash is not yet freed."""
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

    Returns the order in which instructions completed, as rounds of ``(stage, instruction)``
    (a round is what all stages could do without waiting on each other).

    Raises:
        PipelineError: a receive gets another micro-batch's message than it expects, a stage
            runs a backward before its forward or frees what it never computed, or the ranks
            deadlock (the message names what each blocked stage waits for).
    """
    num_stages = len(schedules)
    queues: dict[tuple[int, int], deque[int]] = {}
    cursor = [0] * num_stages
    forwarded: list[set[int]] = [set() for _ in range(num_stages)]
    rounds: list[list[tuple[int, Instruction]]] = []
    while any(cursor[s] < len(schedules[s]) for s in range(num_stages)):
        done: list[tuple[int, Instruction]] = []
        for stage in range(num_stages):
            while cursor[stage] < len(schedules[stage]):
                instruction = schedules[stage][cursor[stage]]
                if not _try(stage, instruction, num_stages, queues, forwarded[stage]):
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
    queues: dict[tuple[int, int], deque[int]],
    forwarded: set[int],
) -> bool:
    """Perform ``instruction`` if it need not wait; False if it must."""
    op, m = instruction.op, instruction.microbatch
    # Queue keys: (source stage, destination stage); activations flow up, gradients down.
    if op is Op.SEND_ACTIVATION:
        _check_peer(stage + 1, num_stages, instruction)
        queues.setdefault((stage, stage + 1), deque()).append(m)
    elif op is Op.SEND_GRAD:
        _check_peer(stage - 1, num_stages, instruction)
        queues.setdefault((stage, stage - 1), deque()).append(m)
    elif op in (Op.RECV_ACTIVATION, Op.RECV_GRAD):
        source = stage - 1 if op is Op.RECV_ACTIVATION else stage + 1
        _check_peer(source, num_stages, instruction)
        queue = queues.get((source, stage))
        if not queue:
            return False
        arrived = queue.popleft()
        if arrived != m:
            raise PipelineError(
                f"stage {stage} expects micro-batch {m} in {instruction} but stage {source} "
                f"sent micro-batch {arrived} first"
            )
    elif op is Op.FORWARD:
        forwarded.add(m)
    elif op is Op.BACKWARD and m not in forwarded:
        raise PipelineError(f"stage {stage} runs {instruction} before forward({m})")
    elif op is Op.FREE:
        if m not in forwarded:
            raise PipelineError(f"stage {stage} frees micro-batch {m} it never computed")
        forwarded.discard(m)
    return True


def _check_peer(peer: int, num_stages: int, instruction: Instruction) -> None:
    if not 0 <= peer < num_stages:
        raise PipelineError(f"{instruction} has no peer stage {peer} in a {num_stages}-stage pipe")
