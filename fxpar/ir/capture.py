"""Capture one training step of an ``nn.Module`` as a functional :class:`~fxpar.ir.program.Program`.

How it works:

1. Parameters, buffers and the batch become fake tensors (shape, dtype and device, no storage),
   so a model built on the meta device is captured without allocating its weights and a model
   with real weights is captured without copying them.
2. ``make_fx`` traces a step function below autograd: the forward through
   ``torch.func.functional_call``, the loss, then ``torch.autograd.grad`` of the loss with respect
   to every trainable parameter. Autograd's backward kernels are traced as ordinary ATen ops, so
   forward and backward land in one joint graph.
3. Python functionalization (``FunctionalTensorMode``) runs under the tracer, so in-place ops
   become out-of-place ones and buffer writes (BatchNorm statistics) become extra outputs.
4. Forward module hooks tag each forward node with the module that ran it; hooks on the
   autograd graph tag each backward node with the autograd node it belongs to, which links it to
   the forward op it differentiates. Both become :class:`fxpar.ir.Region` annotations.
5. ``torch.utils.checkpoint.checkpoint`` (reentrant or not, and so Hugging Face's
   ``gradient_checkpointing_enable()``) runs its function directly while tracing: its
   machinery saves nothing in a graph that autograd never runs, and its recomputation in the
   backward would read the real weights instead of the traced ones. The ops of each call are
   tagged :class:`fxpar.ir.Checkpointed`, a request that
   :class:`fxpar.passes.Rematerialize` honours by recomputing them in the backward.
"""

from __future__ import annotations

import contextlib
import itertools
import linecache
import os
import sysconfig
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.fx as fx
import torch.fx.traceback as fx_traceback
import torch.utils.checkpoint as torch_checkpoint
from torch import nn
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensorMode,
    UnsupportedOperatorException,
)
from torch._subclasses.functional_tensor import FunctionalTensor, FunctionalTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.experimental.symbolic_shapes import (
    DimDynamic,
    GuardOnDataDependentSymNode,
    ShapeEnv,
    StatelessSymbolicContext,
    free_unbacked_symbols,
)

from fxpar import ir
from fxpar.errors import CaptureError
from fxpar.ir.precision import (
    MixedPrecision,
    cast_inputs,
    cast_outputs,
    cast_roles,
    check_policy,
    compute_parameter,
    kept_in_own_dtype,
    reported_loss,
)
from fxpar.ir.program import OutputTree, Program, Signature
from fxpar.ir.rng import RandomDraw, can_draw_ahead, draws_random_numbers

LossFn = Callable[..., torch.Tensor]

StepKind = Literal["train", "loss", "forward"]
"""What :func:`capture` traces: a training step, a loss evaluation, or the model's forward."""

_STEP_KINDS: tuple[StepKind, ...] = ("train", "loss", "forward")

# Keys of the ``custom`` node metadata that torch.fx copies onto every node traced while a
# ``torch.fx.traceback.annotate`` block is open. Capture turns them into Region annotations.
TRACING_DEVICE = torch.device("cpu")
"""Where the fake tensors claim to live, whatever device the model and batch are on: the graph,
its plan and its per-rank programs are the same for every device (and a GPU plan is made
without a GPU); :func:`fxpar.ir.placement.place` puts a program where it runs."""

_PHASE = "fxpar.phase"
_MODULE = "fxpar.module"
_GRAD_OF = "fxpar.grad_of"
_CHECKPOINT = "fxpar.checkpoint"

# Ops that are the identity in a functional graph; capture drops them.
_IDENTITY_OPS = (torch.ops.aten.detach.default, torch.ops.aten.alias.default)

_DATA_DEPENDENT = (
    DataDependentOutputException,
    DynamicOutputShapeException,
    GuardOnDataDependentSymNode,
)


