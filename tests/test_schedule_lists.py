"""Every schedule's instruction lists, pinned exactly at small shapes and written out by hand
from the definitions in fxpar/pipeline/schedule.py's docstring (not copied from its output).

The simulator, the memory bound and the bubble check what any valid order must satisfy, so an
order changed into another valid one (two of GPipe's backwards swapped) passes them all; these
lists fail on it. Each list is one string per stage, an instruction per word:

    F3    forward of micro-batch 3        ra3 / sa3   receive / send its activations
    B3    whole backward of micro-batch 3 rg3 / sg3   receive / send its gradients
    I3    B of a zero-bubble schedule     x3          free its stash
    W3    W of a zero-bubble schedule     ...c1       on the stage's chunk 1 (chunk 0 unmarked)

``|`` in a string is only there to show the phases (warm-up, steady, drain) and is ignored.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from fxpar import cli, joint
from fxpar.pipeline import (
    Instruction,
    Op,
    Pipeline,
    PipelineError,
    Schedule,
    build_schedule,
    default_schedules,
    ideal_bubble,
    max_in_flight,
    modelled_bubble,
    simulate,
)
from fxpar.pipeline.schedule import forward_only, virtual_stage

_WORDS = {
    Op.RECV_ACTIVATION: "ra",
    Op.FORWARD: "F",
    Op.SEND_ACTIVATION: "sa",
    Op.RECV_GRAD: "rg",
    Op.BACKWARD: "B",
    Op.BACKWARD_INPUT: "I",
    Op.BACKWARD_WEIGHT: "W",
    Op.SEND_GRAD: "sg",
    Op.FREE: "x",
}


def render(instructions: Sequence[Instruction]) -> str:
    """One stage's list in the words of the module docstring."""
    words = []
    for instruction in instructions:
        chunk = f"c{instruction.chunk}" if instruction.chunk else ""
        words.append(f"{_WORDS[instruction.op]}{instruction.microbatch}{chunk}")
    return " ".join(words)


def _words(text: str) -> str:
    return " ".join(word for word in text.split() if word != "|")


def _assert_lists(schedules: Sequence[Sequence[Instruction]], expected: Sequence[str]) -> None:
    assert len(schedules) == len(expected)
    for stage, (instructions, text) in enumerate(zip(schedules, expected, strict=True)):
        assert render(instructions) == _words(text), f"stage {stage}"


