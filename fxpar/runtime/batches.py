"""The batch a compiled step takes, checked before any rank runs on it.

:class:`~fxpar.runtime.parallel.ParallelModel` and :class:`~fxpar.pipeline.PipelineModel` both take
the global batch, whole and identical on every rank, and each rank cuts out its own pieces (a
``ParallelModel`` compiled with ``batch="local"`` takes each rank's own rows instead, see
:func:`global_rows`). So two things must hold before a step runs, or the step trains on something
other than what the user meant, without a word:

- the batch is the one the step was compiled for: as many tensors, bound by position or by
  name, each with the example's full shape and dtype (:meth:`BatchSignature.bind`);
- every rank has the same batch (:func:`check_same_batch`, unless ``check_batches=False``):
  ranks fed by differently seeded loaders would otherwise each take their pieces of a
  different batch and train on a mixture.

"The same batch" means the same bits. Each rank reduces every tensor, where it lives, to the
row and column sums of its bits read as integers (:func:`bit_sums`: two reductions, about
``2 * sqrt(n)`` numbers), hashes those with SHA-256, and the ranks compare digests (one small
all-gather). Any difference in at most three elements (one altered, two swapped) is caught
for certain, and more only slip through if they cancel in every row and column sum
(docs/training.md, "Each rank its own rows"). Hashing every byte instead would cost a copy
of a GPU's batch to the host and a serial pass over every byte on one CPU core, where the sums
are memory-bound reductions on the batch's own device that leave few numbers to hash.
Comparing float checksums would call a batch containing NaN different from itself (NaN != NaN)
and could miss low-order differences of large values; bit patterns have neither problem.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import Shard

from fxpar import ir
from fxpar.errors import BatchError, FxparError
from fxpar.runtime import waiting
from fxpar.runtime.communicators import all_gather_single
from fxpar.runtime.devices import for_collective
from fxpar.sharding import Spec

_DIGEST_BYTES = 32


@dataclass(frozen=True)
class BatchSignature:
    """The batch tensors a compiled step takes: their names (model inputs, then loss targets)
    and the shape and dtype of each, for the whole global batch."""

    names: tuple[str, ...]
    metas: tuple[ir.TensorMeta, ...]

    def bind(self, batch: Sequence[object], named: Mapping[str, object]) -> list[torch.Tensor]:
        """The batch tensors in :attr:`names` order, from ``step(*batch, **named)``.

        Raises:
            BatchError: too many or too few tensors, an unknown or repeated name, something
                that is not a tensor, or a shape or dtype other than the example's.
        """
        by_name = self._by_name(batch, named)
        tensors = []
        for name, meta in zip(self.names, self.metas, strict=True):
            tensor = by_name[name]
            if not isinstance(tensor, torch.Tensor):
                raise BatchError(
                    f"batch tensor {name!r} is a {type(tensor).__name__}; pass a tensor of {meta}"
                )
            if tuple(tensor.shape) != tuple(meta.shape) or tensor.dtype != meta.dtype:
                raise BatchError(
                    f"batch tensor {name!r} is {ir.TensorMeta.of(tensor)} but the step takes "
                    f"{meta}: this model runs only the shapes it was built for (models built "
                    "by fxpar.compile plan other shapes on first sight). Pass batches of that "
                    "shape, or build the model with fxpar.compile"
                )
            tensors.append(tensor)
        return tensors

    def with_rows(self, ranks: int, *, local: bool) -> BatchSignature:
        """The signature of each of ``ranks`` ranks' rows of this batch (``local``), or of
        ``ranks`` ranks' rows together."""
        change = local_rows if local else global_rows
        return BatchSignature(self.names, tuple(change(m, ranks) for m in self.metas))

    def given(
        self, batch: Sequence[object], named: Mapping[str, object]
    ) -> tuple[ir.TensorMeta, ...] | None:
        """The shape and dtype of each tensor of ``step(*batch, **named)``, in :attr:`names`
        order; None when it does not bind (:meth:`bind` says why)."""
        try:
            by_name = self._by_name(batch, named)
        except BatchError:
            return None
        tensors = [by_name[name] for name in self.names]
        if not all(isinstance(t, torch.Tensor) for t in tensors):
            return None
        return tuple(ir.TensorMeta.of(t) for t in tensors)  # type: ignore[arg-type]

    def _by_name(self, batch: Sequence[object], named: Mapping[str, object]) -> dict[str, object]:
        names = self.names
        if len(batch) + len(named) != len(names) or len(batch) > len(names):
            raise BatchError(
                f"step takes {len(names)} batch tensors {list(names)} (model inputs, then loss "
                f"targets), got {len(batch)} positional and {sorted(named)} by name"
            )
        by_name = dict(zip(names, batch, strict=False))
        for name, tensor in named.items():
            if name not in names or name in by_name:
                raise BatchError(
                    f"unexpected or repeated batch tensor {name!r}; expected {list(names)}"
                )
            by_name[name] = tensor
        return by_name

    def take(
        self,
        batch: Sequence[object],
        named: Mapping[str, object],
        *,
        check_ranks: bool,
        rank: int = 0,
        defer: Callable[[Callable[[], None]], None] | None = None,
    ) -> list[torch.Tensor]:
        """:meth:`bind`, then, with ``check_ranks``, :func:`check_same_batch` (a collective
        over the default process group: call it on every rank; ``defer`` as there). A rank
        whose batch :meth:`bind` rejects still joins the comparison, so that its peers fail
        with it instead of waiting for it at the step's first collective."""
        try:
            tensors = self.bind(batch, named)
        except BatchError:
            if check_ranks:
                blank = torch.zeros((len(self.names), _DIGEST_BYTES), dtype=torch.uint8)
                _start_gather(blank, rejected=True)()
            raise
        if check_ranks:
            check_same_batch(tensors, rank=rank, defer=defer)
        return tensors


