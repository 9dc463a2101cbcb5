"""The recipe of the bundled checkpoints: a byte-level LM trained on the Python standard library.

    python -m edgelin.models.train --out models/stdlib-linear [options]

Data (``edgelin.models.corpus``): the running interpreter's ``Lib/**/*.py`` source and its pydoc topics,
deduplicated; whole files (and whole topics) are held out by a fixed function of their name. Training
draws random seq_len-byte windows from the training documents joined into one byte string: from the
topics with probability ``--topics-weight`` (they are 1 % of the bytes; the weight keeps prose in the
mix), else from the code.

Training: fixed seed, a step budget (not wall-clock), AdamW with linear warmup then cosine decay to
10% of the peak rate, gradient-norm clipping at 1.0, batches of random seq_len-byte windows.

Evaluation (``heldout_bits_per_byte``): the held-out documents are joined, and the bytes are tiled by consecutive windows of seq_len
input bytes; window i reads bytes [i*seq_len, (i+1)*seq_len) and predicts bytes [i*seq_len + 1,
(i+1)*seq_len + 1), so every byte after the first is predicted exactly once (a shorter last window
takes the tail). Each window starts from an empty state / empty cache: nothing is carried across
windows, for the linear and the softmax model alike, so both are scored in the context regime they
were trained in (0 to seq_len - 1 bytes of context). The result is the mean of -log2 p(byte) over
every predicted byte.

The eval helpers (``heldout_bits_per_byte``, ``unigram_bits_per_byte``, ``generate``) import without side
effects; the tests use them.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F


# ---- data --------------------------------------------------------------------------------------
def as_tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()  # [N]


def random_batch(data: torch.Tensor, batch_size: int, seq_len: int, gen: torch.Generator):
    """batch_size random windows: inputs [B, seq_len] and next-byte targets [B, seq_len]."""
    starts = torch.randint(0, data.numel() - seq_len - 1, (batch_size,), generator=gen)  # [B]
    idx = starts[:, None] + torch.arange(seq_len + 1)[None, :]  # [B, seq_len + 1]
    windows = data[idx]  # [B, seq_len + 1]
    return windows[:, :-1], windows[:, 1:]


def mixed_batch(sources: list[tuple[torch.Tensor, float]], batch_size: int, seq_len: int, gen: torch.Generator):
    """random_batch whose rows come from ``sources`` [(bytes, probability), ...]: each row picks its source
    with those probabilities (one draw per row), then a random window in it."""
    weights = torch.tensor([w for _, w in sources], dtype=torch.float64)
    pick = torch.multinomial(weights, batch_size, replacement=True, generator=gen)  # [B]
    xs, ys = [], []
    for i, (data, _) in enumerate(sources):
        n = int((pick == i).sum())
        if n:
            x, y = random_batch(data, n, seq_len, gen)
            xs.append(x)
            ys.append(y)
    return torch.cat(xs), torch.cat(ys)


def evaluation_sets() -> dict[str, bytes]:
    """The held-out text by group: library code, test code (a path part named test or tests), topics."""
    from edgelin.models import corpus

    code = corpus.select(heldout=True, kind="code")
    tests = [d for d in code if {"test", "tests"} & set(d.name.split("/")[:-1])]
    library = [d for d in code if d not in tests]
    return {"code": corpus.join(code), "library code": corpus.join(library), "test code": corpus.join(tests),
            "topics": corpus.heldout_text("topic")}


def directory_text(folder: Path) -> bytes:
    """Every ``*.py`` file under ``folder`` in path order, joined like the corpus (for out-of-corpus scores)."""
    from edgelin.models import corpus

    docs = [corpus.Document(p.relative_to(folder).as_posix(), "code", p.read_bytes()) for p in sorted(folder.rglob("*.py"))]
    if not docs:
        raise FileNotFoundError(f"no *.py file under {folder}")
    return corpus.join(docs)


# ---- evaluation --------------------------------------------------------------------------------
@torch.no_grad()
def heldout_bits_per_byte(model, data: bytes, seq_len: int, max_bytes: int | None = None, batch_size: int = 16) -> float:
    """Mean -log2 p(byte) over data[:max_bytes], in consecutive windows, each from an empty state/cache.

    Window i reads seq_len bytes from i * seq_len and predicts the seq_len bytes one further on; a
    shorter tail window is scored too. Every byte but the very first is predicted exactly once. Works
    for LinearLM and SoftmaxLM (any ``model(ids) -> (logits, ...)``).
    """
    data = data if max_bytes is None else data[:max_bytes]
    if len(data) < 2:
        raise ValueError("need at least 2 bytes to score")
    ids = as_tensor(data)
    was_training = model.training
    model.eval()
    total_nats, count = 0.0, 0
    n_full = (ids.numel() - 1) // seq_len
    starts = [i * seq_len for i in range(n_full)]
    for b in range(0, n_full, batch_size):
        idx = torch.tensor(starts[b : b + batch_size])[:, None] + torch.arange(seq_len + 1)[None, :]  # [b, seq_len + 1]
        windows = ids[idx]
        logits = model(windows[:, :-1])[0]  # [b, seq_len, vocab]
        total_nats += F.cross_entropy(logits.flatten(0, 1).double(), windows[:, 1:].flatten(), reduction="sum").item()
        count += windows[:, 1:].numel()
    tail = ids[n_full * seq_len :]  # the last window: fewer than seq_len + 1 bytes
    if tail.numel() >= 2:
        logits = model(tail[None, :-1])[0]  # [1, t, vocab]
        total_nats += F.cross_entropy(logits[0].double(), tail[1:], reduction="sum").item()
        count += tail.numel() - 1
    model.train(was_training)
    return total_nats / count / math.log(2)


def score_texts(model, texts: dict[str, bytes], seq_len: int, train: bytes) -> dict[str, dict[str, float]]:
    """Bits per byte of ``model`` and of the unigram baseline on each named text, printed as they come."""
    scores = {}
    for name, text in texts.items():
        scores[name] = {"bytes": len(text), "bpb": heldout_bits_per_byte(model, text, seq_len),
                        "unigram_bpb": unigram_bits_per_byte(train, text)}
        print(f"held-out {name}: {scores[name]['bpb']:.4f} bits/byte over {len(text):,} bytes "
              f"(unigram {scores[name]['unigram_bpb']:.4f})", flush=True)
    return scores


def unigram_bits_per_byte(train: bytes, heldout: bytes) -> float:
    """Entropy of the held-out bytes under the train byte frequencies with add-one smoothing (a baseline)."""
    counts = torch.bincount(as_tensor(train), minlength=256).double() + 1.0  # [256]
    log2p = torch.log2(counts / counts.sum())  # [256]
    return -log2p[as_tensor(heldout)].mean().item()


@torch.no_grad()
def generate(model, prompt: str, n_bytes: int = 200, temperature: float = 0.8, seed: int = 0) -> str:
    """Continue ``prompt`` byte by byte (temperature 0 = greedy), carrying the state/cache."""
    gen = torch.Generator().manual_seed(seed)
    model.eval()
    ids = torch.tensor([list(prompt.encode("utf-8"))])  # [1, T]
    logits, carry = model(ids)
    out = []
    for _ in range(n_bytes):
        last = logits[0, -1].double()  # [vocab]
        if temperature == 0:
            nxt = int(last.argmax())
        else:
            nxt = int(torch.multinomial(torch.softmax(last / temperature, -1), 1, generator=gen))
        out.append(nxt)
        logits, carry = model(torch.tensor([[nxt]]), carry)
    return bytes(out).decode("utf-8", errors="replace")


# ---- training ----------------------------------------------------------------------------------
def lr_at(step: int, steps: int, peak: float, warmup: int) -> float:
    """Linear warmup to ``peak`` over ``warmup`` steps, then cosine decay to peak / 10 at ``steps``."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))


