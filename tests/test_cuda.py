"""fxpar on a GPU: programs placed on the device, CUDA's attention kernels in place of the CPU's,
and compiled models training on one GPU and on gloo processes that share it.

The tests marked ``cuda`` need a GPU and skip without one; the others check, on any machine,
what the GPU paths rest on: a placed program names no other device (run on the meta device,
where any tensor left on the CPU fails), the attention that replaces the CPU kernels computes
their values with their shapes and strides, a pipeline's stages run where they are placed, and
a CUDA cluster without a GPU is refused with a clear error. ``FXPAR_TEST_DEVICE=cuda`` runs the
property tests and the zoo (tests/test_property.py, tests/test_manual_plans_zoo.py) on the GPU
too.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import transformers
from hypothesis import given, settings
from hypothesis import strategies as st

import fxpar
from fxpar import plans
from fxpar.cluster import Cluster
from fxpar.errors import DistributedError, FxparError
from fxpar.ir.placement import attention, attention_backward, devices_named, place
from fxpar.lowering import lower
from fxpar.models import GPT, GPTConfig, gpt_loss
from fxpar.pipeline import PipelineModel
from fxpar.runtime import devices
from fxpar.testing import simulate
from fxpar.testing.strategies import splitting_cluster

aten = torch.ops.aten
HAVE_CUDA = torch.cuda.is_available()
cuda = pytest.mark.skipif(not HAVE_CUDA, reason="needs a CUDA GPU")

CONFIG = GPTConfig(n_layer=2, n_embd=32, n_head=4, vocab_size=64, block_size=16, bias=False)


def _llama() -> transformers.LlamaForCausalLM:
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


# -- on any machine ---------------------------------------------------------------------------


@pytest.mark.parametrize("model", ["gpt", "llama"])
def test_placed_rank_programs_name_no_other_device(model: str) -> None:
    """Every rank program of a plan, placed on the meta device, runs on meta inputs: nothing
    in it makes a tensor on the CPU (the unplaced program does, and fails)."""
    if model == "gpt":
        net = GPT(dataclasses.replace(CONFIG, dropout=0.1))
        tokens = torch.randint(0, CONFIG.vocab_size, (4, 16))
        program = fxpar.capture(net, (tokens,), gpt_loss, example_targets=(tokens,))
        flat = program.flat_inputs(net, tokens, tokens)
    else:
        net = _llama()
        ids = torch.randint(0, 128, (2, 16))
        program = fxpar.capture(net, {"input_ids": ids, "labels": ids})
        flat = program.flat_inputs(net, ids, ids)
    assert torch.device("cpu") in devices_named(program.graph_module)
    metas = [tensor.to("meta") for tensor in flat]
    with pytest.raises(RuntimeError, match="device"):
        program.graph_module(*metas)
    cluster = Cluster((2, 2))
    spmd = lower(plans.random_plan(program, cluster, 3), cluster)
    for rank in spmd.ranks:
        placed = place(rank.graph_module, "meta")
        assert devices_named(placed) <= {torch.device("meta")}
    result = simulate(spmd, metas).result
    assert result.loss.device.type == "meta"
    assert all(g.device.type == "meta" for g in result.gradients.values())


def test_a_program_on_its_own_device_is_not_copied() -> None:
    net = GPT(CONFIG)
    tokens = torch.randint(0, CONFIG.vocab_size, (2, 8))
    program = fxpar.capture(net, (tokens,), gpt_loss, example_targets=(tokens,))
    assert place(program.graph_module, "cpu") is program.graph_module
    placed = place(program.graph_module, "meta")
    assert place(program.graph_module, "meta") is placed  # made once


def _attention_inputs(
    dtype: torch.dtype, groups: int, mask: str, length: int, device: str = "cpu"
) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(length * 7 + groups)

    def draw(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator).to(dtype).to(device)

    query = draw(2, 4, length, 16)
    key, value = draw(2, 4 // groups, length, 16), draw(2, 4 // groups, length, 16)
    bias = draw(2, 1, length, length) if mask == "bias" else None
    return query, key, value, bias  # type: ignore[return-value]


@settings(max_examples=30)
@given(
    dtype=st.sampled_from([torch.float32, torch.float64, torch.bfloat16]),
    causal=st.booleans(),
    groups=st.sampled_from([1, 2, 4]),
    mask=st.sampled_from(["none", "bias"]),
    length=st.integers(1, 40),
    scale=st.sampled_from([None, 0.3]),
    transposed=st.booleans(),
)
def test_attention_off_the_cpu_computes_the_cpu_kernels_values_and_layouts(
    dtype: torch.dtype,
    causal: bool,
    groups: int,
    mask: str,
    length: int,
    scale: float | None,
    transposed: bool,
) -> None:
    """What replaces the CPU's attention kernels off the CPU (here its plain-formula route)
    gives their outputs, log-sum-exps and gradients, with their shapes, strides and dtypes:
    grouped keys (GQA), causal masks, additive masks, any scale, transposed inputs."""
    query, key, value, bias = _attention_inputs(dtype, groups, mask, length)
    if transposed:
        query = query.transpose(1, 2).contiguous().transpose(1, 2)
    want = aten._scaled_dot_product_flash_attention_for_cpu.default(
        query, key, value, 0.0, causal, attn_mask=bias, scale=scale
    )
    got = attention(query, key, value, 0.0, causal, attn_mask=bias, scale=scale)
    grad = torch.randn(want[0].shape).to(dtype)
    want_grads = aten._scaled_dot_product_flash_attention_for_cpu_backward.default(
        grad, query, key, value, *want, 0.0, causal, attn_mask=bias, scale=scale
    )
    got_grads = attention_backward(
        grad, query, key, value, *want, 0.0, causal, attn_mask=bias, scale=scale
    )
    tolerance = 3e-2 if dtype == torch.bfloat16 else 1e-5
    for expected, found in zip((*want, *want_grads), (*got, *got_grads), strict=True):
        assert found.shape == expected.shape and found.stride() == expected.stride()
        assert found.dtype == expected.dtype
        torch.testing.assert_close(found, expected, rtol=tolerance, atol=tolerance)


def test_attention_with_dropout_is_refused_off_the_cpu() -> None:
    query, key, value, _ = _attention_inputs(torch.float32, 1, "none", 4)
    with pytest.raises(NotImplementedError, match="dropout"):
        attention(query, key, value, 0.1)


@pytest.mark.skipif(HAVE_CUDA, reason="checks the machine without a GPU")
def test_a_cuda_cluster_without_a_gpu_is_refused() -> None:
    net = GPT(CONFIG)
    tokens = torch.randint(0, CONFIG.vocab_size, (2, 8))
    cluster = Cluster.preset("h100", (1,))
    with pytest.raises(DistributedError, match="torch sees no GPU"):
        fxpar.compile(net, cluster, (tokens,), gpt_loss, example_targets=(tokens,))
    # Planning for GPUs needs none.
    planned = fxpar.plan(net, cluster, (tokens,), gpt_loss, example_targets=(tokens,))
    assert planned.cluster.device_type == "cuda" and planned.solution.status == "optimal"


@pytest.mark.skipif(HAVE_CUDA, reason="checks the machine without a GPU")
def test_a_pipeline_on_a_cuda_cluster_without_a_gpu_is_refused() -> None:
    net = GPT(CONFIG)
    tokens = torch.randint(0, CONFIG.vocab_size, (2, 8))
    with pytest.raises(DistributedError, match="torch sees no GPU"):
        fxpar.compile(
            net, Cluster.preset("h100", (2,)), (tokens,), gpt_loss, example_targets=(tokens,),
            pipeline=fxpar.Pipeline(2, 2),
        )  # fmt: skip


def test_unknown_device_types_are_refused() -> None:
    net = GPT(CONFIG)
    tokens = torch.randint(0, CONFIG.vocab_size, (2, 8))
    for pipeline in (None, fxpar.Pipeline(2, 2)):
        with pytest.raises(FxparError, match="device_type 'cpu' or 'cuda', not 'xpu'"):
            fxpar.compile(
                net, Cluster((1,), device_type="xpu"), (tokens,), gpt_loss,
                example_targets=(tokens,), pipeline=pipeline,
            )  # fmt: skip


def test_a_pipeline_runs_its_stages_where_they_are_placed() -> None:
    """A pipeline's state, micro-batches and stage programs (training step and forward) live
    on its device: on the meta device any tensor left on the CPU would fail the step."""
    net = GPT(dataclasses.replace(CONFIG, dropout=0.1))
    tokens = torch.randint(0, CONFIG.vocab_size, (4, 8))
    pipelined = PipelineModel(
        net, fxpar.Pipeline(1, microbatches=2), (tokens,), gpt_loss, example_targets=(tokens,),
        device="meta",
    )  # fmt: skip
    assert pipelined.device == torch.device("meta")
    loss = pipelined.step(tokens, tokens)
    logits = pipelined(tokens)
    assert loss.device.type == "meta" and logits.device.type == "meta"
    assert logits.shape == (4, 8, CONFIG.vocab_size)
    assert {p.device.type for p in pipelined.parameters.values()} == {"meta"}
    for step in pipelined._steps.values():
        for unit in step.worker.forward + step.worker.backward:
            assert devices_named(unit.graph_module) <= {torch.device("meta")}
    # The same programs on the CPU name the CPU: placement is what moved them.
    on_cpu = PipelineModel(
        net, fxpar.Pipeline(1, microbatches=2), (tokens,), gpt_loss, example_targets=(tokens,)
    )
    assert on_cpu.step(tokens, tokens).device.type == "cpu"
    units = on_cpu._steps[("train", True, None)].worker.forward
    assert any(torch.device("cpu") in devices_named(unit.graph_module) for unit in units)


def test_the_backend_follows_the_gpus_a_node_has() -> None:
    assert devices.default_backend("cpu", 4) == "gloo"
    expected = "nccl" if HAVE_CUDA and torch.cuda.device_count() >= 2 else "gloo"
    assert devices.default_backend("cuda", 2) == expected
    assert devices.default_backend("cuda", 10_000) == "gloo"  # more processes than GPUs share


# -- on a GPU ---------------------------------------------------------------------------------


@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mask", ["none", "bias"])
@pytest.mark.parametrize("groups", [1, 2])
def test_cuda_attention_kernels_agree_with_the_cpu_kernels(
    dtype: torch.dtype, mask: str, groups: int
) -> None:
    """CUDA's flash (16-bit, no mask) and memory-efficient kernels, as :func:`attention`
    routes to them, give the CPU kernels' values and layouts, the backward included."""
    for causal in (False, True):
        cpu_inputs = _attention_inputs(dtype, groups, mask, 40)
        want = aten._scaled_dot_product_flash_attention_for_cpu.default(
            *cpu_inputs[:3], 0.0, causal, attn_mask=cpu_inputs[3]
        )
        grad = torch.randn(want[0].shape).to(dtype)
        want_grads = aten._scaled_dot_product_flash_attention_for_cpu_backward.default(
            grad, *cpu_inputs[:3], *want, 0.0, causal, attn_mask=cpu_inputs[3]
        )
        query, key, value, bias = (t.cuda() if t is not None else None for t in cpu_inputs)
        got = attention(query, key, value, 0.0, causal, attn_mask=bias)
        got_grads = attention_backward(
            grad.cuda(), query, key, value, *got, 0.0, causal, attn_mask=bias
        )
        tolerance = 3e-2 if dtype == torch.bfloat16 else 2e-4
        for expected, found in zip((*want, *want_grads), (*got, *got_grads), strict=True):
            assert found.shape == expected.shape and found.stride() == expected.stride()
            torch.testing.assert_close(found.cpu(), expected, rtol=tolerance, atol=tolerance)