def split_batch(
    batch: Sequence[torch.Tensor], named: Mapping[str, torch.Tensor], count: object
) -> list[tuple[tuple[torch.Tensor, ...], dict[str, torch.Tensor]]]:
    """``count`` equal pieces of a batch (``step(*batch, **named)``) along dim 0, for
    ``step(..., accumulate=count)``; the batch itself when ``count`` is 1.

    Raises:
        FxparError: ``count`` is not a whole number of at least 1.
        BatchError: the tensors do not share a dim 0 that ``count`` divides.
    """
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise FxparError(f"accumulate must be at least 1 (a whole number), got {count!r}")
    if count == 1:
        return [(tuple(batch), dict(named))]
    tensors = [*batch, *named.values()]
    sizes = {t.shape[0] if t.dim() else None for t in tensors}
    size = next(iter(sizes)) if len(sizes) == 1 else None
    if size is None or size % count:
        shapes = [tuple(t.shape) for t in tensors]
        raise BatchError(
            f"accumulate={count} splits the batch into {count} equal pieces on dim 0, but the "
            f"batch tensors have shapes {shapes}: pass {count} compiled batches stacked on dim 0"
        )
    split = [t.chunk(count) for t in batch]
    split_named = {key: t.chunk(count) for key, t in named.items()}
    return [
        (tuple(s[i] for s in split), {key: s[i] for key, s in split_named.items()})
        for i in range(count)
    ]


def global_rows(meta: ir.TensorMeta, ranks: int) -> ir.TensorMeta:
    """The whole batch tensor's meta when each of ``ranks`` ranks holds rows of ``meta``."""
    if not meta.shape:
        raise BatchError(
            f"with batch='local' each rank passes its own rows of every batch tensor, but one "
            f"is a scalar ({meta}); give it a batch dimension or pass batch='global'"
        )
    return ir.TensorMeta((meta.shape[0] * ranks, *meta.shape[1:]), meta.dtype)


