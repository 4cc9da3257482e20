"""How good the automatic plan is: its cost next to the hand-written plans and the exact optimum.

    python benchmarks/plan_quality.py                  # every model on meshes (2,), (2, 2), (2, 4)
    python benchmarks/plan_quality.py llama gpt --meshes 2 2x2
    python benchmarks/plan_quality.py mixtral-64x1024 --meshes 2x4

Each model is built on the meta device (no weights) from a small config, captured with its
batch, and planned for H100s (``Cluster.preset("h100", mesh)``). Every plan is priced by the same
cost model, on the exact problem (``fxpar.planning.plan.score``). Columns, in ms per step:

- ``ilp``: ``fxpar.plan`` with its defaults (repeated layers merged, hand-written plans as
  starting plans);
- ``exact``: the ILP on the problem with no reduction of the builder's (no merged layers);
- ``coarse``: the ILP with follower coarsening (``PlanOptions(coarsen=True)``, off by default
  since it loses the optimum);
- ``repl``, ``dp``, ``tp``, ``fsdp``: the manual plans (replicated; data parallel; tensor
  parallel with the default module names, the better of its mesh axes; fully sharded);
- ``ep``: expert parallelism (``plans.expert_parallel``: experts split on one mesh axis, the
  batch on the others, the better of its axes; its axis is printed beside it), for models with
  experts: the tokens whole on the expert axis (the default dispatch, ``all_reduce``);
- ``ep a2a``: the same with the batch split over the expert axis too and each MoE block's rows
  sent to their experts' devices and back (``dispatch="all_to_all"``);
- ``ilp/best``: the default ILP over the cheapest other column (1.00 when it is the best);
- ``ilp experts``: for models with experts, the specs the default ILP's grouped products give
  their stacked experts (``S(0)`` on an axis: experts split there, as expert parallelism does;
  ``S(1)``/``S(2)``: split inside each expert; ``R``: whole).
"""

from __future__ import annotations

import argparse
import functools
import math
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

BATCH = 8


class CNN(nn.Module):
    """Convolutions with BatchNorm and a linear classifier (CIFAR-sized)."""

    def __init__(self, width: int = 64, classes: int = 10) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        channels = 3
        for out in (width, 2 * width, 4 * width):
            layers += [nn.Conv2d(channels, out, 3, padding=1), nn.BatchNorm2d(out), nn.ReLU()]
            layers.append(nn.MaxPool2d(2))
            channels = out
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Linear(channels * 4 * 4, classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(images).flatten(1))


def _lm(model: nn.Module, length: int) -> tuple[nn.Module, Any, Any, tuple[Any, ...]]:
    tokens = torch.zeros(BATCH, length, dtype=torch.long)
    return model, {"input_ids": tokens, "labels": tokens}, None, ()


def _decoder(**extra: Any) -> dict[str, Any]:
    shape = dict(
        vocab_size=2048, hidden_size=256, intermediate_size=1024, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256,
    )  # fmt: skip
    return {**shape, **extra}


def llama() -> Any:
    import transformers

    return _lm(transformers.LlamaForCausalLM(transformers.LlamaConfig(**_decoder())), 128)


def llama_shape() -> Any:
    """The Llama shape of issue 14: width 1024, 4 layers, batch 8 x 512."""
    import transformers

    config = transformers.LlamaConfig(
        **_decoder(hidden_size=1024, intermediate_size=4096, num_hidden_layers=4,
                   num_attention_heads=16, num_key_value_heads=8, vocab_size=32000,
                   max_position_embeddings=512)
    )  # fmt: skip
    return _lm(transformers.LlamaForCausalLM(config), 512)


def mixtral() -> Any:
    import transformers

    config = transformers.MixtralConfig(
        **_decoder(intermediate_size=512), num_local_experts=4, num_experts_per_tok=2
    )
    return _lm(transformers.MixtralForCausalLM(config), 128)


def t5() -> Any:
    import transformers

    config = transformers.T5Config(
        vocab_size=2048, d_model=256, d_kv=64, d_ff=1024, num_layers=2, num_decoder_layers=2,
        num_heads=4, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0,
    )  # fmt: skip
    tokens = torch.zeros(BATCH, 128, dtype=torch.long)
    model = transformers.T5ForConditionalGeneration(config)
    return model, {"input_ids": tokens, "labels": tokens[:, :64]}, None, ()