def capture(
    model: nn.Module,
    example_inputs: Sequence[Any] | Mapping[str, Any],
    loss_fn: LossFn | None = None,
    *,
    example_targets: Sequence[torch.Tensor] = (),
    dynamic: bool = False,
    step: StepKind = "train",
    mixed_precision: MixedPrecision | None = None,
) -> Program:
    """Trace one training step of ``model`` into a functional Program of ATen ops.

    Args:
        model: the module to train. Its parameters may be real or on the meta device; neither
            is copied or allocated.
        example_inputs: positional arguments of ``model`` (a tuple) or keyword arguments (a
            dict). Tensors become batch inputs of the Program; anything else is baked in.
        loss_fn: called as ``loss_fn(output, *targets)``. When None, the model's output must be
            the loss, or carry it as ``.loss`` / ``["loss"]`` (Hugging Face style).
        example_targets: tensors passed to ``loss_fn`` after the model's output.
        dynamic: trace every batch dimension larger than one as a symbol, so shapes and costs
            are sympy expressions valid for any batch and sequence size.
        step: what to trace. ``"train"``: forward, loss and backward. ``"loss"``: forward and
            loss only (evaluation). ``"forward"``: the model alone (inference); ``loss_fn`` and
            targets are not taken, and the Program returns the tensors of the model's output
            (flattened as a pytree; :attr:`Signature.output_tree` rebuilds it).
        mixed_precision: compute in lower precision with the parameters kept as they are
            (master weights), as :class:`fxpar.MixedPrecision` says
            (:mod:`fxpar.ir.precision`). The Program's placeholders and gradients keep the
            parameters' dtypes; its forward and backward compute in ``param_dtype``.

    Returns:
        A Program whose graph maps (parameters, buffers, batch) to (loss, gradients, buffer
        updates), or to (loss, buffer updates) or (outputs, buffer updates) for the other
        ``step`` kinds; see :mod:`fxpar.ir.program`. The model's train/eval mode at the call is
        the one traced (dropout, BatchNorm's statistics).

    Raises:
        CaptureError: the step cannot be traced (data-dependent control flow, an op fake
            tensors cannot run, a non-scalar loss, a model that mutates its inputs).
    """
    if not isinstance(model, nn.Module):
        raise CaptureError(f"capture expects an nn.Module, got {type(model).__name__}")
    if step not in _STEP_KINDS:
        raise CaptureError(f"step must be one of {list(_STEP_KINDS)}, got {step!r}")
    if loss_fn is None and example_targets:
        raise CaptureError("example_targets were given without a loss_fn to receive them")
    if step == "forward" and (loss_fn is not None or example_targets):
        raise CaptureError(
            "step='forward' traces the model alone: leave loss_fn and example_targets out"
        )

    policy = check_policy(mixed_precision)
    batch = _Batch.of(example_inputs, tuple(example_targets))
    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    device = TRACING_DEVICE
    fake_mode = FakeTensorMode(shape_env=ShapeEnv(duck_shape=False) if dynamic else None)
    fake_state = [
        _fake_state_tensor(fake_mode, tensor, device)
        for tensor in (*params.values(), *buffers.values())
    ]
    fake_batch = [
        _fake_batch_tensor(fake_mode, t, device, dynamic) for t in _unaliased(batch.tensors)
    ]

    traced_step = _TrainStep(model, loss_fn, batch, tuple(params), tuple(buffers), step, policy)
    if policy is not None:
        traced_step.kept_in_own_dtype = kept_in_own_dtype(model)
    try:
        with (
            _custom_meta_restored(),
            _blocks_closed(traced_step.open_blocks),
            _compiling(),
            _checkpoints_inline(),
            _module_regions(model, traced_step.module_stack),
            fx_traceback.preserve_node_meta(),
            torch.enable_grad() if step == "train" else torch.no_grad(),
        ):
            traced = make_fx(
                traced_step.trace,
                tracing_mode="symbolic" if dynamic else "fake",
                _allow_non_fake_inputs=False,
            )(*fake_state, *fake_batch)
    except CaptureError:
        raise
    except Exception as error:
        raise _capture_error(model, traced_step.module_stack, error) from error

    _reject_unbacked_shapes(traced)
    trains = step == "train"
    signature = Signature(
        parameters=tuple(params),
        buffers=tuple(buffers),
        inputs=batch.names,
        gradients=tuple(name for name, p in params.items() if p.requires_grad and trains),
        buffer_updates=traced_step.buffer_updates,
        random=_random_ops_to_inputs(traced, taken=set(batch.names), dynamic=dynamic),
        outputs=traced_step.output_names,
        output_tree=traced_step.output_tree,
    )
    return Program(_clean_graph(traced, signature), signature)