def _eager_losses(model: torch.nn.Module, batches: list, *, bf16: bool = False) -> list[float]:
    """Eager AdamW (lr 1e-2) on ``batches``, under bf16 autocast with ``bf16``."""
    device = next(model.parameters()).device.type
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for tokens, targets in batches:
        optimizer.zero_grad()
        with torch.autocast(device, torch.bfloat16, enabled=bf16):
            loss = gpt_loss(model(tokens), targets)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def _gpt_batches(device: str = "cpu") -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [
        (
            torch.randint(0, CONFIG.vocab_size, (4, 8), generator=generator).to(device),
            torch.randint(0, CONFIG.vocab_size, (4, 8), generator=generator).to(device),
        )
        for _ in range(4)
    ]


@cuda
def test_one_gpu_trains_like_eager_pytorch_on_it() -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    batches = _gpt_batches("cuda")
    torch.manual_seed(0)
    expected = _eager_losses(GPT(CONFIG).cuda(), batches)
    torch.manual_seed(0)
    compiled = fxpar.compile(
        GPT(CONFIG), Cluster.preset("h100", (1,)), (batches[0][0],), gpt_loss,
        example_targets=(batches[0][1],), optimizer=fxpar.optim.AdamW(lr=1e-2),
    )  # fmt: skip
    assert compiled.device.type == "cuda"
    assert all(p.is_cuda for p in compiled.parameters.values())
    losses = [compiled.step(tokens, targets).item() for tokens, targets in batches]
    assert losses == pytest.approx(expected, rel=1e-4)
    assert devices.peak_memory(compiled.device) > 0


