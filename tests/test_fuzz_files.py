"""Whatever bytes are on disk, loading a checkpoint or a plan file either gives back exactly what
was saved or raises fxpar's typed error naming the file (CheckpointError, PlanFileError): never
another exception, never code run from the files, never other values without a word.

One small checkpoint and one plan are saved once per module; every example mutates a copy of
them (flipped bytes, truncation, deletion, a JSON value replaced by one of another type, appended
garbage, a commit record rewritten to vouch for damaged files) and loads it."""

from __future__ import annotations

import contextlib
import functools
import io
import json
import math
import pickle
import shutil
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import Planted
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import fxpar
from fxpar import checkpoint
from fxpar.cluster import Cluster
from fxpar.errors import CheckpointError
from fxpar.passes import load_plan, plan_program
from fxpar.planning.plan import Plan
from fxpar.planning.plan_file import PlanFileError, parse_spec
from fxpar.planning.report import compact_spec

FUZZ = settings(max_examples=40, deadline=None)


# -- mutations of files -------------------------------------------------------------------------

JSON_SCALARS = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.sampled_from([2**64, -(2**63), 10**400, 0, -1])
    | st.floats()  # with inf and nan: json writes them as Infinity and NaN, and reads them back
    | st.text(max_size=8)
)
JSON_VALUES = st.recursive(
    JSON_SCALARS,
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=6), children, max_size=3)
    ),
    max_leaves=6,
)


def _kind(value: Any) -> str:
    return (
        "bool"
        if isinstance(value, bool)
        else "number"
        if isinstance(value, int | float)
        else (type(value).__name__)
    )


def _paths(value: Any, prefix: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    """Every path to a value inside a JSON document (the root excluded)."""
    children = (
        value.items()
        if isinstance(value, dict)
        else enumerate(value)
        if isinstance(value, list)
        else ()
    )
    for key, child in children:
        yield (*prefix, key)
        yield from _paths(child, (*prefix, key))


def _replaced(document: Any, path: tuple[Any, ...], new: Any) -> Any:
    copy = json.loads(json.dumps(document))
    parent = copy
    for key in path[:-1]:
        parent = parent[key]
    parent[path[-1]] = new
    return copy


@st.composite
def json_replacements(draw: st.DrawFn, document: Any) -> Any:
    """``document`` with the value at a random path replaced by a JSON value of another type
    (or the key deleted)."""
    path = draw(st.sampled_from(sorted(_paths(document), key=repr)))
    old = functools.reduce(lambda value, key: value[key], path, document)
    if draw(st.booleans()) and isinstance(path[-1], str):
        copy = json.loads(json.dumps(document))
        del functools.reduce(lambda value, key: value[key], path[:-1], copy)[path[-1]]
        return copy
    new = draw(JSON_VALUES.filter(lambda value: _kind(value) != _kind(old)))
    return _replaced(document, path, new)


@st.composite
def byte_mutations(draw: st.DrawFn, size: int) -> Callable[[bytes], bytes | None]:
    """A change to a file's bytes: flip some, cut it short, delete it (None), append garbage."""
    kind = draw(st.sampled_from(["flip", "truncate", "delete", "append"]))
    if kind == "flip" and size:
        flips = draw(
            st.lists(
                st.tuples(st.integers(0, size - 1), st.integers(1, 255)), min_size=1, max_size=4
            )
        )

        def flip(data: bytes) -> bytes:
            changed = bytearray(data)
            for position, mask in flips:
                changed[position] ^= mask
            return bytes(changed)

        return flip
    if kind == "truncate" and size:
        length = draw(st.integers(0, size - 1))
        return lambda data: data[:length]
    if kind == "delete":
        return lambda data: None
    garbage = draw(st.binary(min_size=1, max_size=64))
    return lambda data: data + garbage


def _apply_bytes(file: Path, mutation: Callable[[bytes], bytes | None]) -> None:
    changed = mutation(file.read_bytes())
    if changed is None:
        file.unlink()
    else:
        file.write_bytes(changed)


# -- checkpoints --------------------------------------------------------------------------------


class _Net(nn.Module):
    def __init__(self, hidden: int = 6) -> None:
        super().__init__()
        self.first = nn.Linear(4, hidden)
        self.second = nn.Linear(hidden, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(torch.relu(self.first(x)))


def _mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out - target) ** 2).mean()