# GPipe: every forward (receive unless stage 0, send unless the last stage), then every
# backward in micro-batch order (receive unless the last stage, send unless stage 0, free).
GPIPE_2_3 = (
    "F0 sa0 F1 sa1 F2 sa2 | rg0 B0 x0 rg1 B1 x1 rg2 B2 x2",
    "ra0 F0 ra1 F1 ra2 F2 | B0 sg0 x0 B1 sg1 x1 B2 sg2 x2",
)
GPIPE_3_4 = (
    "F0 sa0 F1 sa1 F2 sa2 F3 sa3 | rg0 B0 x0 rg1 B1 x1 rg2 B2 x2 rg3 B3 x3",
    "ra0 F0 sa0 ra1 F1 sa1 ra2 F2 sa2 ra3 F3 sa3 | rg0 B0 sg0 x0 rg1 B1 sg1 x1 rg2 B2 sg2 x2"
    " rg3 B3 sg3 x3",
    "ra0 F0 ra1 F1 ra2 F2 ra3 F3 | B0 sg0 x0 B1 sg1 x1 B2 sg2 x2 B3 sg3 x3",
)
# 1F1B: stage s runs K-s-1 warm-up forwards, then forward k+warm-up and backward k in turn,
# then the backwards left.
ONE_F_ONE_B_2_3 = (
    "F0 sa0 | F1 sa1 rg0 B0 x0 | F2 sa2 rg1 B1 x1 | rg2 B2 x2",
    "ra0 F0 B0 sg0 x0 | ra1 F1 B1 sg1 x1 | ra2 F2 B2 sg2 x2",
)
ONE_F_ONE_B_3_4 = (
    "F0 sa0 F1 sa1 | F2 sa2 rg0 B0 x0 | F3 sa3 rg1 B1 x1 | rg2 B2 x2 | rg3 B3 x3",
    "ra0 F0 sa0 | ra1 F1 sa1 rg0 B0 sg0 x0 | ra2 F2 sa2 rg1 B1 sg1 x1"
    " | ra3 F3 sa3 rg2 B2 sg2 x2 | rg3 B3 sg3 x3",
    "ra0 F0 B0 sg0 x0 | ra1 F1 B1 sg1 x1 | ra2 F2 B2 sg2 x2 | ra3 F3 B3 sg3 x3",
)
# Fewer micro-batches than warm-up forwards: stage 0 of 3 warms up with both, then drains.
ONE_F_ONE_B_3_2 = (
    "F0 sa0 F1 sa1 | rg0 B0 x0 rg1 B1 x1",
    "ra0 F0 sa0 | ra1 F1 sa1 rg0 B0 sg0 x0 | rg1 B1 sg1 x1",
    "ra0 F0 B0 sg0 x0 | ra1 F1 B1 sg1 x1",
)
# Interleaved, K=2, V=2, M=4: stage s holds virtual stages s (chunk 0) and 2 + s (chunk 1).
# Forwards in groups of K: (c0: 0 1) (c1: 0 1) (c0: 2 3) (c1: 2 3); backwards the same groups
# from the last chunk down: (c1: 0 1) (c0: 0 1) (c1: 2 3) (c0: 2 3). Warm-up (V-1)K + 2(K-s-1):
# 4 forwards on stage 0, 2 on stage 1. Virtual stage 0 neither receives activations nor sends
# gradients; virtual stage 3 (stage 1, chunk 1) neither sends activations nor receives
# gradients.
INTERLEAVED_2_4_2 = (
    "F0 sa0 F1 sa1 ra0c1 F0c1 sa0c1 ra1c1 F1c1 sa1c1"
    " | F2 sa2 rg0c1 B0c1 sg0c1 x0c1 | F3 sa3 rg1c1 B1c1 sg1c1 x1c1"
    " | ra2c1 F2c1 sa2c1 rg0 B0 x0 | ra3c1 F3c1 sa3c1 rg1 B1 x1"
    " | rg2c1 B2c1 sg2c1 x2c1 rg3c1 B3c1 sg3c1 x3c1 rg2 B2 x2 rg3 B3 x3",
    "ra0 F0 sa0 ra1 F1 sa1"
    " | ra0c1 F0c1 B0c1 sg0c1 x0c1 | ra1c1 F1c1 B1c1 sg1c1 x1c1"
    " | ra2 F2 sa2 rg0 B0 sg0 x0 | ra3 F3 sa3 rg1 B1 sg1 x1"
    " | ra2c1 F2c1 B2c1 sg2c1 x2c1 | ra3c1 F3c1 B3c1 sg3c1 x3c1"
    " | rg2 B2 sg2 x2 rg3 B3 sg3 x3",
)
# ZB-H1: 1F1B's warm-up and order of forwards and B's (I here), the W of micro-batch m after
# the B of m + s on stage s, the W's left after the last B; each W frees its stash.
ZB_H1_2_4 = (
    "F0 sa0 | F1 sa1 rg0 I0 W0 x0 | F2 sa2 rg1 I1 W1 x1 | F3 sa3 rg2 I2 W2 x2 | rg3 I3 W3 x3",
    "ra0 F0 I0 sg0 | ra1 F1 I1 sg1 W0 x0 | ra2 F2 I2 sg2 W1 x1 | ra3 F3 I3 sg3 W2 x2 | W3 x3",
)
ZB_H1_3_4 = (
    "F0 sa0 F1 sa1 | F2 sa2 rg0 I0 W0 x0 | F3 sa3 rg1 I1 W1 x1 | rg2 I2 W2 x2 | rg3 I3 W3 x3",
    "ra0 F0 sa0 | ra1 F1 sa1 rg0 I0 sg0 | ra2 F2 sa2 rg1 I1 sg1 W0 x0"
    " | ra3 F3 sa3 rg2 I2 sg2 W1 x1 | rg3 I3 sg3 W2 x2 | W3 x3",
    "ra0 F0 I0 sg0 | ra1 F1 I1 sg1 | ra2 F2 I2 sg2 W0 x0 | ra3 F3 I3 sg3 W1 x1 | W2 x2 W3 x3",
)
# ZB-V, K=2, M=4 (>= 2K-1 = 3, nothing left out): stage 0 holds virtual stages 0 (chunk 0) and
# 3 (chunk 1, the loss); stage 1 holds 1 (chunk 0) and 2 (chunk 1), so stage 1's chunk 0 sends
# its activations to its own chunk 1 and gets its gradients from it.
# Stage 0: 3 forwards of chunk 0, no pairs, 2 triples on chunk 1, rounds (F3, I0 W0, F2c1 I2c1
# W2c1) and (no forward of chunk 0 left, I1 W1, F3c1 I3c1 W3c1), no (I, I) pairs, 2 pairs
# (I W) of chunk 0, no W left.
# Stage 1: 1 forward of chunk 0, the pair (F0c1, F1), 1 triple (F1c1 I0c1 W0c1), rounds
# (F2, I0 W0, F2c1 I1c1 W1c1) and (F3, I1 W1, F3c1 I2c1 W2c1), the pair (I2, I3c1), the pair
# (I3, W2), then W3c1 and W3.
ZB_V_2_4 = (
    "F0 sa0 F1 sa1 F2 sa2"
    " | ra0c1 F0c1 I0c1 sg0c1 W0c1 x0c1 | ra1c1 F1c1 I1c1 sg1c1 W1c1 x1c1"
    " | F3 sa3 rg0 I0 W0 x0 ra2c1 F2c1 I2c1 sg2c1 W2c1 x2c1"
    " | rg1 I1 W1 x1 ra3c1 F3c1 I3c1 sg3c1 W3c1 x3c1"
    " | rg2 I2 W2 x2 | rg3 I3 W3 x3",
    "ra0 F0 sa0 | ra0c1 F0c1 sa0c1 ra1 F1 sa1 | ra1c1 F1c1 sa1c1 rg0c1 I0c1 sg0c1 W0c1 x0c1"
    " | ra2 F2 sa2 rg0 I0 sg0 W0 x0 ra2c1 F2c1 sa2c1 rg1c1 I1c1 sg1c1 W1c1 x1c1"
    " | ra3 F3 sa3 rg1 I1 sg1 W1 x1 ra3c1 F3c1 sa3c1 rg2c1 I2c1 sg2c1 W2c1 x2c1"
    " | rg2 I2 sg2 rg3c1 I3c1 sg3c1 | rg3 I3 sg3 W2 x2 | W3c1 x3c1 W3 x3",
)
# ZB-V, K=2, M=2: built for 3 micro-batches, micro-batch 2's instructions left out.
ZB_V_2_2 = (
    "F0 sa0 F1 sa1 | ra0c1 F0c1 I0c1 sg0c1 W0c1 x0c1 | ra1c1 F1c1 I1c1 sg1c1 W1c1 x1c1"
    " | rg0 I0 W0 x0 | rg1 I1 W1 x1",
    "ra0 F0 sa0 | ra0c1 F0c1 sa0c1 ra1 F1 sa1 | ra1c1 F1c1 sa1c1 rg0c1 I0c1 sg0c1 W0c1 x0c1"
    " | rg0 I0 sg0 W0 x0 rg1c1 I1c1 sg1c1 W1c1 x1c1 | rg1 I1 sg1 | W1 x1",
)