@cuda
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_one_gpu_trains_an_hf_llama_like_eager(precision: str) -> None:
    """A real model whose attention runs CUDA's kernels (flash under bf16, memory-efficient in
    float32) in place of the CPU's it was captured with."""
    torch.backends.cuda.matmul.allow_tf32 = False
    ids = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(2)).cuda()
    torch.manual_seed(0)
    model = _llama().cuda()
    mixed = fxpar.MixedPrecision(torch.bfloat16) if precision == "bf16" else None
    compiled = fxpar.compile(
        model, Cluster.preset("h100", (1,)), {"input_ids": ids, "labels": ids},
        optimizer=fxpar.optim.SGD(lr=0.1), mixed_precision=mixed,
    )  # fmt: skip
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        optimizer.zero_grad()
        with torch.autocast("cuda", torch.bfloat16, enabled=mixed is not None):
            expected = model(input_ids=ids, labels=ids).loss
        expected.backward()
        optimizer.step()
        loss = compiled.step(input_ids=ids, labels=ids)
        tolerance = 2e-2 if mixed is not None else 1e-4
        assert loss.item() == pytest.approx(expected.item(), rel=tolerance)


def _ranks(rank: int, world_size: int, precision: str, device: str) -> dict[str, object]:
    torch.backends.cuda.matmul.allow_tf32 = False
    cluster = dataclasses.replace(splitting_cluster((world_size,)), device_type=device)
    # Two stages; with 4 processes each stage runs the ILP's plan on a mesh of 2.
    staged = dataclasses.replace(
        splitting_cluster((2, world_size // 2) if world_size > 2 else (2,)), device_type=device
    )
    batches = _gpt_batches()
    results: dict[str, object] = {}
    mixed = fxpar.MixedPrecision(torch.bfloat16) if precision == "bf16" else None
    for name, manual in {
        "data_parallel": plans.data_parallel,
        "tensor_parallel": plans.tensor_parallel,
        "fully_sharded": plans.fully_sharded,
        "ilp": None,
        "pipeline": None,
    }.items():
        torch.manual_seed(0)
        pipeline = fxpar.Pipeline(2, microbatches=2) if name == "pipeline" else None
        compiled = fxpar.compile(
            GPT(CONFIG), staged if pipeline else cluster, (batches[0][0],), gpt_loss,
            example_targets=(batches[0][1],), optimizer=fxpar.optim.AdamW(lr=1e-2),
            manual=manual, mixed_precision=mixed, pipeline=pipeline,
        )  # fmt: skip
        assert compiled.device.type == device
        assert all(p.device.type == device for p in compiled.parameters.values())
        losses = []
        for index, (tokens, targets) in enumerate(batches):
            print(f"rank {rank}: {name} step {index}", flush=True)  # shown if a rank fails
            losses.append(compiled.step(tokens, targets).item())
        state = compiled.full_state_dict()
        results[name] = (losses, {k: v.cpu() for k, v in state.items()})
    return results


@pytest.mark.slow
@pytest.mark.parametrize(
    ("world", "precision", "device"),
    [
        pytest.param(2, "fp32", "cuda", marks=cuda),
        pytest.param(2, "bf16", "cuda", marks=cuda),
        pytest.param(4, "fp32", "cuda", marks=cuda),
        pytest.param(4, "bf16", "cuda", marks=cuda),
        (2, "fp32", "cpu"),  # the same on CPU processes: a failure here is not the GPU's
    ],
)
def test_processes_sharing_the_gpu_train_like_one_device(
    world: int, precision: str, device: str
) -> None:
    """Data, tensor and fully sharded parallel, the ILP's plan and a 2-stage pipeline (whose
    stages, with 4 processes, run the ILP's plan on 2 devices each) on 2 or 4 gloo processes
    whose tensors live on the one GPU (collectives and messages staged through host memory)
    give eager PyTorch's losses and weights on that GPU."""
    from fxpar.runtime.launch import spawn

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.manual_seed(0)
    reference = GPT(CONFIG).to(device)
    expected = _eager_losses(reference, _gpt_batches(device), bf16=precision == "bf16")
    weights = {k: v.cpu() for k, v in reference.state_dict().items()}
    ranks = spawn(_ranks, world, precision, device)
    # AdamW turns rounding noise in a near-zero gradient into an update of up to lr: one
    # weight in 4096 was seen 1.9e-5 off after 4 steps at lr 1e-2 on a GPU (cuBLAS sums in
    # other orders than one device's) and 1.3e-5 on a 16-core CPU, so weights compare to
    # 1e-2 * lr; the losses, to 1e-4, are the sharper check.
    floor = 1e-4
    for name, (losses, state) in ranks[0].items():
        tolerance = 3e-2 if precision == "bf16" else 1e-4
        assert losses == pytest.approx(expected, rel=tolerance), name
        if precision == "fp32":
            for key, value in state.items():
                torch.testing.assert_close(value, weights[key], rtol=1e-4, atol=floor)
    for other in ranks[1:]:  # every rank reports the same losses
        for name, (losses, _) in other.items():  # type: ignore[union-attr]
            assert losses == pytest.approx(ranks[0][name][0], rel=1e-6), name  # type: ignore[index]
    assert math.isfinite(ranks[-1]["pipeline"][0][-1])  # type: ignore[index]


@cuda
def test_calibrate_measures_the_gpu() -> None:
    from fxpar.runtime.launch import spawn

    cluster = spawn(_calibrate, 1)[0]
    assert cluster.device_type == "cuda"
    assert cluster.flops > 1e13  # a bfloat16 product on any recent GPU
    assert cluster.memory_bandwidth > 1e11


def _calibrate(rank: int, world_size: int) -> Cluster:
    return fxpar.calibrate(Cluster.preset("h100", (1,)))


_OVER_NCCL = """
import json, os, sys, torch, torch.distributed as dist, fxpar
from fxpar.models import GPT, GPTConfig, gpt_loss
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1], LOCAL_RANK="0")
dist.init_process_group("nccl", rank=0, world_size=1)
torch.backends.cuda.matmul.allow_tf32 = False
config = GPTConfig(**json.loads(sys.argv[2]))
generator = torch.Generator().manual_seed(1)
batches = [
    [torch.randint(0, config.vocab_size, (4, 8), generator=generator) for _ in range(2)]
    for _ in range(4)
]
cluster = fxpar.Cluster.preset("h100", (1,))
losses = {}
for name, pipeline in {"intra_op": None, "pipeline": fxpar.Pipeline(1, microbatches=2)}.items():
    torch.manual_seed(0)
    compiled = fxpar.compile(
        GPT(config), cluster, (batches[0][0],), gpt_loss, example_targets=(batches[0][1],),
        optimizer=fxpar.optim.AdamW(lr=1e-2), pipeline=pipeline,
    )
    assert compiled.device.type == "cuda", compiled.device
    losses[name] = [compiled.step(tokens, targets).item() for tokens, targets in batches]
print(json.dumps({"backend": dist.get_backend(), "losses": losses}))
dist.destroy_process_group()
"""


@cuda
@pytest.mark.slow
def test_one_process_over_nccl_trains_like_eager() -> None:
    """NCCL refuses two processes on one GPU, so with one GPU NCCL runs one process: what
    fxpar sends through the process group outside its programs (the random state's
    broadcast, the device mesh) takes GPU tensors there, and the step trains like eager
    PyTorch, with and without a (one-stage) pipeline."""
    import json
    import socket
    import subprocess
    import sys

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    config = {"n_layer": 2, "n_embd": 32, "n_head": 4, "vocab_size": 64, "block_size": 16}
    done = subprocess.run(
        [sys.executable, "-c", _OVER_NCCL, str(port), json.dumps({**config, "bias": False})],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["backend"] == "nccl"
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.manual_seed(0)
    expected = _eager_losses(GPT(CONFIG).cuda(), _gpt_batches("cuda"))
    for name, losses in result["losses"].items():
        assert losses == pytest.approx(expected, rel=1e-4), name