@dataclass(frozen=True)
class _Batch:
    """Where the batch tensors sit among the model's arguments and the loss targets."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    targets: tuple[torch.Tensor, ...]
    names: tuple[str, ...]

    @staticmethod
    def of(inputs: Sequence[Any] | Mapping[str, Any], targets: tuple[torch.Tensor, ...]) -> _Batch:
        if isinstance(inputs, torch.Tensor):
            inputs = (inputs,)
        if isinstance(inputs, Mapping):
            args: tuple[Any, ...] = ()
            kwargs = dict(inputs)
            names = [k for k, v in kwargs.items() if isinstance(v, torch.Tensor)]
        else:
            args, kwargs = tuple(inputs), {}
            names = [f"input_{i}" for i, v in enumerate(args) if isinstance(v, torch.Tensor)]
        for i, target in enumerate(targets):
            if not isinstance(target, torch.Tensor):
                raise CaptureError(
                    f"example_targets[{i}] is a {type(target).__name__}, not a tensor"
                )
        names += [f"target_{i}" for i in range(len(targets))]
        return _Batch(args, kwargs, targets, tuple(names))

    @property
    def tensors(self) -> list[torch.Tensor]:
        model_inputs = [*self.args, *self.kwargs.values()]
        return [t for t in model_inputs if isinstance(t, torch.Tensor)] + list(self.targets)

    def rebuild(
        self, tensors: Sequence[torch.Tensor]
    ) -> tuple[tuple[Any, ...], dict[str, Any], tuple[torch.Tensor, ...]]:
        """Model args, kwargs and targets with the batch tensors replaced by ``tensors``."""
        it = iter(tensors)
        args = tuple(next(it) if isinstance(a, torch.Tensor) else a for a in self.args)
        kwargs = {k: next(it) if isinstance(v, torch.Tensor) else v for k, v in self.kwargs.items()}
        targets = tuple(next(it) for _ in self.targets)
        return args, kwargs, targets


@dataclass
class _TrainStep:
    """The function make_fx traces: forward, loss, backward (or as much of it as ``kind``
    asks for), with functionalization."""

    model: nn.Module
    loss_fn: LossFn | None
    batch: _Batch
    param_names: tuple[str, ...]
    buffer_names: tuple[str, ...]
    kind: StepKind = "train"
    policy: MixedPrecision | None = None
    kept_in_own_dtype: frozenset[str] = frozenset()
    module_stack: list[tuple[str, str]] = field(default_factory=list)
    open_blocks: list[contextlib.AbstractContextManager[None]] = field(default_factory=list)
    """The ``fx_traceback.annotate`` blocks autograd hooks opened and have not closed yet (all
    of them, if the backward raises mid-trace)."""
    buffer_updates: tuple[str, ...] = ()
    output_names: tuple[str, ...] = ("loss",)
    output_tree: OutputTree | None = None

    def trace(self, *flat: torch.Tensor) -> tuple[torch.Tensor, ...]:
        with FunctionalTensorMode():
            functional = [FunctionalTensor.to_functional(t) for t in flat]
            outputs = self.step(*functional)
        num_params, num_buffers = len(self.param_names), len(self.buffer_names)
        updates = []
        for index, tensor in enumerate(functional):
            torch._sync(tensor)
            if not torch._functionalize_has_data_mutation(tensor.elem):  # type: ignore[attr-defined]
                continue
            if num_params <= index < num_params + num_buffers:
                updates.append(index)
            elif index < num_params:
                raise CaptureError(
                    f"the model writes parameter {self.param_names[index]!r} in place during "
                    "the step; only buffers may be updated in forward"
                )
            else:
                name = self.batch.names[index - num_params - num_buffers]
                raise CaptureError(
                    f"the model writes its input {name!r} in place; clone it inside forward "
                    "before modifying it"
                )
        self.buffer_updates = tuple(self.buffer_names[i - num_params] for i in updates)
        return tuple(_from_functional(t) for t in (*outputs, *(functional[i] for i in updates)))

    def step(self, *flat: torch.Tensor) -> tuple[torch.Tensor, ...]:
        num_params, num_buffers = len(self.param_names), len(self.buffer_names)
        params = dict(zip(self.param_names, flat[:num_params], strict=True))
        buffers = dict(
            zip(self.buffer_names, flat[num_params : num_params + num_buffers], strict=True)
        )
        args, kwargs, targets = self.batch.rebuild(flat[num_params + num_buffers :])
        with fx_traceback.annotate({_PHASE: ir.Phase.FORWARD.value, _MODULE: ""}):
            computed, args, kwargs = self.in_compute_dtype(params, args, kwargs)
            output = torch.func.functional_call(self.model, (computed, buffers), args, kwargs)
            if self.policy is not None:
                output = cast_outputs(self.policy, output)
            if self.kind == "forward":
                self.output_tree = OutputTree.of(output)
                self.output_names = tuple(
                    f"output_{i}" for i in range(len(self.output_tree.tensor_positions))
                )
                return self.output_tree.tensors(output)
            if self.loss_fn is not None:
                with fx_traceback.annotate({_MODULE: ir.LOSS_REGION}):
                    loss = self.loss_fn(output, *targets)
            else:
                loss = _loss_of(output)
            if self.policy is not None and isinstance(loss, torch.Tensor):
                loss = reported_loss(loss)
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise CaptureError(
                f"the loss must be a scalar tensor, got {shape}; reduce it (e.g. .mean()) in "
                "loss_fn or in the model"
            )
        if self.kind == "loss":
            return (loss,)
        if not loss.requires_grad:
            raise CaptureError(
                "the loss does not depend on any trainable parameter; check requires_grad "
                "on the model's parameters"
            )
        trainable = [p for p in params.values() if p.requires_grad]
        _tag_backward_nodes(loss, self.open_blocks)
        with fx_traceback.annotate({_PHASE: ir.Phase.BACKWARD.value, _MODULE: ""}):
            grads = torch.autograd.grad(loss, trainable, allow_unused=True)
            grads = tuple(
                torch.zeros_like(p) if g is None else g
                for g, p in zip(grads, trainable, strict=True)
            )
        return (loss, *grads)

    def in_compute_dtype(
        self, params: dict[str, torch.Tensor], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[dict[str, torch.Tensor], tuple[Any, ...], dict[str, Any]]:
        """Parameters and model inputs as the forward reads them under the mixed-precision
        policy: each parameter's cast is tagged with the module owning it."""
        if self.policy is None:
            return params, args, kwargs
        computed = {}
        for name, master in params.items():
            if name in self.kept_in_own_dtype:
                computed[name] = master
                continue
            with fx_traceback.annotate({_MODULE: name.rpartition(".")[0]}):
                computed[name] = compute_parameter(self.policy, master)
        return computed, cast_inputs(self.policy, args), cast_inputs(self.policy, kwargs)


