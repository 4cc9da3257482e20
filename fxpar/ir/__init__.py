"""The IR: one training step captured as a functional graph of ATen ops.

``fxpar.ir`` itself is the typed node-annotation API (:mod:`fxpar.ir.meta`): ``ir.annotate``,
``ir.get``, ``ir.require`` and the built-in annotations. The stage's modules:

- :mod:`fxpar.ir.capture`: an ``nn.Module``, a loss and example inputs to a :class:`Program`;
- :mod:`fxpar.ir.repeat`: a deep model captured from six of its repeated layers;
- :mod:`fxpar.ir.program`: the Program (graph + signature) and how to run it;
- :mod:`fxpar.ir.rng`: random ops turned into random inputs drawn alike on every rank;
- :mod:`fxpar.ir.verify`: the IR's invariants;
- :mod:`fxpar.ir.flops`, :mod:`fxpar.ir.op_table`, :mod:`fxpar.ir.aten_ops`: what each ATen op
  computes and moves (the facts the cost annotation reads);
- :mod:`fxpar.ir.work_report`: where a Program's work and memory traffic go, per module.
"""

from __future__ import annotations

from fxpar.ir.meta import (
    LOSS_REGION,
    META_KEY,
    CastRole,
    Checkpointed,
    Cost,
    NumberedLayer,
    Phase,
    PrecisionCast,
    Region,
    Rematerialized,
    Size,
    TensorMeta,
    ValueMeta,
    all_annotations,
    annotate,
    as_size,
    evaluate,
    get,
    numbered_layer,
    product,
    require,
    total,
)

__all__ = [
    "LOSS_REGION",
    "META_KEY",
    "CastRole",
    "Checkpointed",
    "Cost",
    "NumberedLayer",
    "Phase",
    "PrecisionCast",
    "Region",
    "Rematerialized",
    "Size",
    "TensorMeta",
    "ValueMeta",
    "all_annotations",
    "annotate",
    "as_size",
    "evaluate",
    "get",
    "numbered_layer",
    "product",
    "require",
    "total",
]