def _compile(hidden: int = 6) -> fxpar.ParallelModel:
    x, y = torch.randn(4, 4), torch.randn(4, 2)
    return fxpar.compile(
        _Net(hidden), Cluster((1,)), (x,), _mse, example_targets=(y,),
        optimizer=fxpar.optim.AdamW(lr=1e-2),
    )  # fmt: skip


EXTRA = {"position": [3, 2.5, "shard-1"], "counts": torch.arange(3)}


@dataclass
class Saved:
    """A checkpoint saved once, the model it loads into and what a correct load gives back."""

    directory: Path
    model: fxpar.ParallelModel
    state: dict[str, torch.Tensor]
    steps: int
    lr: float


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Saved:
    torch.manual_seed(0)
    model = _compile()
    x, y = torch.randn(4, 4), torch.randn(4, 2)
    model.step(x, y)
    model.optimizer.param_groups[0]["lr"] = 3e-3  # as a scheduler would
    directory = tmp_path_factory.mktemp("fuzz") / "checkpoint"
    model.save(directory, extra=EXTRA)
    state = {name: value.clone() for name, value in model.full_state_dict().items()}
    return Saved(directory, model, state, model.steps, 3e-3)


def _files(root: Path) -> list[Path]:
    return sorted(path for path in root.rglob("*") if path.is_file())


def _recommit(root: Path) -> None:
    """Rewrite the commit record to vouch for the files as they are now: a record that lies."""
    record_path = root / checkpoint.RECORD
    record = json.loads(record_path.read_text())
    directory = root / record["version"]
    record["files"] = {
        str(file.relative_to(directory)): [file.stat().st_size, checkpoint._digest(file)]
        for file in _files(directory)
    }
    record_path.write_text(json.dumps(record))


def _scramble(model: fxpar.ParallelModel) -> None:
    """Overwrite the model's state, so that a load that succeeds is seen to have loaded."""
    with torch.no_grad():
        for value in model.parameters.values():
            value.fill_(7.0)
    model.steps = 1000
    model.optimizer.param_groups[0]["lr"] = 1.0


def _load_checkpoint(saved: Saved, root: Path, *, exact: bool) -> None:
    """Load ``root``: a CheckpointError naming it, or (``exact``) exactly the saved state."""
    _scramble(saved.model)
    try:
        extra = saved.model.load(root)
    except CheckpointError as error:
        assert str(root) in str(error), error
        return
    if not exact:  # the record vouches for what is on disk: what loads is what it says
        return
    state = saved.model.full_state_dict()
    assert state.keys() == saved.state.keys()
    for name, value in state.items():
        assert torch.equal(value, saved.state[name]), name
    assert saved.model.steps == saved.steps
    assert saved.model.optimizer.param_groups[0]["lr"] == saved.lr
    assert extra.keys() == EXTRA.keys() and extra["position"] == EXTRA["position"]
    assert torch.equal(extra["counts"], EXTRA["counts"])


@contextlib.contextmanager
def _copy(source: Path) -> Iterator[Path]:
    """A fresh copy of the file or directory ``source``, deleted afterwards (hypothesis runs
    many examples in one test, so function-scoped tmp_path would be shared between them)."""
    with tempfile.TemporaryDirectory() as scratch:
        target = Path(scratch) / source.name
        if source.is_dir():
            shutil.copytree(source, target)
        else:
            shutil.copy(source, target)
        yield target