@contextlib.contextmanager
def model_in_mode(model: nn.Module, training: bool) -> Iterator[None]:
    """``model`` in train or eval mode for the block (to capture it so), its own mode (per
    module) after."""
    modes = {module: module.training for module in model.modules()}
    model.train(training)
    try:
        yield
    finally:
        for module, mode in modes.items():
            module.training = mode


def batch_tensors(inputs: Sequence[Any] | Mapping[str, Any]) -> list[torch.Tensor]:
    """The tensors of example inputs as :func:`capture` takes them, in the order the Program's
    batch placeholders have them (other values, such as flags, left out)."""
    if isinstance(inputs, torch.Tensor):
        inputs = (inputs,)
    values = list(inputs.values()) if isinstance(inputs, Mapping) else list(inputs)
    return [v for v in values if isinstance(v, torch.Tensor)]


def with_batch_tensors(
    inputs: Sequence[Any] | Mapping[str, Any], tensors: Sequence[torch.Tensor]
) -> Sequence[Any] | Mapping[str, Any]:
    """``inputs`` with its tensors replaced by ``tensors`` (in :func:`batch_tensors` order),
    other values kept: the same call on another batch."""
    if isinstance(inputs, torch.Tensor):
        return (tensors[0],)
    replacements = iter(tensors)
    if isinstance(inputs, Mapping):
        return {
            k: next(replacements) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()
        }
    return tuple(next(replacements) if isinstance(v, torch.Tensor) else v for v in inputs)


