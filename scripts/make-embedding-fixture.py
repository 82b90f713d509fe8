#!/usr/bin/env python3
"""Write worker/tests/fixtures/minilm_reference.json: sentence-transformers' own embeddings of a
few texts with all-MiniLM-L6-v2, which the engine's exactness test compares against.

    python3 scripts/make-embedding-fixture.py [--model DIR] [--out FILE] [--venv DIR]

sentence-transformers and torch come from PyPI into a throwaway virtual environment (default
/tmp/tessera-st-venv; torch with its CUDA wheels is several GB, none of it kept in the repo).
The model is read from the local folder (default .assets/all-MiniLM-L6-v2) with the Hub
switched off, so nothing is downloaded at run time.
"""

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# Real text of varied length: an empty string (just [CLS] [SEP]), single words, ordinary
# sentences, non-ASCII, and one passage well past MiniLM's 256-token limit.
LONG_PASSAGE = " ".join(
    [
        "Serving transformer encoders efficiently is mostly a question of not doing work that",
        "does not matter. When a batch mixes a three-word query with a two-paragraph document,",
        "a padded implementation stretches every sequence to the longest one and then spends",
        "most of its arithmetic on positions that the attention mask throws away. Packing the",
        "tokens of all sequences end to end avoids that waste: the linear layers see one tall",
        "matrix whose rows are all real tokens, and only attention needs to know where one",
        "sequence stops and the next begins. The offsets that mark those boundaries are",
        "computed on the host while the batch is formed, so the device never has to report",
        "lengths back in the middle of a forward pass. Layer normalisation, the bias additions",
        "and the activation function are fused into the epilogues of the matrix products, which",
        "keeps the number of passes over memory small. Pooling is done in one segmented",
        "reduction rather than a loop of small operations, and normalisation follows directly.",
        "On a processor the same ideas apply: the matrix products run on all cores, attention",
        "is computed per sequence and per head with small register tiles, and the softmax uses",
        "a vectorised exponential. The result should agree with the reference implementation",
        "to within rounding, whatever the mix of lengths, and it should do so while computing",
        "far fewer floating-point operations than the padded baseline on realistic traffic,",
        "where most requests are short and a few are long. Measuring this honestly requires",
        "real text, a fixed set of inputs, and the same machine for both implementations, and",
        "it requires reporting throughput in real tokens per second rather than padded ones.",
    ]
)

TEXTS = [
    "",
    "Hello",
    "What is the capital of France?",
    "Paris is the capital and most populous city of France.",
    "The quick brown fox jumps over the lazy dog.",
    "A man is playing a guitar on stage while the crowd sings along.",
    "Dynamic batching groups concurrent requests so the accelerator stays busy.",
    "Le café était délicieux, mais un peu trop sucré à mon goût.",
    "東京は日本の首都です。",
    "Version 2.3.1 fixed the bug reported in issue #4521 (timeouts after 30 s).",
    "How do I reset my password if I no longer have access to the email address on my account? "
    "I tried the recovery form twice and never received a message.",
    LONG_PASSAGE,
]


def ensure_sentence_transformers(venv: Path) -> None:
    """Re-run this script inside a venv that has sentence-transformers, creating it if needed."""
    try:
        import sentence_transformers  # noqa: F401

        return
    except ImportError:
        pass
    python = venv / "bin" / "python"
    if Path(sys.prefix).resolve() == venv.resolve():
        sys.exit(f"sentence-transformers is not importable even inside {venv}")
    if not python.exists():
        subprocess.check_call([sys.executable, "-m", "venv", str(venv)])
    subprocess.check_call(
        [str(python), "-m", "pip", "install", "--quiet", "sentence-transformers"]
    )
    os.execv(str(python), [str(python), *sys.argv])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=REPO / ".assets" / "all-MiniLM-L6-v2")
    parser.add_argument(
        "--out",
        type=Path,
        default=REPO / "worker" / "tests" / "fixtures" / "minilm_reference.json",
    )
    parser.add_argument("--venv", type=Path, default=Path("/tmp/tessera-st-venv"))
    args = parser.parse_args()

    ensure_sentence_transformers(args.venv)
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"

    import sentence_transformers
    import torch
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(args.model), device="cpu")
    model.eval()
    with torch.no_grad():
        embeddings = model.encode(TEXTS, batch_size=len(TEXTS), convert_to_numpy=True)
    # The ids sentence-transformers fed the model (truncated to max_seq_length), so the test
    # can check tokenisation separately from the forward pass.
    preprocess = getattr(model, "preprocess", None) or model.tokenize
    features = preprocess(TEXTS)
    ids = features["input_ids"].tolist()
    mask = features["attention_mask"].tolist()

    records = []
    for text, vector, row, keep in zip(TEXTS, embeddings, ids, mask):
        input_ids = [t for t, m in zip(row, keep) if m]
        records.append(
            {
                "text": text,
                "input_ids": input_ids,
                "embedding": [float(f"{x:.7g}") for x in vector.tolist()],
            }
        )
    fixture = {
        "model": args.model.name,
        "generator": (
            f"scripts/make-embedding-fixture.py with sentence-transformers "
            f"{sentence_transformers.__version__}, torch {torch.__version__}"
        ),
        "max_seq_length": model.max_seq_length,
        "normalized": True,
        "texts": records,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    # One text per line keeps the file small and its diffs readable.
    header = {k: v for k, v in fixture.items() if k != "texts"}
    lines = [json.dumps(r, ensure_ascii=False) for r in records]
    body = json.dumps(header, indent=1, ensure_ascii=False)[:-2]
    with open(args.out, "w") as f:
        f.write(body + ',\n "texts": [\n  ' + ",\n  ".join(lines) + "\n ]\n}\n")
    lengths = [len(r["input_ids"]) for r in records]
    print(f"wrote {args.out}: {len(records)} texts, token counts {lengths}")


if __name__ == "__main__":
    main()