def local_rows(meta: ir.TensorMeta, ranks: int) -> ir.TensorMeta:
    """One of ``ranks`` ranks' rows of a batch tensor of ``meta`` (its size rounded down)."""
    if not meta.shape:
        return meta
    return ir.TensorMeta((meta.shape[0] // ranks, *meta.shape[1:]), meta.dtype)


def gather_rows(tensor: torch.Tensor, ranks: int, *, distributed: bool) -> torch.Tensor:
    """Every rank's rows of a batch tensor, concatenated in rank order (an all-gather over the
    default process group: call it on every rank)."""
    if not distributed or ranks == 1:
        return tensor
    tensor = for_collective(tensor.contiguous())
    everyone = [torch.empty_like(tensor) for _ in range(ranks)]
    dist.all_gather(everyone, tensor)
    return torch.cat(everyone)


ROWS = ("local", "global")
"""What ``ParallelModel.forward(..., rows=)`` returns: this rank's rows or every rank's."""


@dataclass(frozen=True)
class OwnRows:
    """This rank's rows of a forward's outputs, under ``batch="local"``: each rank passed
    ``n`` rows of every input (``sizes`` holds each input's ``n``), the forward ran on every
    rank's rows together, in rank order, and each output tensor whose dim 0 is ``world * n``
    rows is cut back to this rank's ``n``, aligned with its own inputs (as
    DistributedDataParallel returns them). Other outputs (a scalar loss, a tensor without a
    batch dimension) come whole, the same on every rank."""

    rank: int
    world: int
    sizes: frozenset[int]

    @classmethod
    def of(
        cls,
        rows: str | None,
        *,
        batch: str,
        gather: bool,
        inputs: Sequence[torch.Tensor],
        rank: int,
        world: int,
    ) -> OwnRows | None:
        """How to cut ``forward(..., rows=rows, gather=gather)``'s outputs: an :class:`OwnRows`,
        or None for whole outputs (``rows="global"``) and for DTensors (``gather=False``).
        ``rows=None`` is ``"local"`` under ``batch="local"``, else ``"global"``.

        Raises:
            FxparError: ``rows`` is neither ``"local"`` nor ``"global"``, or is ``"local"``
                with global batches or with ``gather=False``.
        """
        if rows is not None and rows not in ROWS:
            raise FxparError(f"rows must be 'local' or 'global', got {rows!r}")
        if rows == "local" and batch != "local":
            raise FxparError(
                "rows='local' returns the outputs of this rank's own rows, for a model compiled "
                "with batch='local'; this one takes the whole batch on every rank and returns "
                "the whole batch's outputs"
            )
        if rows == "local" and not gather:
            raise FxparError(
                "rows='local' cuts whole outputs to this rank's rows; with gather=False every "
                "output is a DTensor of this rank's piece of the whole batch's output: pass "
                "one or the other"
            )
        if not gather or (rows or batch) != "local":
            return None
        return cls(rank, world, frozenset(t.shape[0] for t in inputs if t.dim()))

    def cut(
        self,
        local: torch.Tensor,
        spec: Spec,
        meta: ir.TensorMeta,
        whole: Callable[[torch.Tensor, Spec, ir.TensorMeta, bool], torch.Tensor],
    ) -> torch.Tensor:
        """This rank's rows of an output whose piece on this rank is ``local``, laid out as
        ``spec``; ``whole(local, spec, meta, True)`` gathers it whole. A collective when it
        gathers (the same outputs gather on every rank)."""
        if not meta.shape or int(meta.shape[0]) not in {n * self.world for n in self.sizes}:
            return whole(local, spec, meta, True)
        if self.world == 1:
            return whole(local, spec, meta, True)
        if all(isinstance(p, Shard) and p.dim == 0 for p in spec):
            return local  # split over every device, in rank order: this rank's rows already
        return whole(local, spec, meta, True).chunk(self.world)[self.rank].clone()


_WORDS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
"""The signed integer type of a word, by its size in bytes."""


def batch_digest(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """One row per tensor (uint8, ``[n, 32]``): the SHA-256 digest of its dtype, shape and
    :func:`bit_sums`, which are computed where the tensor lives (only the sums are copied to
    the host). Equal bits give equal rows; for what different bits give, see
    :func:`bit_sums`."""
    rows = [torch.zeros((0, _DIGEST_BYTES), dtype=torch.uint8)]
    for tensor in tensors:
        digest = hashlib.sha256(f"{tensor.dtype}{list(tensor.shape)}".encode())
        digest.update(bit_sums(tensor).cpu().numpy().tobytes())
        rows.append(torch.frombuffer(bytearray(digest.digest()), dtype=torch.uint8)[None])
    return torch.cat(rows)


@torch.no_grad()
def bit_sums(tensor: torch.Tensor) -> torch.Tensor:
    """The row and column sums of ``tensor``'s bits, read as :func:`words` (signed integers,
    summed modulo ``2**bits`` of a word) laid out row by row in a matrix ``width`` words wide,
    ``width`` the smallest power of two whose square holds them all (the last row may be
    short): two reductions over the tensor, where it lives, to about ``2 * sqrt(words)``
    numbers.

    Two tensors of the same dtype and shape whose sums are equal differ, if at all, in at
    least 4 words, arranged so that every row and every column of the matrix sums to the same
    value in both (modulo ``2**bits``). A change confined to 1, 2 or 3 words (one element
    altered, two swapped, three changed: a word holds whole elements) changes a sum: one of
    the changed words is alone in its row or in its column, and changes that sum by a
    nonzero amount. Rows or columns permuted change the order of the sums, which counts too.
    docs/training.md says what this means for batches.
    """
    words = bit_words(tensor)
    count = words.numel()
    width = 1
    while width * width < count:
        width *= 2
    rows = count // width
    body = words[: rows * width].view(rows, width)
    # In the words' own type: wrapping sums are as exact for equality as wider ones, and
    # casting to int64 as it reads would cost several times the reduction itself on a CPU.
    row_sums = body.sum(1, dtype=words.dtype)
    column_sums = body.sum(0, dtype=words.dtype)
    tail = words[rows * width :]
    if tail.numel():
        row_sums = torch.cat([row_sums, tail.sum(dtype=words.dtype).reshape(1)])
        column_sums[: tail.numel()] += tail
    return torch.cat([row_sums, column_sums])


def bit_words(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s bits as a flat tensor of signed integer words: 8-byte words for elements
    of 8 bytes or more, else 4-byte words where the bytes divide into them (2-byte, then
    1-byte, otherwise). A word holds whole elements (a complex128 is two words)."""
    flat = tensor.detach().contiguous().reshape(-1)
    size = flat.element_size()
    total = flat.numel() * size
    word = 8 if size >= 8 else next(w for w in (4, 2, 1) if w >= size and total % w == 0)
    if word == size:
        return flat.view(_WORDS[word])
    if flat.storage_offset() * size % word:  # a view must start on a word (the words
        flat = flat.clone()  # themselves depend on the dtype and shape only, as on every rank)
    return flat.view(torch.uint8).view(_WORDS[word])


def check_same_batch(
    tensors: Sequence[torch.Tensor],
    *,
    rank: int,
    defer: Callable[[Callable[[], None]], None] | None = None,
) -> None:
    """Raise on every rank unless every rank of the default process group holds bitwise the
    same ``tensors``. A collective: call it on every rank.

    ``defer``: start the comparison now but finish it later: ``defer`` receives the function
    that waits for it and raises, to call before the step's first collective (a
    :class:`~fxpar.runtime.communicators.ProcessGroupCommunicator`'s ``defer``), so that the
    comparison travels while the step computes up to there. Every rank then fails at the same
    point, before any collective of the step.

    Raises:
        BatchError: some rank holds another batch, or rejected its own (see
            :meth:`BatchSignature.take`).
    """
    mine = batch_digest(tensors)
    arrived = _start_gather(mine, rejected=False)

    def finish() -> None:
        everyone = arrived()
        rejected = [r for r, (_, refused) in enumerate(everyone) if refused]
        if rejected:
            raise BatchError(
                f"ranks {rejected} were given batches that do not match the compiled step "
                "(their own errors say how); every rank must pass the same global batch"
            )
        differing = [r for r, (theirs, _) in enumerate(everyone) if not torch.equal(theirs, mine)]
        if differing:
            raise BatchError(
                f"rank {rank} got a different batch than ranks {differing}, but the compiled "
                "model takes the same global batch on every rank (each keeps only its own piece "
                "of it). If each rank loads its own rows (a DataLoader with a "
                "DistributedSampler), compile with fxpar.compile(..., batch='local') (not with "
                "a pipeline), which trains on every rank's rows together; otherwise give every "
                "rank the same batch (seed every rank's data loader identically)"
            )

    if defer is None:
        finish()
    else:
        defer(finish)


def _start_gather(
    digests: torch.Tensor, *, rejected: bool
) -> Callable[[], list[tuple[torch.Tensor, bool]]]:
    """Start gathering every rank's digests and whether it rejected its batch, in one
    all-gather (a status row travels first); the returned function waits for them."""
    status = torch.zeros((1, _DIGEST_BYTES), dtype=torch.uint8)
    status[0, 0] = int(rejected)
    mine = for_collective(torch.cat([status, digests]))
    world = dist.get_world_size()
    output = mine.new_empty((world * mine.shape[0], _DIGEST_BYTES))
    work = all_gather_single(output, mine, async_op=True)

    def arrived() -> list[tuple[torch.Tensor, bool]]:
        waiting.wait(work, poll=waiting.pollable(output))
        rows = output.cpu()
        return [(theirs[1:], bool(theirs[0, 0])) for theirs in rows.chunk(world)]

    return arrived


__all__ = [
    "ROWS",
    "BatchSignature",
    "OwnRows",
    "batch_digest",
    "bit_sums",
    "bit_words",
    "check_same_batch",
    "gather_rows",
    "global_rows",
    "local_rows",
    "split_batch",
]