PINNED = [
    ("gpipe", 2, 3, 1, GPIPE_2_3),
    ("gpipe", 3, 4, 1, GPIPE_3_4),
    ("1f1b", 2, 3, 1, ONE_F_ONE_B_2_3),
    ("1f1b", 3, 4, 1, ONE_F_ONE_B_3_4),
    ("1f1b", 3, 2, 1, ONE_F_ONE_B_3_2),
    ("interleaved", 2, 4, 2, INTERLEAVED_2_4_2),
    ("zb-h1", 2, 4, 1, ZB_H1_2_4),
    ("zb-h1", 3, 4, 1, ZB_H1_3_4),
    ("zb-v", 2, 4, 2, ZB_V_2_4),
    ("zb-v", 2, 2, 2, ZB_V_2_2),
]


@pytest.mark.parametrize(
    ("name", "stages", "count", "chunks", "expected"),
    PINNED,
    ids=[f"{name}-K{k}-M{m}-V{v}" for name, k, m, v, _ in PINNED],
)
def test_every_schedule_builds_the_lists_its_definition_gives(
    name: str, stages: int, count: int, chunks: int, expected: tuple[str, ...]
) -> None:
    """The lists, word for word, and they pass the simulator (forward halves too)."""
    schedules = build_schedule(name, stages, count, chunks)  # type: ignore[arg-type]
    _assert_lists(schedules, expected)
    placement = "v" if name == "zb-v" else "loop"
    simulate(schedules, placement)
    simulate([forward_only(instructions) for instructions in schedules], placement)


