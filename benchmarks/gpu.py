"""fxpar's step on one GPU beside eager PyTorch and ``torch.compile`` on the same GPU, in one run.

The model is Hugging Face's ``LlamaForCausalLM`` in a Llama shape (``--layers`` 8, width
``--width`` 2048, 16 heads, SwiGLU of 5632, vocab 32000), trained on a batch of
``--batch`` x ``--length`` (8 x 2048) tokens with bfloat16 compute, float32 master weights and
AdamW (lr 1e-4), from the same seeded weights, three ways in one process:

- eager: the model as it is under ``torch.autocast("cuda", torch.bfloat16)``, ``torch.optim.AdamW``
  (its default, multi-tensor implementation);
- torch.compile: the same with ``torch.compile(model)`` (default mode);
- fxpar: ``fxpar.compile`` on a one-device ``h100`` cluster with ``fxpar.MixedPrecision(bf16)``
  and ``fxpar.optim.AdamW`` (the same torch optimizer over the float32 master weights).

Each takes ``--warmup`` steps (compilation, fxpar's planning; at least 17, since from its 17th
call an fxpar program runs its fast copy), then ``--steps`` timed steps,
each ended by a ``torch.cuda.synchronize``; the table gives the median step, tokens per second,
model FLOPs utilisation (6 x parameters x tokens plus the attention's 12 x layers x width x
length per token, over the step and the GPU's dense bf16 peak, 989 TFLOP/s for an H100 or
H200), the peak memory (``torch.cuda.max_memory_allocated``), the loss after the last step,
and fxpar's ratio to eager. fxpar's own estimate of its step (the plan's cost model on the
``h100`` preset, and on the cluster ``fxpar calibrate`` measures on this GPU) is printed
beside its measured step.

    python benchmarks/gpu.py                 # the Llama shape above (about 3 minutes)
    python benchmarks/gpu.py --layers 2 --width 512 --length 512   # a quick look
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import statistics
import time
from collections.abc import Callable

import torch
import transformers

import fxpar
from fxpar.planning.plan import score
from fxpar.runtime import devices, fastcall

PEAK_BF16 = 989e12
GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda" if GPU else "cpu")


def peak() -> int:
    return devices.peak_memory(DEVICE) or 0


def llama(args: argparse.Namespace) -> transformers.LlamaForCausalLM:
    config = transformers.LlamaConfig(
        vocab_size=32000, hidden_size=args.width, intermediate_size=args.width * 11 // 4,
        num_hidden_layers=args.layers, num_attention_heads=args.width // 128,
        num_key_value_heads=args.width // 128, max_position_embeddings=args.length,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def time_steps(step: Callable[[], torch.Tensor], warmup: int, steps: int) -> tuple[list, float]:
    for _ in range(warmup):
        step()
    devices.synchronize(DEVICE)
    times, loss = [], 0.0
    for _ in range(steps):
        start = time.perf_counter()
        loss = step().item()  # .item() waits for the step
        devices.synchronize(DEVICE)
        times.append(time.perf_counter() - start)
    return times, loss


def torch_variant(args: argparse.Namespace, ids: torch.Tensor, compiled: bool) -> dict:
    model = llama(args).to(args.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    forward = torch.compile(model) if compiled else model

    def step() -> torch.Tensor:
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(args.device, torch.bfloat16):
            loss = forward(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        return loss.detach()

    devices.reset_peak_memory(DEVICE)
    started = time.perf_counter()
    times, loss = time_steps(step, warmup_steps(args), args.steps)
    result = {"times": times, "loss": loss, "peak": peak(),
              "setup": time.perf_counter() - started - sum(times)}  # fmt: skip
    profile(args, "compile" if compiled else "eager", step)
    return result


def fxpar_variant(args: argparse.Namespace, ids: torch.Tensor) -> dict:
    model = llama(args)
    cluster = fxpar.Cluster.preset("h100" if args.device == "cuda" else "cpu", (1,))
    started = time.perf_counter()
    parallel = fxpar.compile(
        model, cluster, {"input_ids": ids, "labels": ids},
        optimizer=fxpar.optim.AdamW(lr=1e-4),
        mixed_precision=fxpar.MixedPrecision(torch.bfloat16),
    )  # fmt: skip
    compile_seconds = time.perf_counter() - started
    del model
    gc.collect()
    devices.reset_peak_memory(DEVICE)
    step = lambda: parallel.step(input_ids=ids, labels=ids)  # noqa: E731
    times, loss = time_steps(step, warmup_steps(args), args.steps)
    estimates = {"h100 preset": score(parallel.plan)}
    if args.calibrated is not None:
        estimates["calibrated"] = score(dataclasses.replace(parallel.plan, cluster=args.calibrated))
    result = {"times": times, "loss": loss, "peak": peak(),
              "setup": compile_seconds, "estimates": estimates}  # fmt: skip
    profile(args, "fxpar", step)
    return result


def warmup_steps(args: argparse.Namespace) -> int:
    """Every variant takes as many steps (so the losses compare): at least 17, since from its
    17th call an fxpar program runs its fast copy (fxpar.runtime.fastcall)."""
    return max(args.warmup, fastcall.COPY_AFTER_CALLS + 1)


def profile(args: argparse.Namespace, name: str, step: Callable[[], torch.Tensor]) -> None:
    """With ``--profile DIR``: one more step under torch.profiler; its ops and kernels by GPU
    time go to DIR/NAME.txt."""
    if not args.profile:
        return
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as profiler

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if GPU else [])
    devices.synchronize(DEVICE)
    with profiler(activities=activities) as traced:
        started = time.perf_counter()
        step()
        devices.synchronize(DEVICE)
        wall = time.perf_counter() - started
    events = traced.key_averages()
    table = events.table(sort_by="self_device_time_total" if GPU else "self_cpu_time_total",
                         row_limit=40)  # fmt: skip
    path = os.path.join(args.profile, f"{name}.txt")
    with open(path, "w") as file:
        file.write(table)
    print(f"  {name} profiled: step {wall * 1e3:.1f} ms -> {path}")


def model_flops(args: argparse.Namespace, parameters: int) -> float:
    tokens = args.batch * args.length
    return 6 * parameters * tokens + 12 * args.layers * args.width * args.length * tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--variants", default="eager,compile,fxpar")
    parser.add_argument("--cluster-file", help="fxpar calibrate's output, for a second estimate")
    parser.add_argument("--profile", help="a folder: profile one more step of each variant there")
    args = parser.parse_args()
    args.device = "cuda" if GPU else "cpu"
    if not GPU:
        print("no GPU here: a dry run on the CPU (the figures mean nothing)")
    args.calibrated = fxpar.Cluster.load(args.cluster_file) if args.cluster_file else None
    torch.backends.cuda.matmul.allow_tf32 = True
    ids = torch.randint(0, 32000, (args.batch, args.length), device=args.device)
    parameters = sum(p.numel() for p in llama(args).parameters())
    print(
        f"{torch.cuda.get_device_name() if GPU else 'CPU'}, torch {torch.__version__}; "
        f"Llama {args.layers} "
        f"layers x {args.width}, {parameters / 1e6:.0f}M parameters, batch {args.batch} x "
        f"{args.length}, bf16 autocast / MixedPrecision, AdamW; {args.warmup} warm-up + "
        f"{args.steps} timed steps",
        flush=True,
    )
    results = {}
    for name in args.variants.split(","):
        if name == "fxpar":
            results[name] = fxpar_variant(args, ids)
        else:
            results[name] = torch_variant(args, ids, compiled=name == "compile")
        gc.collect()
        if GPU:
            torch.cuda.empty_cache()
        print(f"  {name}: done", flush=True)
    flops = model_flops(args, parameters)
    tokens = args.batch * args.length
    print(
        "\n| variant | median step | tokens/s | MFU | peak memory | setup | loss | vs eager |"
        "\n|---|---|---|---|---|---|---|---|"
    )
    eager = statistics.median(results["eager"]["times"]) if "eager" in results else None
    for name, result in results.items():
        median = statistics.median(result["times"])
        ratio = f"{median / eager:.3f}" if eager else "-"
        print(
            f"| {name} | {median * 1e3:.1f} ms | {tokens / median:,.0f} | "
            f"{flops / median / PEAK_BF16:.1%} | {result['peak'] / 2**30:.1f} GiB | "
            f"{result['setup']:.1f} s | {result['loss']:.4f} | {ratio} |"
        )
    if "fxpar" in results:
        median = statistics.median(results["fxpar"]["times"])
        for label, seconds in results["fxpar"]["estimates"].items():
            print(
                f"fxpar's estimate ({label}): {seconds * 1e3:.1f} ms; "
                f"measured {median * 1e3:.1f} ms"
            )


if __name__ == "__main__":
    main()