def test_the_saved_checkpoint_loads_exactly(saved: Saved) -> None:
    """The oracle of the tests below accepts the unchanged checkpoint (so it can fail)."""
    with _copy(saved.directory) as root:
        _load_checkpoint(saved, root, exact=True)
    assert saved.model.steps == saved.steps


@FUZZ
@given(data=st.data())
def test_damaged_checkpoint_files_are_refused_or_load_exactly(
    saved: Saved, data: st.DataObject
) -> None:
    """Flipped bytes, truncation, deletion or garbage appended in any file of the checkpoint
    (the commit record, DCP's .metadata, the shard holding tensors and objects)."""
    with _copy(saved.directory) as root:
        files = _files(root)
        file = data.draw(st.sampled_from(files), label="file")
        mutation = data.draw(byte_mutations(file.stat().st_size), label="mutation")
        _apply_bytes(file, mutation)
        _load_checkpoint(saved, root, exact=True)


@FUZZ
@given(data=st.data())
def test_commit_records_with_values_of_another_type_are_refused(
    saved: Saved, data: st.DataObject
) -> None:
    with _copy(saved.directory) as root:
        record = json.loads((root / checkpoint.RECORD).read_text())
        changed = data.draw(json_replacements(record), label="record")
        (root / checkpoint.RECORD).write_text(json.dumps(changed))
        _load_checkpoint(saved, root, exact=True)


@FUZZ
@given(data=st.data())
def test_damaged_files_behind_a_lying_record_raise_only_checkpoint_errors(
    saved: Saved, data: st.DataObject
) -> None:
    """The record re-written to vouch for damaged files (damage before the digests were taken,
    or a crafted directory): the digests cannot tell, but DCP's and the objects' own parsing
    must still end in a CheckpointError or a load, never another exception."""
    with _copy(saved.directory) as root:
        version = checkpoint.committed_version(root)
        file = data.draw(st.sampled_from(_files(version)), label="file")
        mutation = data.draw(byte_mutations(file.stat().st_size), label="mutation")
        _apply_bytes(file, mutation)
        _recommit(root)
        _load_checkpoint(saved, root, exact=False)


def test_files_the_record_does_not_list_are_refused_and_another_models_files_too(
    saved: Saved,
) -> None:
    """A file in the committed version that its record does not list is refused (a record
    that left a file out would not have vouched for its bytes); files beside the versions are
    not the checkpoint's. Another model's tensors, vouched for by the record, are refused by
    their shapes."""
    with _copy(saved.directory) as root:
        (root / "notes.txt").write_text("a file of the user's")
        _load_checkpoint(saved, root, exact=True)
        (checkpoint.committed_version(root) / "__1_0.distcp").write_bytes(b"not listed")
        with pytest.raises(CheckpointError, match=r"__1_0.distcp is not in the record"):
            saved.model.load(root)
    torch.manual_seed(1)
    other = _compile(hidden=8)
    with tempfile.TemporaryDirectory() as scratch:
        other.save(Path(scratch) / "other")
        with _copy(saved.directory) as root:
            # Another model's tensors behind this checkpoint's record, vouched for.
            version = checkpoint.committed_version(root)
            shutil.rmtree(version)
            shutil.copytree(checkpoint.committed_version(Path(scratch) / "other"), version)
            _recommit(root)
            with pytest.raises(CheckpointError, match=r"first\.weight is \[8, 4\]"):
                saved.model.load(root)


# -- plan files ---------------------------------------------------------------------------------


def _capture() -> fxpar.Program:
    torch.manual_seed(0)
    x, y = torch.randn(8, 4), torch.randn(8, 2)
    return fxpar.capture(_Net(8), (x,), _mse, example_targets=(y,))


@pytest.fixture(scope="module")
def plan_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    plan = plan_program(_capture(), Cluster((2, 2)))
    return plan.save(tmp_path_factory.mktemp("plan") / "plan.json")