def _swap_first_two_backwards(instructions: Sequence[Instruction]) -> tuple[Instruction, ...]:
    """The list with micro-batches 0 and 1 exchanged in every backward-side instruction."""
    backward = (Op.RECV_GRAD, Op.BACKWARD, Op.SEND_GRAD, Op.FREE)
    swapped = {0: 1, 1: 0}
    return tuple(
        Instruction(i.op, swapped.get(i.microbatch, i.microbatch), i.chunk)
        if i.op in backward
        else i
        for i in instructions
    )


def test_gpipe_with_two_backwards_swapped_fails_only_the_pinned_lists() -> None:
    """GPipe running micro-batch 1's backward before micro-batch 0's on every stage is still
    complete, deadlock-free, as deep and with the same bubble, so every other check of a
    schedule passes it; the pinned lists do not."""
    schedules = build_schedule("gpipe", 3, 4)
    swapped = tuple(_swap_first_two_backwards(instructions) for instructions in schedules)
    assert swapped != schedules
    simulate(swapped)
    assert [max_in_flight(i) for i in swapped] == [max_in_flight(i) for i in schedules]
    assert modelled_bubble(swapped) == modelled_bubble(schedules)
    with pytest.raises(AssertionError, match="stage 0"):
        _assert_lists(swapped, GPIPE_3_4)


SHAPES = [(1, 1), (1, 3), (2, 1), (2, 2), (2, 5), (3, 2), (3, 5), (4, 4), (4, 7), (5, 12)]


@pytest.mark.parametrize(("stages", "count"), SHAPES)
def test_zb_h1_lists_are_complete_ordered_and_within_1f1b_memory(stages: int, count: int) -> None:
    """Every stage runs each micro-batch's forward, B, W and free once, in that order; the
    lists simulate; no stage keeps more than stage 0 of 1F1B (min(K, M) stashes); with forward,
    B and W equal and M >= K, every stage idles (K-1)/(3M+K-1), a third of 1F1B's idle time."""
    schedules = build_schedule("zb-h1", stages, count)
    simulate(schedules)
    one_f_one_b = build_schedule("1f1b", stages, count)
    _assert_each_runs_once_in_order(schedules, chunks=1, count=count)
    for instructions in schedules:
        assert max_in_flight(instructions) <= max_in_flight(one_f_one_b[0]) == min(stages, count)
    if count >= stages:
        expected = (stages - 1) / (3 * count + stages - 1)
        assert modelled_bubble(schedules) == pytest.approx([expected] * stages)
        idle = (stages - 1) * 3  # 1F1B's idle time, in forwards
        assert ideal_bubble(stages, count) == pytest.approx(idle / (3 * count + idle))


