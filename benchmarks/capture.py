"""Capture speed and memory on large transformer shapes built on the meta device.

    python benchmarks/capture.py            # every model, one fresh process each
    python benchmarks/capture.py llama-8b   # just one

Each model is built from a Hugging Face config on the meta device (no weights anywhere) and
captured with fxpar.capture. Columns: parameters, graph nodes, seconds spent in capture, and the
peak resident memory of the whole process (Python, torch and transformers included).
Target: the Llama-8B shape captures in under 30 s and 2 GiB.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

BATCH, LENGTH = 8, 1024


def build(name: str):  # type: ignore[no-untyped-def]
    import transformers

    gpt2 = {
        "gpt2-small": (12, 768, 12),
        "gpt2-medium": (24, 1024, 16),
        "gpt2-large": (36, 1280, 20),
        "gpt2-xl": (48, 1600, 25),
    }
    if name in gpt2:
        layers, width, heads = gpt2[name]
        config = transformers.GPT2Config(n_layer=layers, n_embd=width, n_head=heads)
        return transformers.GPT2LMHeadModel, config
    if name == "llama-8b":
        config = transformers.LlamaConfig(
            hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
            num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
            max_position_embeddings=8192,
        )  # fmt: skip
        return transformers.LlamaForCausalLM, config
    raise SystemExit(f"unknown model {name!r}; choose from {', '.join(MODELS)}")


MODELS = ("gpt2-small", "gpt2-medium", "gpt2-large", "gpt2-xl", "llama-8b")


def measure(name: str) -> dict[str, object]:
    import torch

    import fxpar

    model_class, config = build(name)
    with torch.device("meta"):
        model = model_class(config)
    tokens = torch.zeros(BATCH, LENGTH, dtype=torch.long)
    start = time.perf_counter()
    program = fxpar.capture(model, {"input_ids": tokens, "labels": tokens})
    seconds = time.perf_counter() - start
    return {
        "model": name,
        "params": sum(p.numel() for p in model.parameters()),
        "nodes": len(program.graph.nodes),
        "seconds": seconds,
        "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*", default=list(MODELS))
    parser.add_argument("--in-process", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.in_process:
        print(json.dumps(measure(args.models[0])))
        return
    print(f"batch {BATCH} x {LENGTH} tokens, models on the meta device\n")
    header = ("model", "params", "nodes", "capture s", "peak RSS GiB")
    print(
        f"| {header[0]:<12} | {header[1]:>7} | {header[2]:>6} | {header[3]:>9} | {header[4]:>12} |"
    )
    print(f"|{'-' * 14}|{'-' * 9}|{'-' * 8}|{'-' * 11}|{'-' * 14}|")
    for name in args.models:
        # A fresh process per model, so peak RSS is that model's alone.
        out = subprocess.run(
            [sys.executable, __file__, "--in-process", name],
            check=True, capture_output=True, text=True,
        ).stdout  # fmt: skip
        row = json.loads(out.strip().splitlines()[-1])
        params = f"{row['params'] / 1e9:.2f}B"
        print(
            f"| {row['model']:<12} | {params:>7} | {row['nodes']:>6} | "
            f"{row['seconds']:>9.1f} | {row['peak_rss_gib']:>12.2f} |"
        )


if __name__ == "__main__":
    main()
