#!/usr/bin/env python3
"""sentence-transformers on PyTorch CPU over the serving benchmark's texts; the Rust
benchmark (bench/src/bin/serving.rs) runs this as a subprocess and reads the last line.

    python sentence_transformers_baseline.py --model DIR --texts FILE.json [--batch 32] [--rounds 2]

FILE.json is a list of strings in arrival order. Two ways of encoding them are timed:

- arrival: `encode` on each consecutive group of `--batch` texts, so every batch holds the
  same texts as the engine's and the padded baseline's batches (what a server sees);
- sorted: one `encode(all_texts, batch_size=--batch)`, sentence-transformers' offline mode,
  which sorts all texts by length first and so pads far less than a server can.

Real tokens are the attention-mask ones after truncation to the model's max_seq_length
(specials included), the same count the engine reports. Prints one JSON object on its last
line. Needs sentence-transformers and torch (CPU wheels are enough); nothing is downloaded.
"""

import argparse
import json
import os
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def percentile(values, p):
    ordered = sorted(values)
    rank = max(1, -(-len(ordered) * p // 100))  # nearest rank
    return ordered[int(rank) - 1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--texts", required=True)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()

    import sentence_transformers
    import torch
    from sentence_transformers import SentenceTransformer

    with open(args.texts) as f:
        texts = json.load(f)
    model = SentenceTransformer(args.model, device="cpu")
    model.eval()
    batches = [texts[i : i + args.batch] for i in range(0, len(texts), args.batch)]
    tokens = sum(int(model.tokenize(b)["attention_mask"].sum()) for b in batches)

    def encode(items, batch_size):
        return model.encode(items, batch_size=batch_size, convert_to_numpy=True, normalize_embeddings=False)

    with torch.inference_mode():
        encode(batches[0], args.batch)  # warm-up
        arrival_seconds, sorted_seconds, latencies_ms = [], [], []
        for _ in range(args.rounds):
            started = time.perf_counter()
            for batch in batches:
                t = time.perf_counter()
                encode(batch, args.batch)
                latencies_ms.append((time.perf_counter() - t) * 1e3)
            arrival_seconds.append(time.perf_counter() - started)
            started = time.perf_counter()
            encode(texts, args.batch)
            sorted_seconds.append(time.perf_counter() - started)

    result = {
        "sentence_transformers": sentence_transformers.__version__,
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "texts": len(texts),
        "tokens": tokens,
        "batch": args.batch,
        "rounds": args.rounds,
        "arrival": {
            "seconds": arrival_seconds,
            "tokens_per_s": tokens * args.rounds / sum(arrival_seconds),
            "batch_latency_ms": {"p50": percentile(latencies_ms, 50), "p99": percentile(latencies_ms, 99)},
        },
        "sorted": {
            "seconds": sorted_seconds,
            "tokens_per_s": tokens * args.rounds / sum(sorted_seconds),
        },
    }
    sys.stdout.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