@pytest.mark.parametrize(("stages", "count"), SHAPES)
def test_zb_v_lists_are_complete_ordered_and_within_1f1b_memory(stages: int, count: int) -> None:
    """The same of ZB-V, on both chunks: at most 2K chunk stashes (K stages' worth: stage 0
    of 1F1B), and with M >= 2K-1 only the fill idles, (K-1)/(6M+K-1) of the step."""
    schedules = build_schedule("zb-v", stages, count, 2)
    simulate(schedules, "v")
    _assert_each_runs_once_in_order(schedules, chunks=2, count=count)
    for instructions in schedules:
        assert max_in_flight(instructions) <= 2 * stages
    if count >= 2 * stages - 1:
        expected = (stages - 1) / (6 * count + stages - 1)
        assert modelled_bubble(schedules, placement="v") == pytest.approx([expected] * stages)


def _assert_each_runs_once_in_order(
    schedules: Sequence[Sequence[Instruction]], chunks: int, count: int
) -> None:
    order = (Op.FORWARD, Op.BACKWARD_INPUT, Op.BACKWARD_WEIGHT, Op.FREE)
    every = sorted((c, m) for c in range(chunks) for m in range(count))
    for instructions in schedules:
        for op in order:
            assert sorted((i.chunk, i.microbatch) for i in instructions if i.op is op) == every
        for chunk, m in every:
            places = [instructions.index(Instruction(op, m, chunk)) for op in order]
            assert places == sorted(places)


def test_the_modelled_bubbles_at_two_stages_and_four_micro_batches() -> None:
    """K=2, M=4 with forward, B and W of equal time (a whole backward twice a forward): 1F1B
    idles 3 of 15 forwards' time, ZB-H1 1 of 13, ZB-V half a forward (one chunk's) of 12.5."""
    assert modelled_bubble(build_schedule("1f1b", 2, 4)) == pytest.approx([3 / 15] * 2)
    assert modelled_bubble(build_schedule("zb-h1", 2, 4)) == pytest.approx([1 / 13] * 2)
    zb_v = modelled_bubble(build_schedule("zb-v", 2, 4, 2), placement="v")
    assert zb_v == pytest.approx([0.5 / 12.5] * 2)


def test_the_simulator_checks_weights_come_after_their_input_gradients() -> None:
    """A W before its B, a free before its W, and a ZB-V list simulated as looped chunks
    (whose messages then go to other stages) are refused."""
    first, second = build_schedule("zb-h1", 2, 2)
    w = Instruction(Op.BACKWARD_WEIGHT, 1)
    early = (w, *(i for i in second if i != w))
    with pytest.raises(PipelineError, match=r"runs backward_weight\(1\) before its backward_input"):
        simulate((first, early))
    free = Instruction(Op.FREE, 1)
    early_free = tuple(i for i in second if i != free)
    early_free = (*early_free[: early_free.index(w)], free, *early_free[early_free.index(w) :])
    with pytest.raises(PipelineError, match=r"frees free\(1\) before"):
        simulate((first, early_free))
    with pytest.raises(PipelineError):
        simulate(build_schedule("zb-v", 2, 4, 2))


def test_zero_bubble_chunk_counts_are_said() -> None:
    """build_schedule wants ZB-V's two chunks and ZB-H1's one said as such."""
    with pytest.raises(PipelineError, match="exactly two model chunks"):
        build_schedule("zb-v", 2, 4)
    with pytest.raises(PipelineError, match="one chunk per stage"):
        build_schedule("zb-h1", 2, 4, 2)


def _shape_class(stages: int, count: int) -> str:
    if count < stages:
        return "M<K"
    return "K<=M<2K" if count < 2 * stages else "M>=2K"


