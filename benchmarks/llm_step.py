"""How long one step of the LLM demo's model takes: decode steps by batch size, and a
prefill chunk, on one BLAS thread (as the demo service runs it).

    python3 benchmarks/llm_step.py [--model-size small] [--context 200] [--steps 30]

Each request of the batch has ``--context`` tokens in the KV cache; a decode step runs one
new token per request (their projections and MLP stacked, attention over each request's
cached keys). Figures are the median over ``--rounds`` rounds of the mean step time.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from inferprof.demo.llm.kv_cache import BlockAllocator, blocks_for  # noqa: E402
from inferprof.demo.llm.model import StepItem, TinyLM  # noqa: E402
from inferprof.demo.llm.settings import LLMSettings  # noqa: E402

BLOCK = 16


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-size", default="small")
    parser.add_argument("--context", type=int, default=200)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batches", default="1,8,16")
    args = parser.parse_args(argv)
    config = LLMSettings(model_size=args.model_size).model_config()
    model = TinyLM(config)
    batches = [int(b) for b in args.batches.split(",")]
    alloc = BlockAllocator(max(batches) * blocks_for(args.context + args.steps + 256, BLOCK))
    cache = model.new_cache(alloc.num_blocks, BLOCK)
    tables = []
    for i in range(max(batches)):
        blocks = alloc.allocate(blocks_for(args.context + args.steps + 256, BLOCK))
        assert blocks is not None
        model.step([StepItem(blocks, 0, [1 + (i + p) % 500 for p in range(args.context)])], cache)
        tables.append(blocks)
    rows = []
    for batch in batches:
        means = []
        for _ in range(args.rounds):
            t0 = time.perf_counter()
            for s in range(args.steps):
                model.step([StepItem(t, args.context + s, [7]) for t in tables[:batch]], cache)
            means.append((time.perf_counter() - t0) / args.steps)
        rows.append((f"decode, batch {batch}", statistics.median(means)))
    means = []
    for _ in range(args.rounds):
        t0 = time.perf_counter()
        model.step([StepItem(tables[0], 0, [3] * 256)], cache)
        means.append(time.perf_counter() - t0)
    rows.append(("prefill chunk of 256 tokens", statistics.median(means)))
    print(f"model {args.model_size}: d_model {config.d_model}, {config.n_layers} layers, "
          f"{config.n_heads} heads, d_ff {config.d_ff}, vocabulary {config.vocab_size}; "
          f"context {args.context} tokens per request; one BLAS thread\n")
    print("| step | ms |\n|---|---:|")
    for name, seconds in rows:
        print(f"| {name} | {seconds * 1e3:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