def _normalized(document: dict[str, Any], ndim: int) -> dict[str, Any]:
    """The placements and strategies a plan document says, each spec written one way."""

    def spec(text: str | None) -> str | None:
        return None if text is None else compact_spec(parse_spec(text, ndim))

    return {
        "placements": {name: spec(text) for name, text in document["placements"].items()},
        "strategies": {
            name: ([spec(s) for s in entry["inputs"]], [spec(s) for s in entry["outputs"]])
            for name, entry in document["strategies"].items()
        },
    }


def _load_plan(path: Path) -> Plan | None:
    """Load ``path``: a PlanFileError naming it (None), or a plan that is exactly what the
    file says: its cluster, options, placements and strategies."""
    try:
        plan = load_plan(path, _capture())
    except PlanFileError as error:
        assert str(path) in str(error), error
        return None
    document = json.loads(path.read_text())
    assert plan.cluster == Cluster.from_dict(document["cluster"])
    ndim = plan.cluster.ndim
    assert _normalized(plan.to_dict(), ndim) == _normalized(document, ndim)
    options = document["options"]
    assert plan.options.optimizer_states == options.get("optimizer_states", 2)
    assert plan.options.memory_limit == options.get("memory_limit")
    return plan


def test_the_saved_plan_loads_exactly(plan_path: Path) -> None:
    with _copy(plan_path) as path:
        assert _load_plan(path) is not None
        # Indentation is not content: the same document written on one line loads the same.
        path.write_text(json.dumps(json.loads(path.read_text())))
        assert _load_plan(path) is not None


@FUZZ
@given(data=st.data())
def test_damaged_plan_files_are_refused_or_load_what_they_say(
    plan_path: Path, data: st.DataObject
) -> None:
    with _copy(plan_path) as path:
        mutation = data.draw(byte_mutations(path.stat().st_size), label="mutation")
        _apply_bytes(path, mutation)
        _load_plan(path)


@FUZZ
@given(data=st.data())
def test_plan_files_with_values_of_another_type_are_refused_or_load_what_they_say(
    plan_path: Path, data: st.DataObject
) -> None:
    with _copy(plan_path) as path:
        document = json.loads(path.read_text())
        # The report is for reading and loading ignores it: aim at the rest.
        document.pop("report")
        changed = data.draw(json_replacements(document), label="document")
        path.write_text(json.dumps(changed))
        _load_plan(path)


SPEC_TEXT = st.text(alphabet="SRP()0123456789, ", max_size=12) | st.sampled_from(
    ["S(99999999999999999999)R", "S(-1)R", "RRR", "", "S(0)S(0)", "(R, R)", "PP"]
)


@FUZZ
@given(data=st.data())
def test_plan_files_with_other_specs_are_refused_or_load_what_they_say(
    plan_path: Path, data: st.DataObject
) -> None:
    """Out-of-range dims, specs of another mesh, unreadable specs, in placements and
    strategies."""
    with _copy(plan_path) as path:
        document = json.loads(path.read_text())
        specs = [p for p in _paths(document) if p[0] in ("placements", "strategies")]
        specs = [
            p for p in specs if isinstance(functools.reduce(lambda v, k: v[k], p, document), str)
        ]
        specs = [p for p in specs if p[-1] != "op"]
        where = data.draw(st.sampled_from(sorted(specs, key=repr)), label="where")
        path.write_text(json.dumps(_replaced(document, where, data.draw(SPEC_TEXT, label="spec"))))
        _load_plan(path)


# -- each escape the fuzzing found, as its own case ---------------------------------------------