def _loss_of(output: Any) -> torch.Tensor:
    if isinstance(output, torch.Tensor):
        return output
    loss = getattr(output, "loss", None)
    if loss is None and isinstance(output, Mapping):
        loss = output.get("loss")
    if loss is None:
        raise CaptureError(
            f"the model returned {type(output).__name__} with no loss; pass loss_fn=... "
            "(called as loss_fn(output, *targets)) or return the loss from the model"
        )
    return loss


def _from_functional(tensor: torch.Tensor) -> torch.Tensor:
    if not isinstance(tensor, FunctionalTensor):
        return tensor
    torch._sync(tensor)
    return torch._from_functional_tensor(tensor.elem)


@contextlib.contextmanager
def _custom_meta_restored() -> Iterator[None]:
    """Put torch.fx's node annotations back as they were before the capture, once every block
    hooks opened is closed (:func:`_blocks_closed`): blocks a model raising mid-trace never
    closed would otherwise be closed out of order and restore their stale module and phase."""
    had = "custom" in fx_traceback.current_meta
    saved = dict(fx_traceback.current_meta.get("custom", {}))
    try:
        yield
    finally:
        if had:
            fx_traceback.current_meta["custom"] = saved
        else:
            fx_traceback.current_meta.pop("custom", None)


@contextlib.contextmanager
def _blocks_closed(open_blocks: list[contextlib.AbstractContextManager[None]]) -> Iterator[None]:
    """Close, innermost first, the annotation blocks hooks left open: a model that raises
    mid-trace skips the hooks that close them, and an open block, closed whenever the garbage
    collector gets to it, would put back its stale module and phase for every op traced after
    it, by any later capture."""
    try:
        yield
    finally:
        while open_blocks:
            open_blocks.pop().__exit__(None, None, None)


def _tag_backward_nodes(
    loss: torch.Tensor, open_blocks: list[contextlib.AbstractContextManager[None]]
) -> None:
    """Hook every autograd node under ``loss`` so the ops it runs name it as their origin;
    the blocks they open are kept on ``open_blocks``."""

    def enter(seq_nr: int) -> Callable[..., None]:
        def prehook(grad_outputs: Any) -> None:
            block = fx_traceback.annotate({_GRAD_OF: seq_nr})
            block.__enter__()
            open_blocks.append(block)

        return prehook

    def leave(grad_inputs: Any, grad_outputs: Any) -> None:
        open_blocks.pop().__exit__(None, None, None)

    # Visited nodes are kept alive until the walk ends. In torch 2.11 (not 2.13) the Python
    # object of an autograd node lives only while referenced (the next ``next_functions``
    # makes a new one), so a node dropped after its visit frees its address for the object of
    # a node not visited yet, whose id then reads as seen: that node and what lies only below
    # it went unhooked, their backward ops landed outside their layers, and ranks whose
    # allocators happened to differ merged different layers from one program. (A node met
    # again by another path got a new object and a second pair of hooks.)
    seen: dict[int, torch.autograd.graph.Node] = {}
    pending = [loss.grad_fn]
    while pending:
        node = pending.pop()
        if node is None or id(node) in seen:
            continue
        seen[id(node)] = node
        node.register_prehook(enter(node._sequence_nr()))
        node.register_hook(leave)
        pending.extend(next_node for next_node, _ in node.next_functions)


@contextlib.contextmanager
def _compiling() -> Iterator[None]:
    """Report ``torch.compiler.is_compiling()`` while tracing, as torch.export does.

    Libraries check it to skip value-dependent fast paths (Hugging Face skips its "is the
    attention mask all ones?" test), which a static graph could not capture anyway.
    """
    previous = torch.compiler._is_compiling_flag
    torch.compiler._is_compiling_flag = True
    try:
        yield
    finally:
        torch.compiler._is_compiling_flag = previous