def vit() -> Any:
    import transformers

    config = transformers.ViTConfig(
        image_size=64, patch_size=8, num_channels=3, hidden_size=256, num_hidden_layers=2,
        num_attention_heads=4, intermediate_size=1024, num_labels=10, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    images = torch.zeros(BATCH, 3, 64, 64)
    labels = torch.zeros(BATCH, dtype=torch.long)
    model = transformers.ViTForImageClassification(config)
    return model, {"pixel_values": images, "labels": labels}, None, ()


def cnn() -> Any:
    images = torch.zeros(BATCH, 3, 32, 32)
    labels = torch.zeros(BATCH, dtype=torch.long)
    return CNN(), (images,), F.cross_entropy, (labels,)


def gpt() -> Any:
    from fxpar.models import GPT, GPTConfig, gpt_loss

    model = GPT(GPTConfig(n_layer=2, n_embd=256, n_head=4, vocab_size=2048, block_size=128))
    tokens = torch.zeros(BATCH, 128, dtype=torch.long)
    return model, (tokens,), gpt_loss, (tokens,)


def mixtral_many_experts() -> Any:
    """A Mixtral-like shape with 64 experts at width 1024 (fxpar.models.shapes), batch 8 x 512."""
    from fxpar.models.shapes import mixtral_named

    return _lm(mixtral_named("mixtral-64x1024"), 512)


MODELS: dict[str, Callable[[], Any]] = {
    "llama": llama,
    "mixtral": mixtral,
    "t5": t5,
    "vit": vit,
    "cnn": cnn,
    "gpt": gpt,
    "llama-1024x4": llama_shape,
    "mixtral-64x1024": mixtral_many_experts,
}


def expert_specs(plan: Any) -> str:
    """The distinct specs the plan's grouped products give the tensor holding their experts on
    dim 0 (the stacked weights, or their gradient), or "-" for a model without experts."""
    from fxpar import ir
    from fxpar.rules import op_call
    from fxpar.rules.experts import experts_spec, is_grouped_product
    from fxpar.sharding import Sharding, spec_str

    program = plan.program
    specs = set()
    for node in program.graph.nodes:
        if node.op == "call_function" and is_grouped_product(node.target):
            call = op_call(node, program.cluster.mesh_shape)
            specs.add(spec_str(experts_spec(call, ir.require(node, Sharding).strategy)))
    return " ".join(sorted(specs)) or "-"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*", default=list(MODELS))
    parser.add_argument("--meshes", nargs="*", default=["2", "2x2", "2x4"])
    args = parser.parse_args()

    import fxpar
    from fxpar import plans
    from fxpar.errors import FxparError
    from fxpar.passes import plan_program
    from fxpar.planning.plan import score
    from fxpar.planning.problem import PlanOptions

    def capture(name: str) -> fxpar.Program:
        with torch.device("meta"):
            model, inputs, loss_fn, targets = MODELS[name]()
        return fxpar.capture(model, inputs, loss_fn, example_targets=targets)

    header = ("model", "mesh", "ilp", "exact", "coarse", "repl", "dp", "tp", "fsdp", "ep",
              "ep a2a", "ilp/best", "ilp s", "ilp experts")  # fmt: skip
    print(" | ".join(header))
    print(" | ".join("-" * len(h) for h in header))
    for name in args.models:
        for mesh in (tuple(int(n) for n in m.split("x")) for m in args.meshes):
            cluster = fxpar.Cluster.preset("h100", mesh)
            runs: dict[str, dict[str, Any]] = {
                "ilp": {},
                "exact": {"options": PlanOptions(dedup_layers=False)},
                "coarse": {"options": PlanOptions(coarsen=True)},
                "repl": {"manual": plans.replicated},
                "dp": {"manual": plans.data_parallel},
                "fsdp": {"manual": plans.fully_sharded},
            }
            for axis in range(len(mesh)):
                runs[f"tp{axis}"] = {"manual": functools.partial(plans.tensor_parallel, axis=axis)}
                for kind, dispatch in (("ep", "all_reduce"), ("a2a", "all_to_all")):
                    manual = functools.partial(plans.expert_parallel, axis=axis, dispatch=dispatch)
                    runs[f"{kind}{axis}"] = {"manual": manual}
            costs: dict[str, float] = {}
            seconds, chosen = math.nan, "-"
            for label, how in runs.items():
                start = time.perf_counter()
                try:
                    plan = plan_program(capture(name), cluster, **how)
                except FxparError:
                    continue
                if label == "ilp":
                    seconds = time.perf_counter() - start
                    chosen = expert_specs(plan)
                costs[label] = score(plan) * 1e3
            axes = {}
            for kind in ("tp", "ep", "a2a"):
                by_axis = {label: cost for label, cost in costs.items() if label.startswith(kind)}
                if by_axis:
                    best = min(by_axis, key=by_axis.__getitem__)
                    costs[kind], axes[kind] = by_axis[best], best[len(kind) :]
            others = [cost for label, cost in costs.items() if label not in ("ilp",)]
            ratio = costs["ilp"] / min(others)

            columns = (*header[2:10], "a2a")
            cells = [f"{costs[label]:.3f}" if label in costs else "-" for label in columns]
            for kind in ("ep", "a2a"):
                if kind in axes and len(mesh) > 1:
                    cells[columns.index(kind)] += f" (axis {axes[kind]})"
            mesh_name = "x".join(map(str, mesh))
            row = (name, mesh_name, *cells, f"{ratio:.2f}", f"{seconds:.1f}", chosen)
            print(" | ".join(row), flush=True)


if __name__ == "__main__":
    main()