def _every_shape() -> list[tuple[str, int, int, int]]:
    """Every default schedule at every K from 1 to 5 and every M from 1 to 2K + 2 (each of
    the classes M < K, K <= M < 2K and M >= 2K, K=2 M=3 among them), at each chunk count it
    runs (2 and 3 for the interleaved schedule), wherever its rules allow the shape."""
    cases = []
    for schedule in default_schedules().schedules:
        chunk_counts = [schedule.fixed_chunks] if schedule.fixed_chunks else [2, 3]
        for stages in range(1, 6):
            for count in range(1, 2 * stages + 3):
                for chunks in chunk_counts:
                    try:
                        schedule.check(stages, count, chunks)
                    except PipelineError:
                        continue
                    cases.append((schedule.name, stages, count, chunks))
    return cases


EVERY_SHAPE = _every_shape()


def test_every_schedule_is_checked_at_every_shape_class() -> None:
    """The parametrization below reaches each schedule at each class of shape its rules
    allow: the interleaved schedule needs M to be a multiple of K, so never M < K."""
    classes = {(name, _shape_class(k, m)) for name, k, m, _ in EVERY_SHAPE}
    for name in default_schedules().names():
        expected = {"K<=M<2K", "M>=2K"} | (set() if name == "interleaved" else {"M<K"})
        assert {c for n, c in classes if n == name} == expected, name
    assert ("zb-v", 2, 3, 2) in EVERY_SHAPE


@pytest.mark.parametrize(
    ("name", "stages", "count", "chunks"),
    EVERY_SHAPE,
    ids=[f"{n}-K{k}-M{m}-V{v}-{_shape_class(k, m)}" for n, k, m, v in EVERY_SHAPE],
)
def test_every_schedule_runs_every_micro_batch_once_per_chunk(
    name: str, stages: int, count: int, chunks: int
) -> None:
    """On every stage, each (chunk, micro-batch) runs its forward, its backward (or its B and
    then its W, for a schedule that splits the backward) and its free exactly once and in that
    order, receives and sends each message its place in the model needs exactly once, and
    nothing else; the lists and their forward halves simulate to the end. A builder that left
    out or repeated a micro-batch at some M fails here, at that M."""
    schedule = default_schedules()[name]
    lists = schedule.build(stages, count, chunks)
    assert len(lists) == stages
    computes = (
        (Op.FORWARD, Op.BACKWARD_INPUT, Op.BACKWARD_WEIGHT, Op.FREE)
        if schedule.splits_backward
        else (Op.FORWARD, Op.BACKWARD, Op.FREE)
    )
    virtual_count = stages * chunks
    for stage, instructions in enumerate(lists):
        expected: list[tuple[Op, int, int]] = []
        for chunk in range(chunks):
            virtual = virtual_stage(stage, chunk, stages, schedule.placement)
            ops = list(computes)
            if virtual > 0:
                ops += [Op.RECV_ACTIVATION, Op.SEND_GRAD]
            if virtual < virtual_count - 1:
                ops += [Op.SEND_ACTIVATION, Op.RECV_GRAD]
            expected += [(op, chunk, m) for op in ops for m in range(count)]
        found = [(i.op, i.chunk, i.microbatch) for i in instructions]
        assert sorted(found, key=str) == sorted(expected, key=str), f"stage {stage}"
        for chunk in range(chunks):
            for m in range(count):
                places = [instructions.index(Instruction(op, m, chunk)) for op in computes]
                assert places == sorted(places), (stage, chunk, m)
    simulate(lists, schedule.placement)
    simulate([forward_only(instructions) for instructions in lists], schedule.placement)
    assert all(
        1 <= flight <= count * chunks for flight in schedule.in_flight(stages, count, chunks)
    )


