"""HF transformers baseline for bench/src/bin/gpu_serving.rs (issue 4).

BertModel in fp16 (or bf16) with SDPA attention on the GPU, each batch padded to its longest
sequence, mean pooling over the attention mask and L2 normalisation (what
sentence-transformers computes). Each timed call goes from host token ids to host
embeddings, as the engine's `embed_batch` does: the padded id and mask tensors are built on
the host before timing, copied to the GPU, run, pooled, and copied back.

Input:  --model DIR (config.json + model.safetensors), --workload FILE written by
        gpu_serving ({"configs": [{"name": str, "sequences": [[ids...], ...]}, ...]}).
Output: JSON lines on stdout, each flushed as soon as it is known, so the benchmark records
        every finished config even if the run is cut short:
        first {"torch", "transformers", "device", "dtype", "attention"},
        then one {"name", "padded_tokens", "ms": [per call], "check": [[emb], [emb]]} per
        config, in the workload's order. "check" holds the embeddings of the batch's first
        two sequences, so the benchmark can confirm both sides compute the same thing.
"""

import argparse
import json
import re
import sys
import time

import torch
import torch.nn.functional as F
import transformers
from transformers import BertModel


def dtype_keyword():
    """transformers 4.56 renamed `torch_dtype=` to `dtype=` (5.x warns on the old name)."""
    found = re.match(r"(\d+)\.(\d+)", transformers.__version__)
    if found and (int(found[1]), int(found[2])) < (4, 56):
        return "torch_dtype"
    return "dtype"


def emit(record):
    print(json.dumps(record), flush=True)


def padded(sequences):
    longest = max(len(s) for s in sequences)
    ids = torch.zeros((len(sequences), longest), dtype=torch.long)
    mask = torch.zeros((len(sequences), longest), dtype=torch.long)
    for i, seq in enumerate(sequences):
        ids[i, : len(seq)] = torch.tensor(seq, dtype=torch.long)
        mask[i, : len(seq)] = 1
    return ids, mask


@torch.inference_mode()
def embed(model, ids, mask):
    ids, mask = ids.cuda(), mask.cuda()
    hidden = model(input_ids=ids, attention_mask=mask).last_hidden_state
    m = mask.unsqueeze(-1).to(hidden.dtype)
    pooled = (hidden * m).sum(1).float() / m.sum(1).float()
    return F.normalize(pooled, dim=-1).cpu()


def timed(model, ids, mask, warmup, min_seconds, min_iters):
    for _ in range(warmup):
        embed(model, ids, mask)
    ms = []
    start = time.perf_counter()
    while len(ms) < min_iters or time.perf_counter() - start < min_seconds:
        t0 = time.perf_counter()
        embed(model, ids, mask)
        ms.append((time.perf_counter() - t0) * 1000.0)
    return ms


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--workload", required=True)
    parser.add_argument("--dtype", choices=["float16", "bfloat16"], default="float16")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--min-seconds", type=float, default=0.5)
    parser.add_argument("--min-iters", type=int, default=5)
    args = parser.parse_args()

    if not torch.cuda.is_available():
        sys.exit("no CUDA device visible to PyTorch")
    with open(args.workload) as f:
        workload = json.load(f)
    model = (
        BertModel.from_pretrained(
            args.model,
            **{dtype_keyword(): getattr(torch, args.dtype)},
            attn_implementation="sdpa",
            add_pooling_layer=False,
        )
        .cuda()
        .eval()
    )

    emit(
        {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "device": torch.cuda.get_device_name(0),
            "dtype": args.dtype,
            "attention": "sdpa",
        }
    )
    for config in workload["configs"]:
        sequences = config["sequences"]
        ids, mask = padded(sequences)
        ms = timed(model, ids, mask, args.warmup, args.min_seconds, args.min_iters)
        check = embed(model, ids[:2], mask[:2]).tolist()
        emit(
            {
                "name": config["name"],
                "padded_tokens": int(ids.numel()),
                "ms": [round(v, 4) for v in ms],
                "check": check,
            }
        )
        print(f"hf {config['name']}: median {sorted(ms)[len(ms) // 2]:.3f} ms", file=sys.stderr)

if __name__ == "__main__":
    main()