def build_model(args):
    from edgelin.config import ModelConfig

    cfg = ModelConfig(
        vocab_size=256, d_model=args.d_model, n_layers=args.n_layers, n_heads=args.n_heads,
        head_dim=args.head_dim, feature_map=args.feature_map, normalisation=args.normalisation,
        chunk_size=args.chunk_size, conv_size=0 if args.softmax else args.conv_size, cosformer_horizon=args.cosformer_horizon,
        decay="none" if args.softmax else args.decay, gate_rank=args.gate_rank,
        update="additive" if args.softmax else args.update,
        attn_layers=() if args.softmax else tuple(args.attn_layers),
    )
    if args.softmax:
        from edgelin.softmax import SoftmaxLM

        return SoftmaxLM(cfg)
    from edgelin.model import LinearLM

    return LinearLM(cfg)


def train(args) -> dict:
    from edgelin.models import corpus

    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    code_train = corpus.join(corpus.select(heldout=False, kind="code"))
    topics_train = corpus.join(corpus.select(heldout=False, kind="topic"))
    train_bytes = code_train + topics_train
    heldout = evaluation_sets()
    extra = {str(folder): directory_text(folder) for folder in args.eval_dir}  # read now: a bad folder fails before training
    sources = [(as_tensor(code_train), 1.0 - args.topics_weight), (as_tensor(topics_train), args.topics_weight)]
    model = build_model(args)
    kind = "softmax (RoPE)" if args.softmax else (
        f"linear, feature map {args.feature_map}, normalisation {args.normalisation}, conv_size {args.conv_size}, "
        f"decay {args.decay}" + (f", update {args.update}" if args.update != "additive" else "")
        + (f", softmax attention (RoPE) at layers {list(args.attn_layers)}" if args.attn_layers else ""))
    n_params = model.num_parameters()
    print(f"model: {kind}; {n_params:,} parameters", flush=True)
    print(f"data: {len(code_train):,} code + {len(topics_train):,} topic bytes for training (topics weight "
          f"{args.topics_weight}); held-out {len(heldout['code']):,} code + {len(heldout['topics']):,} topic bytes; "
          f"file list sha256 {corpus.file_list_sha256()}", flush=True)

    decay = [p for p in model.parameters() if p.dim() == 2]  # matrices and the embedding
    no_decay = [p for p in model.parameters() if p.dim() != 2]  # norms and the short-conv taps (init: identity)
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.95),
    )
    warmup = args.warmup if args.warmup is not None else max(1, min(200, args.steps // 10))
    gen = torch.Generator().manual_seed(args.seed)
    model.train()
    t_start = time.perf_counter()
    t_log, tokens_since = t_start, 0
    eval_seconds = 0.0
    for step in range(args.steps):
        lr = lr_at(step, args.steps, args.lr, warmup)
        for group in opt.param_groups:
            group["lr"] = lr
        x, y = mixed_batch(sources, args.batch_size, args.seq_len, gen)
        logits = model(x)[0]  # [B, T, vocab]
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        opt.step()
        tokens_since += x.numel()
        last = step + 1 == args.steps
        if (step + 1) % args.log_every == 0 or last:
            now = time.perf_counter()
            print(f"step {step + 1:6d}/{args.steps}  loss {loss.item():.4f} ({loss.item() / math.log(2):.3f} bits/byte)"
                  f"  lr {lr:.2e}  {tokens_since / (now - t_log):,.0f} tok/s  {now - t_start - eval_seconds:,.0f} s", flush=True)
            t_log, tokens_since = now, 0
        if args.eval_every and (step + 1) % args.eval_every == 0 and not last:
            t0 = time.perf_counter()
            bpb = heldout_bits_per_byte(model, heldout["code"], args.seq_len, args.eval_bytes)
            eval_seconds += time.perf_counter() - t0
            print(f"step {step + 1:6d}  held-out code {bpb:.4f} bits/byte (first {args.eval_bytes:,} bytes)", flush=True)
            t_log = time.perf_counter()
    train_seconds = time.perf_counter() - t_start - eval_seconds
    result = {
        "parameters": n_params, "steps": args.steps, "tokens": args.steps * args.batch_size * args.seq_len,
        "train_seconds": train_seconds, "file_list_sha256": corpus.file_list_sha256(), "heldout": {},
    }
    print(f"done: {args.steps} steps, {result['tokens']:,} tokens, {train_seconds:.0f} s training "
          f"(+{eval_seconds:.0f} s periodic eval)", flush=True)
    if args.out:  # before the (slow) final scores
        from edgelin.checkpoint import save_checkpoint, weights_sha256

        path = save_checkpoint(model, args.out)
        print(f"saved {path} (model.safetensors sha256 {weights_sha256(path)})", flush=True)
    sets = dict(heldout) if args.final_eval else {}
    sets.update(extra)
    if args.final_eval_bytes is not None:
        sets = {name: text[: args.final_eval_bytes] for name, text in sets.items()}
    result["heldout"] = score_texts(model, sets, args.seq_len, train_bytes)
    for prompt in args.sample:
        print(f"sample (temperature 0.8): {prompt}{generate(model, prompt, 300)}", flush=True)
    return result


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m edgelin.models.train", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--feature-map", default="elu+1", help="identity, elu+1, relu, softplus, performer, cosformer")
    p.add_argument("--normalisation", default="denominator", help="denominator or none (identity needs none)")
    p.add_argument("--softmax", action="store_true", help="train SoftmaxLM (RoPE) instead of LinearLM")
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--n-layers", type=int, default=4)
    p.add_argument("--n-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--chunk-size", type=int, default=64)
    p.add_argument("--conv-size", type=int, default=4, help="short causal conv before each linear attention (0 = off)")
    p.add_argument("--decay", default="none", help="decay of the state: none, fixed (RetNet), scalar (Mamba2), gla (GLA)")
    p.add_argument("--gate-rank", type=int, default=16, help="decay gla: rank of the low-rank gate projection")
    p.add_argument("--update", default="additive",
                   help="how the state is written: additive, or delta (the delta rule; with --decay scalar: Gated DeltaNet; needs --normalisation none)")
    p.add_argument("--attn-layers", type=lambda v: [int(x) for x in v.split(",") if x.strip()], default=[], metavar="I,J",
                   help="a hybrid: softmax attention (RoPE, a KV cache) at these layers (0-based, e.g. 1), linear attention elsewhere")
    p.add_argument("--cosformer-horizon", type=int, default=16384, help="cosformer: M in cos(pi/2 (i - j) / M)")
    p.add_argument("--topics-weight", type=float, default=0.1, help="share of training windows drawn from the pydoc topics")
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    p.add_argument("--warmup", type=int, default=None, help="warmup steps (default: steps/10, at most 200)")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--eval-every", type=int, default=500, help="periodic held-out eval (0 = only at the end)")
    p.add_argument("--eval-bytes", type=int, default=16384, help="held-out bytes scored by the periodic eval")
    p.add_argument("--final-eval-bytes", type=int, default=None, help="bytes of each held-out group scored at the end (default: all)")
    p.add_argument("--no-final-eval", dest="final_eval", action="store_false", help="skip the held-out scores at the end")
    p.add_argument("--eval-dir", type=Path, action="append", default=[],
                   help="also score every *.py file under this folder at the end (text the corpus does not hold); repeatable")
    p.add_argument("--out", type=Path, default=None, help="write config.json + model.safetensors here")
    p.add_argument("--sample", action="append", default=None,
                   help="prompt of a sample printed at the end; repeatable (default: a code and a prose prompt)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.sample is None:
        args.sample = ["def fibonacci(n):", "The for statement"]
    args.sample = [p for p in args.sample if p]
    from edgelin.errors import ConfigError

    try:
        train(args)
    except (ConfigError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
