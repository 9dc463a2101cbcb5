"""Train one of the bench's hidden-256 transformers checkpoints for a few minutes on the bundled corpus: a checkpoint
with trained weights, whose logits have a trained model's margins, for judging the reduced precisions.

    python scripts/train_hf_tiny.py FAMILY OUT [--seconds 240] [--seed 0] [--length 256]

FAMILY is one of ``edgelin.bench.checkpoints.FAMILIES``. The model is built and saved by transformers' own
classes (``edgelin.bench.checkpoints.build_checkpoint``), then trained with transformers' PyTorch paths (triton and fla
hidden, as on a CPU-only device) on the training split of models/corpus.py's code documents (the first 3 MB),
tokenised by the checkpoint's own byte-level BPE: AdamW, lr 2e-3, batch 8 x ``--length`` (256) tokens, until
``--seconds`` have passed (transformers' PyTorch Mamba-1 scan trains in time quadratic in the length: 2 steps in 150 s
at 256, so Mamba is trained at 64); saved to OUT with its tokenizer files. Prints the loss every 25 steps. OUT must not exist.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.modules["triton"] = None  # type: ignore[assignment]  # transformers' PyTorch paths
sys.modules["fla"] = None  # type: ignore[assignment]
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> None:
    from edgelin.bench.checkpoints import FAMILIES as MODELS, build_checkpoint

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("family", choices=list(MODELS))
    ap.add_argument("out", type=Path)
    ap.add_argument("--seconds", type=float, default=240.0, help="training time (default 240)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--length", type=int, default=256, help="tokens per training sequence (default 256)")
    args = ap.parse_args()
    if args.out.exists():
        sys.exit(f"{args.out} exists; choose a new folder")

    import torch
    import transformers
    from tokenizers import Tokenizer

    from models import corpus

    with tempfile.TemporaryDirectory(prefix="edgelin-train-") as tmp:
        src = build_checkpoint(args.family, Path(tmp) / "ckpt", MODELS)
        torch.manual_seed(args.seed)
        model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
        text = corpus.join(corpus.select(heldout=False, kind="code"))[:3_000_000].decode("utf-8", "replace")
        ids = torch.tensor(Tokenizer.from_file(str(src / "tokenizer.json")).encode(text).ids)
        print(f"{args.family}: {len(ids):,} training tokens", flush=True)
        opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.01)
        batch, length, step, t0 = 8, args.length, 0, time.perf_counter()
        model.train()
        while time.perf_counter() - t0 < args.seconds:
            starts = torch.randint(0, len(ids) - length, (batch,))
            x = torch.stack([ids[s : s + length] for s in starts])
            loss = model(x, labels=x).loss  # transformers shifts the labels
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
            step += 1
            if step % 25 == 0:
                print(f"step {step}  loss {loss.item():.3f}  {time.perf_counter() - t0:.0f} s", flush=True)
        model.eval()
        work = args.out.with_name(args.out.name + ".partial")
        model.save_pretrained(work)
        for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
            if (src / name).exists():
                shutil.copy(src / name, work / name)
        work.rename(args.out)
    print(f"saved {args.out}: {step} steps, last loss {loss.item():.3f}", flush=True)


if __name__ == "__main__":
    main()