@contextlib.contextmanager
def _checkpoints_inline() -> Iterator[None]:
    """Run ``torch.utils.checkpoint.checkpoint``'s function directly, each call's ops tagged
    with its number (module docstring, step 5).

    ``checkpoint`` hands its work to ``CheckpointFunction.apply`` (reentrant) or to
    ``_checkpoint_without_reentrant_generator`` (non-reentrant), both looked up in its module
    at call time, so replacing those two catches every caller, including the ones that bound
    ``checkpoint`` itself at import (Hugging Face's ``functools.partial``).
    """
    calls = itertools.count()

    class InlineCheckpoint:
        @staticmethod
        def apply(function: Callable[..., Any], preserve_rng_state: bool, *args: Any) -> Any:
            if not any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
                # Eager reentrant checkpointing differentiates only through its tensor
                # arguments: with none requiring grad, nothing inside gets a gradient.
                with torch.no_grad():
                    return function(*args)
            with fx_traceback.annotate({_CHECKPOINT: next(calls)}):
                return function(*args)

    def inline_non_reentrant(function: Callable[..., Any], preserve_rng_state: bool,
                             context_fn: Callable[..., Any], *rest: Any,
                             **kwargs: Any) -> Iterator[None]:  # fmt: skip
        if context_fn is not torch_checkpoint.noop_context_fn:
            raise CaptureError(
                "torch.utils.checkpoint.checkpoint(context_fn=...) (selective activation "
                "checkpointing) is not supported: fxpar recomputes every op of a checkpointed "
                "call; drop context_fn, or the checkpoint, and choose remat with "
                "PlanOptions(remat=...)"
            )
        with fx_traceback.annotate({_CHECKPOINT: next(calls)}):
            yield

    replaced = {
        "CheckpointFunction": InlineCheckpoint,
        "_checkpoint_without_reentrant_generator": inline_non_reentrant,
    }
    originals = {name: getattr(torch_checkpoint, name) for name in replaced}
    for name, value in replaced.items():
        setattr(torch_checkpoint, name, value)
    try:
        yield
    finally:
        for name, value in originals.items():
            setattr(torch_checkpoint, name, value)


@contextlib.contextmanager
def _module_regions(model: nn.Module, stack: list[tuple[str, str]]) -> Iterator[None]:
    """Tag forward ops with the innermost module running them, and keep that module stack."""
    names: dict[int, str] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        names.setdefault(id(module), name)
    open_blocks: list[contextlib.AbstractContextManager[None]] = []

    def pre_hook(module: nn.Module, args: Any) -> None:
        name = names[id(module)]
        stack.append((name, type(module).__name__))
        block = fx_traceback.annotate({_MODULE: name})
        block.__enter__()
        open_blocks.append(block)

    def post_hook(module: nn.Module, args: Any, output: Any) -> None:
        open_blocks.pop().__exit__(None, None, None)
        stack.pop()

    handles = []
    for module in {id(m): m for m in model.modules()}.values():
        handles.append(module.register_forward_pre_hook(pre_hook))
        handles.append(module.register_forward_hook(post_hook))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
        with _blocks_closed(open_blocks):
            pass


def _fake_state_tensor(
    fake_mode: FakeTensorMode, tensor: torch.Tensor, device: torch.device
) -> torch.Tensor:
    # Built from shape and stride only: never reads (or copies) the weights.
    with fake_mode:
        fake = torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device=device)
    return fake.requires_grad_(tensor.requires_grad)


