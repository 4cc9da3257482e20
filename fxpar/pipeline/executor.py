"""Run one stage's instruction list on one rank, with point-to-point messages between ranks.

The worker keeps what the list needs between instructions: activations received but not yet
consumed, each micro-batch's stash (what its forward kept for its backward), outputs waiting
to be sent, and the running sums of the stage's gradients and losses. Sends are posted with
``isend`` and only waited for at the end of the step, so a rank never blocks on a peer that is
busy computing; each receive is posted before the compute that precedes it in the list (so its
data can arrive while that computes) and waited for where the list receives. Together with
:func:`fxpar.pipeline.schedule.simulate`'s check of the lists (a receive posted early blocks
nothing), that rules out deadlock.

A zero-bubble list (:mod:`.schedule`) runs a backward as two instructions: at
``backward_input`` the worker runs B (:class:`~fxpar.pipeline.backward_split.StageBackward`),
sends its results as a backward's, and keeps in place of the micro-batch's stash only what W
reads; at ``backward_weight`` it runs W and adds its gradients to the sums as a backward's are
added. The sums leave the worker when the list is done, so the gradient reductions that follow
(over replicas, over tied weights' holders, a stage mesh's gradient sync) start after the last
W. On a stage mesh B and W are the halves of the lowered backward, each making its own
collectives (:mod:`.backward_split`), and the communicator rides with what B keeps for W.

Every message carries one tensor per :class:`~fxpar.pipeline.split.Value` of the channel, in
the channel's order, with a tag made of the micro-batch, the direction, the sending virtual
stage and the index, so messages cannot be confused even if the transport reorders them. The
receiver allocates from the shapes recorded at capture time: nothing but the data travels.
Between stages on meshes of different shapes (:mod:`.crossings`) a value travels as the boxes each
receiving device needs, one message per sending device, with the value's tag. With the
interleaved schedule a worker runs several model chunks, each with its own programs and
channels; the last stage's chunk ``c`` sends to stage 0's chunk ``c + 1``.

On a GPU the tensors of a channel live on the rank's device. Over NCCL they travel as they
are; over gloo, which moves host memory only, a send copies its tensor to the host first and a
receive lands in host memory and is copied to the device when it is waited for
(:func:`fxpar.runtime.devices.stages_through_host`).

Each instruction's start and end (``time.perf_counter``, which is one clock for all processes
of a machine) are recorded, for the bubble fraction and the timeline of :mod:`.timeline`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from fxpar.pipeline.backward_split import StageBackward
from fxpar.pipeline.crossings import Crossing, Transfer
from fxpar.pipeline.options import PipelineError
from fxpar.pipeline.schedule import Instruction, Op, Placement, virtual_stage
from fxpar.pipeline.split import StageProgram, Value
from fxpar.runtime.devices import stages_through_host

_MAX_VALUES = 1024
_ACTIVATION, _GRADIENT = 0, 1
_MESSAGES = frozenset((Op.RECV_ACTIVATION, Op.SEND_ACTIVATION, Op.RECV_GRAD, Op.SEND_GRAD))
_COMPUTES = frozenset((Op.FORWARD, Op.BACKWARD, Op.BACKWARD_INPUT, Op.BACKWARD_WEIGHT))
_COMPUTE_NAMES = frozenset(op.value for op in _COMPUTES)
_CPU = torch.device("cpu")


@dataclass(frozen=True)
class Event:
    """One instruction as it ran: what, on which micro-batch (and chunk), and when (seconds)."""

    op: str
    microbatch: int
    start: float
    end: float
    chunk: int = 0


@dataclass
class StageTrace:
    """What one rank did during one step."""

    rank: int
    stage: int
    start: float
    end: float = 0.0
    events: list[Event] = field(default_factory=list)
    peak_stash_bytes: int = 0
    """The most bytes the stashes of micro-batches in flight held at once, a stash being,
    between the B and the W of a zero-bubble schedule, what B keeps for W (tensors that share
    storage with parameters are not counted)."""

    @property
    def compute_seconds(self) -> float:
        return sum(e.end - e.start for e in self.events if e.op in _COMPUTE_NAMES)

    def idle_fraction(self, start: float | None = None, end: float | None = None) -> float:
        """The part of ``[start, end]`` (default: this rank's step) spent not computing."""
        start = self.start if start is None else start
        end = self.end if end is None else end
        return 1.0 - self.compute_seconds / max(end - start, 1e-12)


@dataclass
class StageResult:
    """A stage's sums over the micro-batches of one step."""

    loss_sum: torch.Tensor | None
    gradient_sums: dict[str, torch.Tensor]
    buffers: dict[str, torch.Tensor]
    trace: StageTrace
    outputs: dict[int, tuple[torch.Tensor, ...]] = field(default_factory=dict)
    """A forward program's outputs, by micro-batch (on the last stage)."""


class _Channel:
    """The tensors one unit sends to, or receives from, a neighbouring rank (or, between
    stages on different meshes, several ranks: ``routes``)."""

    def __init__(
        self,
        values: Sequence[Value],
        peer: int | None,
        direction: int,
        sender: int = 0,
        senders: int = 1,
        routes: Sequence[tuple[Transfer, ...]] | None = None,
        device: torch.device = _CPU,
        mailbox: dict[tuple[int, int, int], tuple[torch.Tensor, ...]] | None = None,
    ) -> None:
        """``sender``: the virtual stage that sends on this channel, of ``senders``.
        ``routes``: this rank's messages for each value, when the neighbouring stage runs
        another mesh (:mod:`.crossings`); else every value goes whole to or from ``peer``.
        ``device``: where the stage's tensors live (module docstring). ``mailbox``: the
        channel joins two chunks of this rank (ZB-V's turn), whose tensors are handed over
        in it, by reference, instead of being sent."""
        if len(values) > _MAX_VALUES:
            raise PipelineError(
                f"{len(values)} tensors cross one stage boundary; at most {_MAX_VALUES} are "
                "supported: move the split point to where fewer values are live"
            )
        self.values = tuple(values)
        self.peer = peer
        self.direction = direction
        self.sender, self.senders = sender, senders
        self.routes = None if routes is None else tuple(routes)
        self.device = device
        self.wire = torch.device("cpu") if stages_through_host(device) else device
        """Where messages travel from and land: the host for a GPU's tensors over gloo."""
        self.mailbox = mailbox

    def _tag(self, microbatch: int, index: int) -> int:
        message = (microbatch * 2 + self.direction) * self.senders + self.sender
        return message * _MAX_VALUES + index

    def send(self, tensors: Sequence[torch.Tensor], microbatch: int) -> list[Any]:
        if not self.values:
            return []
        if self.mailbox is not None:
            self.mailbox[(self.direction, self.sender, microbatch)] = tuple(tensors)
            return []
        works = []
        for index, tensor in enumerate(tensors):
            tag = self._tag(microbatch, index)
            for peer, payload in self._pieces(index, tensor.detach().to(self.wire)):
                works.append((dist.isend(payload, peer, tag=tag), payload))
        return works

    def _pieces(self, index: int, tensor: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
        if self.routes is None:
            if self.peer is None:
                raise PipelineError("a stage with no neighbour was asked to send")
            return [(self.peer, tensor.contiguous())]
        return [(t.target, tensor[t.source_box].contiguous()) for t in self.routes[index]]

    def post(self, microbatch: int) -> Callable[[], tuple[torch.Tensor, ...]]:
        """Post the receives of ``microbatch``'s tensors; the returned function waits for
        them and returns the tensors."""
        if not self.values:
            return tuple
        if self.mailbox is not None:  # handed over before the list receives it
            mailbox, key = self.mailbox, (self.direction, self.sender, microbatch)
            return lambda: mailbox.pop(key)
        if self.peer is None and self.routes is None:
            raise PipelineError("a stage with no neighbour was asked to receive")
        shapes = [[int(size) for size in value.meta.shape] for value in self.values]
        buffers = [
            torch.empty(shape, dtype=value.meta.dtype, device=self.wire)
            for shape, value in zip(shapes, self.values, strict=True)
        ]
        works = []
        copies = []  # (piece received, where it goes)
        for index, buffer in enumerate(buffers):
            tag = self._tag(microbatch, index)
            if self.routes is None:
                works.append(dist.irecv(buffer, self.peer, tag=tag))
                continue
            for transfer in self.routes[index]:
                target = buffer[transfer.target_box]
                if target.shape == buffer.shape:
                    works.append(dist.irecv(buffer, transfer.source, tag=tag))
                else:
                    piece = torch.empty(target.shape, dtype=buffer.dtype, device=self.wire)
                    works.append(dist.irecv(piece, transfer.source, tag=tag))
                    copies.append((piece, target))

        def wait() -> tuple[torch.Tensor, ...]:
            for work in works:
                if work is not None:  # None only for ranks outside the group, never here
                    work.wait()  # a receive cannot be polled (fxpar.runtime.waiting)
            for piece, target in copies:
                target.copy_(piece)
            return tuple(buffer.to(self.device) for buffer in buffers)

        return wait


class StageWorker:
    """Runs the instruction list of one stage replica.

    ``forward[c]``/``backward[c]`` are the programs of its chunk ``c``, virtual stage
    ``c * num_stages + stage`` (a single chunk, except with the interleaved schedule), or with
    ``placement="v"`` (ZB-V) virtual stages ``stage`` and ``2 num_stages - 1 - stage``.
    ``previous_rank`` and ``next_rank`` are the ranks of the same replica index in the stages
    before and after (None at the ends; with several chunks looped they wrap around, the last
    stage's next being stage 0). In a V, chunk 0 receives activations from the previous rank
    and sends them to the next, chunk 1 the other way, and on the last stage chunk 0 hands its
    activations to chunk 1, and chunk 1 its gradients to chunk 0, without a message. A list
    without backwards (``schedule.forward_only``) runs the forwards alone: it returns the
    losses (or a forward program's outputs) and no gradients, and keeps no stash.
    """

    def __init__(
        self,
        forward: Sequence[StageProgram],
        backward: Sequence[StageProgram],
        instructions: Sequence[Instruction],
        *,
        rank: int,
        previous_rank: int | None,
        next_rank: int | None,
        num_stages: int,
        crossings: Mapping[str, Sequence[Crossing]] | None = None,
        device: torch.device = _CPU,
        placement: Placement = "loop",
        gradient_keys: Sequence[Mapping[str, str]] = (),
    ) -> None:
        """``device``: where the stage's parameters, batches and programs are (its channels
        move tensors from and to it). ``placement``: where the chunks sit in the model.
        ``gradient_keys``: for each chunk, the key its gradient of a parameter is summed
        under in :attr:`StageResult.gradient_sums` where that is not the parameter's name
        (chunks of a stage mesh whose backwards lay out a shared weight's gradient each its
        own way keep apart sums); by default every chunk sums under the names."""
        if len(forward) != len(backward) or not forward:
            raise PipelineError(
                f"a stage needs as many backward as forward chunks, got {len(forward)} and "
                f"{len(backward)}"
            )
        self.forward = tuple(forward)
        self.backward = tuple(backward)
        self.instructions = tuple(instructions)
        self._backwards = frozenset(
            (i.chunk, i.microbatch)
            for i in self.instructions
            if i.op is Op.BACKWARD or i.op is Op.BACKWARD_INPUT
        )
        # Each chunk's backward cut into B and W, where the list runs them apart.
        split = {i.chunk for i in self.instructions if i.op is Op.BACKWARD_INPUT}
        self._parts = tuple(
            StageBackward.of(program) if chunk in split else None
            for chunk, program in enumerate(self.backward)
        )
        self._gradient_keys = tuple(gradient_keys) or ({},) * len(forward)
        self.rank = rank
        self.stage = forward[0].unit.stage
        count = num_stages * len(forward)
        virtual = [program.unit.stage for program in forward]
        expected = [
            virtual_stage(self.stage, chunk, num_stages, placement) for chunk in range(len(forward))
        ]
        if virtual != expected or (placement == "v" and len(forward) != 2):
            raise PipelineError(
                f"stage {self.stage} of {num_stages} was given chunks {virtual}; it runs "
                f"chunks {expected} of the split ({placement!r} placement)"
            )
        self._next_receive = receives_ahead(self.instructions)
        # The index of the list's last forward that computes a loss (-1: none on this stage).
        self._last_loss = max(
            (
                index
                for index, instruction in enumerate(self.instructions)
                if instruction.op is Op.FORWARD and self.forward[instruction.chunk].loss
            ),
            default=-1,
        )
        routes = _routes(crossings, rank, len(forward))
        self._mailbox: dict[tuple[int, int, int], tuple[torch.Tensor, ...]] = {}
        # Tags name the sending virtual stage, which both ends of a message know.
        self._channels = []
        for chunk, (v, f, b) in enumerate(zip(virtual, forward, backward, strict=True)):
            before, after = _peers(chunk, rank, previous_rank, next_rank, placement)
            local = {peer: self._mailbox if peer == rank else None for peer in (before, after)}
            self._channels.append({
                Op.RECV_ACTIVATION: _Channel(
                    f.received, before, _ACTIVATION, v - 1, count,
                    routes[Op.RECV_ACTIVATION], device, local[before],
                ),
                Op.SEND_ACTIVATION: _Channel(
                    f.sent, after, _ACTIVATION, v, count, routes[Op.SEND_ACTIVATION], device,
                    local[after],
                ),
                Op.RECV_GRAD: _Channel(
                    b.received, after, _GRADIENT, v + 1, count, routes[Op.RECV_GRAD], device,
                    local[after],
                ),
                Op.SEND_GRAD: _Channel(
                    b.sent, before, _GRADIENT, v, count, routes[Op.SEND_GRAD], device,
                    local[before],
                ),
            })  # fmt: skip

    def run(
        self,
        parameters: Mapping[str, torch.Tensor],
        buffers: Mapping[str, torch.Tensor],
        microbatches: Sequence[Mapping[str, torch.Tensor]],
        *,
        check: Callable[[], None] | None = None,
        losses_done: Callable[[torch.Tensor | None], None] | None = None,
    ) -> StageResult:
        """One step over ``microbatches`` (this replica's pieces, by batch-tensor name).
        ``check`` (say, the comparison of every rank's batch, which raises on a mismatch) is
        called before the first message is sent or received, or at the end of a list with
        none: a step that fails it has exchanged nothing that a later step could receive.
        ``losses_done`` is called once with this rank's loss sum (None on a stage that
        computes none) as soon as its last loss is computed and ``check`` has run, so that a
        reduction of the losses it starts travels while the rest of the step computes."""
        clock = time.perf_counter
        trace = StageTrace(self.rank, self.stage, start=clock())
        buffers = dict(buffers)
        # Keyed by chunk and micro-batch (and the op that fills or drains them).
        received: dict[tuple[Op, int, int], tuple[torch.Tensor, ...]] = {}
        outgoing: dict[tuple[Op, int, int], tuple[torch.Tensor, ...]] = {}
        # What a forward stashed for its backward, and from a B to its W what W reads.
        stashes: dict[tuple[int, int], list[Any]] = {}
        stash_bytes: dict[tuple[int, int], int] = {}
        chunk_stash_bytes: dict[int, int] = {}
        chunk_held_bytes: dict[int, int] = {}
        parameter_storages = {p.untyped_storage().data_ptr() for p in parameters.values()}
        gradients: dict[str, torch.Tensor] = {}
        summed: set[str] = set()  # gradients that are sums this run made, added to in place
        losses: list[torch.Tensor] = []
        outputs: dict[int, tuple[torch.Tensor, ...]] = {}
        sends: list[Any] = []
        events = trace.events
        # Each receive is posted before the compute ahead of it, so that its data arrives
        # while that computes (only after the batch check, which comes before any message).
        posted: dict[int, Callable[[], tuple[torch.Tensor, ...]]] = {}
        for index, instruction in enumerate(self.instructions):
            op, m, c = instruction.op, instruction.microbatch, instruction.chunk
            if check is not None and op in _MESSAGES:
                check()
                check = None
            ahead = self._next_receive[index]
            if check is None and ahead is not None and ahead not in posted:
                receive = self.instructions[ahead]
                channel = self._channels[receive.chunk][receive.op]
                posted[ahead] = channel.post(receive.microbatch)
            start = clock()
            if op is Op.RECV_ACTIVATION or op is Op.RECV_GRAD:
                waiting = posted.pop(index, None) or self._channels[c][op].post(m)
                received[(op, c, m)] = waiting()
            elif op is Op.FORWARD:
                program = self.forward[c]
                # Lists, which the program empties: each tensor goes once it is read.
                inputs = list(received.pop((Op.RECV_ACTIVATION, c, m), ()))
                out = program.run(parameters, buffers, microbatches[m], inputs)
                outgoing[(Op.SEND_ACTIVATION, c, m)] = out.sent
                if (c, m) in self._backwards:  # else a forward-only list: no stash is read
                    stashes[(c, m)] = list(out.stashed)
                    # Every micro-batch of a chunk stashes the same shapes: count once.
                    if c not in chunk_stash_bytes:
                        chunk_stash_bytes[c] = _storage_bytes(out.stashed, parameter_storages)
                    stash_bytes[(c, m)] = chunk_stash_bytes[c]
                    peak = max(trace.peak_stash_bytes, sum(stash_bytes.values()))
                    trace.peak_stash_bytes = peak
                buffers.update(out.buffer_updates)
                if out.loss is not None:
                    losses.append(out.loss)
                if program.outputs:
                    outputs[m] = out.outputs
            elif op is Op.BACKWARD:
                inputs = list(received.pop((Op.RECV_GRAD, c, m), ()))
                out = None  # the last forward's outputs may hold this stash too
                out = self.backward[c].run(parameters, {}, microbatches[m], inputs, stashes[(c, m)])
                outgoing[(Op.SEND_GRAD, c, m)] = out.sent
                _accumulate(gradients, summed, self._keyed(c, out.gradients))
            elif op is Op.BACKWARD_INPUT:
                part = self._parts[c]
                assert part is not None  # made for every chunk whose list runs a B
                inputs = list(received.pop((Op.RECV_GRAD, c, m), ()))
                out = None
                sent, held = part.run_input(parameters, microbatches[m], inputs, stashes[(c, m)])
                outgoing[(Op.SEND_GRAD, c, m)] = sent
                stashes[(c, m)] = held  # the stash is now what W reads
                if c not in chunk_held_bytes:
                    transient = held[part.resident_reads :]
                    chunk_held_bytes[c] = _storage_bytes(transient, parameter_storages)
                stash_bytes[(c, m)] = chunk_held_bytes[c]
                peak = max(trace.peak_stash_bytes, sum(stash_bytes.values()))
                trace.peak_stash_bytes = peak
            elif op is Op.BACKWARD_WEIGHT:
                part = self._parts[c]
                assert part is not None
                _accumulate(gradients, summed, self._keyed(c, part.run_weight(stashes[(c, m)])))
            elif op is Op.SEND_ACTIVATION or op is Op.SEND_GRAD:
                sends += self._channels[c][op].send(outgoing.pop((op, c, m)), m)
            elif op is Op.FREE:
                del stashes[(c, m)], stash_bytes[(c, m)]
            events.append(Event(op.value, m, start, clock(), c))
            if losses_done is not None and check is None and index >= self._last_loss:
                losses_done(_sum(losses))
                losses_done = None
        if check is not None:
            check()
        if losses_done is not None:
            losses_done(_sum(losses))
        for work, _payload in sends:
            work.wait()
        trace.end = clock()
        if stashes or received or self._mailbox:
            handed = sorted(self._mailbox)
            self._mailbox.clear()
            raise PipelineError(
                f"stage {self.stage}'s schedule left (chunk, micro-batch) {sorted(stashes)} "
                f"stashed, {sorted(received)} received but unused, or {handed} handed over "
                "between its chunks but never received"
            )
        return StageResult(
            loss_sum=_sum(losses),
            gradient_sums=gradients,
            buffers=buffers,
            trace=trace,
            outputs=outputs,
        )

    def _keyed(self, chunk: int, gradients: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``chunk``'s gradients under the keys they are summed under."""
        keys = self._gradient_keys[chunk]
        return {keys.get(name, name): value for name, value in gradients.items()}


def receives_ahead(instructions: Sequence[Instruction]) -> list[int | None]:
    """For each compute instruction of a list, the index of the receive it is followed by
    before the next compute (None where there is none, and for every other instruction):
    :meth:`StageWorker.run` posts that receive before the compute starts."""
    ahead: list[int | None] = [None] * len(instructions)
    for index, instruction in enumerate(instructions):
        if instruction.op not in _COMPUTES:
            continue
        for later in range(index + 1, len(instructions)):
            op = instructions[later].op
            if op in _COMPUTES:
                break
            if op is Op.RECV_ACTIVATION or op is Op.RECV_GRAD:
                ahead[index] = later
                break
    return ahead


def _accumulate(
    gradients: dict[str, torch.Tensor], summed: set[str], new: Mapping[str, torch.Tensor]
) -> None:
    """Add one backward's (or W's) gradients to the stage's sums. A first gradient is kept as
    it is (it may alias what a program still holds, so it is never written); the second makes
    a sum of this run's (named in ``summed``), which later ones are added to in place."""
    for name, gradient in new.items():
        total = gradients.get(name)
        if total is None:
            gradients[name] = gradient
        elif name in summed:
            total.add_(gradient)
        else:
            gradients[name] = total + gradient
            summed.add(name)


def _peers(
    chunk: int, rank: int, previous_rank: int | None, next_rank: int | None, placement: Placement
) -> tuple[int | None, int | None]:
    """The ranks of the virtual stages before and after chunk ``chunk`` of this rank (its own
    rank where the neighbour is its other chunk, at a V's turn)."""
    if placement == "loop":
        return previous_rank, next_rank
    turn = rank if next_rank is None else next_rank
    return (previous_rank, turn) if chunk == 0 else (turn, previous_rank)


def _sum(losses: list[torch.Tensor]) -> torch.Tensor | None:
    return torch.stack(losses).sum() if losses else None


def _routes(
    crossings: Mapping[str, Sequence[Crossing]] | None, rank: int, chunks: int
) -> dict[Op, list[tuple[Transfer, ...]] | None]:
    """This rank's messages on each channel, when the stage's neighbours run other meshes."""
    if not crossings:
        return dict.fromkeys(_MESSAGES)
    if chunks != 1:
        raise PipelineError("stages on meshes of different shapes run one model chunk each")
    return {
        Op.RECV_ACTIVATION: [c.receives_at(rank) for c in crossings["forward_received"]],
        Op.SEND_ACTIVATION: [c.sends_from(rank) for c in crossings["forward_sent"]],
        Op.RECV_GRAD: [c.receives_at(rank) for c in crossings["backward_received"]],
        Op.SEND_GRAD: [c.sends_from(rank) for c in crossings["backward_sent"]],
    }


def _storage_bytes(tensors: Sequence[object], skip: set[int]) -> int:
    """Bytes of the distinct storages the tensors among ``tensors`` keep alive, except the
    storages in ``skip``."""
    seen: dict[int, int] = {}
    for tensor in tensors:
        if not isinstance(tensor, torch.Tensor):
            continue
        storage = tensor.untyped_storage()
        pointer = storage.data_ptr()
        if pointer not in skip:
            seen[pointer] = storage.nbytes()
    return sum(seen.values())