def test_the_registry_is_the_one_list_of_schedule_names(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Every list of schedules reads the registry: its names, in order of preference; the
    stage DP's (``searched``), which pipeline='auto' and ``fxpar plan --schedule`` offer; and
    an unknown name's error, which lists them."""
    registry = default_schedules()
    assert registry.names() == ("1f1b", "gpipe", "zb-h1", "interleaved", "zb-v")
    assert registry.searched() == ("1f1b", "gpipe", "zb-h1") == joint.SEARCHED_SCHEDULES
    with pytest.raises(SystemExit):
        cli.main(["plan", "gpt2", "--schedule", "interleaved"])
    assert "choose from 'auto', '1f1b', 'gpipe', 'zb-h1'" in capsys.readouterr().err
    with pytest.raises(PipelineError, match=r"one of \('1f1b', 'gpipe', .*'zb-v'\), got 'x'"):
        Pipeline(schedule="x")


def test_schedules_are_read_off_their_lists() -> None:
    """What a schedule keeps in flight is its lists' (1F1B's min(K - s, M), GPipe's M, ZB-H1's
    min(K, M)), and its rules are properties: ZB-V's V placement and two chunks, the
    interleaved schedule's messages wrapping around the stages."""
    registry = default_schedules()
    assert registry["1f1b"].in_flight(4, 3) == (3, 3, 2, 1)
    assert registry["gpipe"].in_flight(3, 5) == (5, 5, 5)
    assert registry["zb-h1"].in_flight(3, 5) == (3, 3, 3)
    for name in registry.names():
        schedule = registry[name]
        chunks = schedule.fixed_chunks or 2
        lists = schedule.build(2, 4, chunks)
        assert schedule.in_flight(2, 4, chunks) == tuple(max_in_flight(each) for each in lists)
    assert Pipeline(stages=2, schedule="zb-v").virtual_stages == 2
    assert Pipeline(stages=2, schedule="zb-v").v_shaped
    assert (
        Pipeline(stages=3, schedule="interleaved", virtual_stages=2, microbatches=3).neighbour(2, 1)
        == 0
    )


def _reversed_gpipe(stages: int, count: int, chunks: int) -> list[list[Instruction]]:
    """GPipe with its backwards from the last micro-batch down."""
    gpipe = build_schedule("gpipe", stages, count)
    lists = []
    for instructions in gpipe:
        forwards = [i for i in instructions if i.op in (Op.RECV_ACTIVATION, Op.FORWARD,
                                                        Op.SEND_ACTIVATION)]  # fmt: skip
        backwards = [i for i in instructions if i not in forwards]
        per_microbatch = [[i for i in backwards if i.microbatch == m] for m in range(count)]
        lists.append(forwards + [i for group in reversed(per_microbatch) for i in group])
    return lists


def test_a_registered_schedule_runs_where_its_registry_is_given() -> None:
    """Adding a schedule returns a new registry and leaves the default one as it was; a
    Pipeline knows the name only with that registry; names are unique; a schedule of several
    chunks cannot claim the stage DP prices it; a builder giving the wrong number of lists
    is refused."""
    mine = Schedule("gpipe-reversed", _reversed_gpipe)
    registry = default_schedules().with_schedule(mine)
    assert registry.names()[-1] == "gpipe-reversed" and "gpipe-reversed" not in default_schedules()
    with pytest.raises(PipelineError, match="Adding a schedule"):
        Pipeline(stages=2, schedule="gpipe-reversed")
    pipeline = Pipeline(stages=2, schedule="gpipe-reversed", schedules=registry)
    assert pipeline.named_schedule is mine
    lists = pipeline.instruction_lists()
    simulate(lists)
    assert render(lists[0]).endswith("rg3 B3 x3 rg2 B2 x2 rg1 B1 x1 rg0 B0 x0")
    with pytest.raises(PipelineError, match="registered already"):
        registry.with_schedule(mine)
    with pytest.raises(PipelineError, match="cannot be searched=True"):
        Schedule("wide", _reversed_gpipe, min_chunks=2, max_chunks=None, searched=True)
    with pytest.raises(PipelineError, match="one list per stage"):
        Schedule("short", lambda stages, count, chunks: []).build(2, 4)
    with pytest.raises(PipelineError, match="stages='auto' cannot plan the gpipe-reversed"):
        Pipeline(stages="auto", schedule="gpipe-reversed", schedules=registry)