def test_dcp_metadata_that_would_run_code_is_refused(saved: Saved, tmp_path: Path) -> None:
    """DCP reads .metadata with pickle.load: a crafted one, vouched for by its record, ran
    code before any check. It is read with an unpickler that builds DCP's metadata only."""
    marker = tmp_path / "marker"
    with _copy(saved.directory) as root:
        metadata = checkpoint.committed_version(root) / ".metadata"
        metadata.write_bytes(pickle.dumps(Planted(str(marker))))
        _recommit(root)
        with pytest.raises(CheckpointError, match=r"\.metadata.*not part of a checkpoint"):
            saved.model.load(root)
        metadata.write_bytes(pickle.dumps({"state_dict_metadata": {}}))
        _recommit(root)
        with pytest.raises(CheckpointError, match=r"\.metadata holds a dict"):
            saved.model.load(root)
    assert not marker.exists()


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        ({"files": None}, r'"files" is None'),
        ({"version": "../elsewhere"}, "not the name of a directory"),
        ({"format": True}, "format True"),
        ({"files": {"../../etc/passwd": [1, "0" * 64]}}, "not a file name"),
    ],
)
def test_commit_records_of_other_types_are_refused(
    saved: Saved, change: dict[str, Any], problem: str
) -> None:
    with _copy(saved.directory) as root:
        record = json.loads((root / checkpoint.RECORD).read_text())
        (root / checkpoint.RECORD).write_text(json.dumps({**record, **change}))
        with pytest.raises(CheckpointError, match=problem):
            saved.model.load(root)


def test_a_format_2_entry_without_its_digest_is_refused(saved: Saved) -> None:
    """A bare size would have let that file's bytes go unchecked."""
    with _copy(saved.directory) as root:
        record = json.loads((root / checkpoint.RECORD).read_text())
        name = next(name for name in record["files"] if name.endswith(".distcp"))
        record["files"][name] = record["files"][name][0]
        (root / checkpoint.RECORD).write_text(json.dumps(record))
        with pytest.raises(CheckpointError, match=r"not \[size, SHA-256 digest\]"):
            saved.model.load(root)


def test_damaged_or_misshapen_objects_entries_are_checkpoint_errors(saved: Saved) -> None:
    """torch.load of a damaged archive raises RuntimeError; hyperparameters that are not
    parameter groups would fail in the optimizer later."""
    from fxpar.checkpoint_objects import EXTRA as EXTRA_ENTRY
    from fxpar.checkpoint_objects import GROUPS, restore_objects

    optimizer = saved.model.optimizer
    with pytest.raises(CheckpointError, match="extra of the checkpoint at here cannot be read"):
        restore_objects({EXTRA_ENTRY: io.BytesIO(b"PK\x03\x04 damaged")}, optimizer, "here")
    groups = io.BytesIO()
    torch.save([1, 2], groups)
    with pytest.raises(CheckpointError, match="not a list of parameter groups"):
        restore_objects({GROUPS: groups}, optimizer, "here")


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        (b'{"format": "fxpar-plan", \xff}', "cannot read the plan file"),  # not UTF-8
        (b"[" * 100_000, "cannot read the plan file"),  # nested past the recursion limit
    ],
)
def test_plan_files_that_are_not_json_are_refused(
    plan_path: Path, tmp_path: Path, text: bytes, problem: str
) -> None:
    path = tmp_path / "plan.json"
    path.write_bytes(text)
    with pytest.raises(PlanFileError, match=problem):
        load_plan(path, _capture())


@pytest.mark.parametrize(
    ("where", "value", "problem"),
    [
        (("options", "optimizer_states"), None, "not a whole number"),
        (("options", "memory_limit"), [1], "not null or a number of bytes"),
        (("cluster", "flops"), math.nan, "flops cannot be nan"),
        (("cluster", "mesh_shape"), [True, 2], "mesh_shape cannot be"),
        (("placements", "first.bias"), "S(99999999999999999999)R", "which no tensor has"),
        (("strategies", "addmm", "inputs"), None, '"inputs" and "outputs" lists'),
    ],
)
def test_plan_files_with_values_of_other_types_are_refused_naming_the_file(
    plan_path: Path, where: tuple[str, ...], value: Any, problem: str
) -> None:
    with _copy(plan_path) as path:
        document = json.loads(path.read_text())
        path.write_text(json.dumps(_replaced(document, where, value)))
        with pytest.raises(PlanFileError, match=problem) as raised:
            load_plan(path, _capture())
        assert str(path) in str(raised.value)