def _unaliased(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """``tensors`` with every repeat of an earlier tensor object replaced by a copy.

    Fake-tensor conversion is memoized per real tensor, so an example that passes one tensor
    twice (``(tokens,)`` with ``example_targets=(tokens,)``) would trace both uses through one
    placeholder, and at run time the second batch tensor would be silently ignored. Each batch
    tensor must be its own input, whatever the example happens to alias.
    """
    seen: set[int] = set()
    unaliased = []
    for tensor in tensors:
        unaliased.append(tensor.clone() if id(tensor) in seen else tensor)
        seen.add(id(tensor))
    return unaliased


def _fake_batch_tensor(
    fake_mode: FakeTensorMode, tensor: torch.Tensor, device: torch.device, dynamic: bool
) -> torch.Tensor:
    if tensor.device != device:  # its values are never read: only its shape and dtype count
        tensor = torch.zeros(tensor.shape, dtype=tensor.dtype, device=device)
    if not dynamic:
        return fake_mode.from_tensor(tensor, static_shapes=True)
    sizes: list[DimDynamic] = [
        DimDynamic.DYNAMIC if s > 1 else DimDynamic.STATIC for s in tensor.shape
    ]
    context: StatelessSymbolicContext[Any, Any] = StatelessSymbolicContext(dynamic_sizes=sizes)
    return fake_mode.from_tensor(tensor, symbolic_context=context)


def _reject_unbacked_shapes(traced: fx.GraphModule) -> None:
    """Refuse graphs whose shapes depend on tensor values (boolean masks, ``nonzero``)."""
    for node in traced.graph.nodes:
        if node.op == "call_function" and free_unbacked_symbols(node.meta.get("val")):
            module = node.meta.get("custom", {}).get(_MODULE, "")
            raise CaptureError(
                f"the shape of {node.target} in module {module or '<root>'!r} depends on tensor "
                "values (boolean-mask indexing, nonzero, unique, ...), which fxpar cannot shard "
                "or plan; use a fixed-shape formulation such as torch.where or a padded mask"
            )


def _random_ops_to_inputs(
    traced: fx.GraphModule, *, taken: set[str], dynamic: bool
) -> tuple[RandomDraw, ...]:
    """Replace every random op of ``traced`` by a new placeholder after the batch's (see
    :mod:`fxpar.rng`), and return how to draw each, in graph order."""
    graph = traced.graph
    last_placeholder = [n for n in graph.nodes if n.op == "placeholder"][-1]
    draws: list[RandomDraw] = []
    for node in list(graph.nodes):
        if node.op != "call_function" or not draws_random_numbers(node):
            continue
        module = node.meta.get("custom", {}).get(_MODULE, "") or "<root>"
        if not can_draw_ahead(node):
            raise CaptureError(
                f"{node.target} in module {module!r} draws random numbers that depend on tensor "
                "values (or on a generator passed in), which fxpar cannot draw identically on "
                "every rank; express it with a shape-only draw (e.g. torch.rand_like(p) < p for "
                "bernoulli(p)), or set its dropout to 0"
            )
        if dynamic:
            raise CaptureError(
                f"{node.target} in module {module!r} draws random numbers, which fxpar does not "
                "support in dynamic=True programs yet; capture with dynamic=False, or set its "
                "dropout to 0"
            )
        name = f"random_{len(draws)}"
        while name in taken:
            name = f"_{name}"
        draws.append(RandomDraw.of(node, name))
        with graph.inserting_after(last_placeholder):
            placeholder = graph.placeholder(name)
        placeholder.meta = {**node.meta, "val": node.meta["val"]}
        last_placeholder = placeholder
        node.replace_all_uses_with(placeholder)
        graph.erase_node(node)
    graph.eliminate_dead_code()
    return tuple(draws)


def _clean_graph(traced: fx.GraphModule, signature: Signature) -> fx.GraphModule:
    """Copy the traced graph with named placeholders, identity ops dropped, and annotations."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    names = iter(signature.placeholder_names)
    for node in traced.graph.nodes:
        if node.op == "placeholder":
            name = next(names)
            new = graph.placeholder(placeholder_identifier(name))
            new.meta = dict(node.meta)
        elif node.op == "call_function" and node.target in _IDENTITY_OPS:
            env[node] = env[node.args[0]]
            continue
        elif node.op == "output":
            graph.output(fx.node.map_arg(node.args[0], env.__getitem__))
            continue
        else:
            new = graph.node_copy(node, env.__getitem__)
        env[node] = new
    graph.eliminate_dead_code()
    _annotate_values_and_regions(graph, signature)
    cast_roles(graph.nodes)
    module = fx.GraphModule(traced, graph, class_name="TrainStep")
    return module


def _annotate_values_and_regions(graph: fx.Graph, signature: Signature) -> None:
    state_names = signature.parameters + signature.buffers
    forward_module_of: dict[int, str] = {}
    position = {node: index for index, node in enumerate(graph.nodes)}
    placeholder_index = 0
    for node in graph.nodes:
        if node.op == "output":
            ir.annotate(node, ir.Region(ir.Phase.OUTPUT, ""))
            continue
        ir.annotate(node, ir.ValueMeta.of(node.meta.get("val")))
        if node.op == "placeholder":
            # A parameter or buffer belongs to the module that owns it, a random input to the
            # module that draws it, batch inputs to the root.
            owner = node.meta.get("custom", {}).get(_MODULE, "")
            if placeholder_index < len(state_names):
                owner = state_names[placeholder_index].rpartition(".")[0]
            placeholder_index += 1
            ir.annotate(node, ir.Region(ir.Phase.INPUT, owner))
            continue
        custom = node.meta.get("custom", {})
        seq_nr = node.meta.get("seq_nr")
        if custom.get(_PHASE) == ir.Phase.BACKWARD.value:
            grad_of = custom.get(_GRAD_OF)
            module = forward_module_of.get(grad_of) if grad_of is not None else None
            if module is None:
                # Seeds and gradient accumulation run outside any autograd node. An
                # accumulation adds the gradient arriving from later layers to the one just
                # computed here: it belongs with the most recent of its backward inputs.
                module = _latest_backward_module(node, position)
            ir.annotate(node, ir.Region(ir.Phase.BACKWARD, module, grad_of))
        else:
            module = custom.get(_MODULE, "")
            if custom.get(_CHECKPOINT) is not None and node.op == "call_function":
                ir.annotate(node, ir.Checkpointed(custom[_CHECKPOINT]))
            if seq_nr is not None:
                # The first forward node with a sequence number is the op that created it;
                # later ones merely inherited a stale counter.
                forward_module_of.setdefault(seq_nr, module)
            ir.annotate(node, ir.Region(ir.Phase.FORWARD, module, seq_nr))


def _latest_backward_module(node: fx.Node, position: dict[fx.Node, int]) -> str:
    backward = [
        arg
        for arg in node.all_input_nodes
        if (region := ir.get(arg, ir.Region)) is not None and region.phase is ir.Phase.BACKWARD
    ]
    if not backward:
        return ""
    return ir.require(max(backward, key=position.__getitem__), ir.Region).module


def placeholder_identifier(name: str) -> str:
    """The placeholder name of a state or batch name: ``model.layers.0.weight`` reads
    ``model_layers_0_weight``."""
    cleaned = "".join(c if c.isalnum() else "_" for c in name)
    return cleaned if cleaned and not cleaned[0].isdigit() else f"_{cleaned}"


# --- errors -----------------------------------------------------------------------------------

_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_FXPAR_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
_STDLIB_DIR = sysconfig.get_paths()["stdlib"] + os.sep
_SITE_DIRS = (sysconfig.get_paths()["purelib"] + os.sep, sysconfig.get_paths()["platlib"] + os.sep)


def _is_library_file(filename: str) -> bool:
    """Frames of torch, fxpar and the standard library are not where a user's model failed."""
    filename = os.path.abspath(filename)
    if filename.startswith((_TORCH_DIR, _FXPAR_DIR)):
        return True
    return filename.startswith(_STDLIB_DIR) and not filename.startswith(_SITE_DIRS)


def _capture_error(
    model: nn.Module, module_stack: list[tuple[str, str]], error: Exception
) -> CaptureError:
    where = _user_frame(error)
    module = (
        f"module {module_stack[-1][0] or '<root>'!r} ({module_stack[-1][1]})"
        if module_stack
        else f"{type(model).__name__}"
    )
    location = f" at {where}" if where else ""
    if isinstance(error, _DATA_DEPENDENT):
        advice = (
            "the Python control flow or shape depends on tensor values, which a static graph "
            "cannot capture. Compute both branches and select with torch.where, or move the "
            "data-dependent decision out of forward"
        )
    elif isinstance(error, UnsupportedOperatorException):
        advice = (
            f"the op {error.func} has no fake-tensor implementation; register one with "
            "torch.library.register_fake, or replace the op"
        )
    else:
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else ""
        advice = f"{type(error).__name__}: {first_line}"
    return CaptureError(
        f"cannot capture {type(model).__name__}: tracing stopped in {module}{location}: {advice}"
    )


def _user_frame(error: BaseException) -> str | None:
    """The innermost traceback frame outside torch and fxpar, as 'file:line `source`'."""
    found = None
    for frame in traceback.extract_tb(error.__traceback__):
        if frame.filename.startswith("<") or _is_library_file(frame.filename):
            continue
        found = frame
    if found is None:
        return None
    source = (found.line or linecache.getline(found.filename, found.lineno or 0)).strip()
    return f"{found.filename}:{found.lineno} `{source}`"
