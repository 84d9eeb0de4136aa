"""Training throughput: Tandem's engine (packed sequences) vs transformers (padded batch).

    .venv/bin/python bench/train_throughput.py [--presets small medium] [--warmup 1] [--iters 3]

Same weights (one HF directory loaded by both), same 16 sequences (log-normal lengths clipped to
32..512), same loss (mean next-token NLL over all predicted tokens), fp32, one thread each,
measured in one run. Reports tokens/s of forward+backward (real tokens, not padding; median over
the timed iterations) and, for Tandem, of a whole `train_batch` (plus grad clipping and AdamW).
Appends the table to docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from _report import append_benchmark  # bench/ is on sys.path when run as a script
from current import record, this_command

N_SEQS, MIN_LEN, MAX_LEN = 16, 32, 512
MB_TOKENS = 1024


def lengths(seed: int = 0) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    raw = torch.empty(N_SEQS).log_normal_(mean=5.0, std=0.8, generator=gen)
    return [int(x) for x in raw.clamp(MIN_LEN, MAX_LEN)]


def median_time(fn, warmup: int, iters: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def nll_sum(logprobs, entropy, mb):
    del entropy
    return -(logprobs * mb.tokens["loss_mask"]).sum()


def bench_preset(preset: str, warmup: int, iters: int) -> dict[str, float]:
    import transformers

    from tandem.models.tiny import init_model
    from tandem.train import MicroBatchConfig, SequenceBatch, TrainEngine, TrainEngineConfig
    from tandem.train.config import OptimizerConfig

    with tempfile.TemporaryDirectory() as tmp:
        path = init_model(Path(tmp) / preset, preset=preset, seed=0)
        vocab = transformers.AutoConfig.from_pretrained(path).vocab_size
        gen = torch.Generator().manual_seed(1)
        seqs = [torch.randint(0, vocab, (n,), generator=gen) for n in lengths()]
        n_tokens = sum(len(s) for s in seqs)
        batch = SequenceBatch([{"input_ids": s, "loss_mask": torch.ones_like(s)} for s in seqs])

        one_mb = MicroBatchConfig(max_tokens_per_mb=None)  # the whole batch in one micro-batch, like HF
        engine = TrainEngine(TrainEngineConfig(path=str(path), optimizer=OptimizerConfig(lr=1e-5), mb=one_mb))

        def tandem_fwd_bwd(engine: TrainEngine) -> None:
            engine.optimizer.zero_grad(set_to_none=True)
            engine.forward_backward(batch, nll_sum)

        t_tandem = median_time(lambda: tandem_fwd_bwd(engine), warmup, iters)
        t_step = median_time(lambda: engine.train_batch(batch, nll_sum), warmup, iters)
        engine.close()
        # The CPU attention is SDPA with a dense [T, T] document mask: its cost grows with the
        # square of the micro-batch's tokens, so smaller micro-batches can be faster here.
        engine = TrainEngine(
            TrainEngineConfig(path=str(path), mb=MicroBatchConfig(max_tokens_per_mb=MB_TOKENS))
        )
        t_mb = median_time(lambda: tandem_fwd_bwd(engine), warmup, iters)
        engine.close()

        hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        hf.train()
        longest = max(len(s) for s in seqs)
        input_ids = torch.zeros(len(seqs), longest, dtype=torch.long)
        mask = torch.zeros(len(seqs), longest, dtype=torch.long)
        for i, s in enumerate(seqs):
            input_ids[i, : len(s)], mask[i, : len(s)] = s, 1
        labels = input_ids.masked_fill(mask == 0, -100)

        def hf_fwd_bwd() -> None:
            hf.zero_grad(set_to_none=True)
            hf(input_ids=input_ids, attention_mask=mask, labels=labels).loss.backward()

        t_hf = median_time(hf_fwd_bwd, warmup, iters)
    return {
        "tokens": n_tokens,
        "padded": input_ids.numel(),
        "tandem": n_tokens / t_tandem,
        "tandem_step": n_tokens / t_step,
        "tandem_mb": n_tokens / t_mb,
        "hf": n_tokens / t_hf,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", nargs="+", default=["small", "medium"])
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--no-append", action="store_true", help="print only; leave docs/benchmarks.md alone")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = [
        "| preset | tokens (padded) | Tandem fwd+bwd tok/s | transformers fwd+bwd tok/s | ratio | "
        f"Tandem fwd+bwd, <= {MB_TOKENS} tokens/mb | ratio | Tandem train_batch tok/s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    results = {}
    for preset in args.presets:
        r = results[preset] = bench_preset(preset, args.warmup, args.iters)
        rows.append(
            f"| {preset} | {r['tokens']} ({r['padded']}) | {r['tandem']:.0f} | {r['hf']:.0f} | "
            f"{r['tandem'] / r['hf']:.2f}x | {r['tandem_mb']:.0f} | {r['tandem_mb'] / r['hf']:.2f}x | "
            f"{r['tandem_step']:.0f} |"
        )
        print(rows[-1], flush=True)
    body = (
        f"Forward+backward tokens/s (real tokens; median of {args.iters} after {args.warmup} warmup), fp32, "
        f"`torch.set_num_threads(1)`, {N_SEQS} sequences with log-normal lengths clipped to {MIN_LEN}..{MAX_LEN}. "
        "Tandem: `TrainEngine` at world size 1 (FSDP2 on one rank, one packed micro-batch, chunked log-probs); "
        "transformers: the same weights on a right-padded batch with an attention mask (SDPA). "
        "A second Tandem column splits the batch into micro-batches of at most "
        f"{MB_TOKENS} tokens (FFD). `train_batch` (one micro-batch) adds grad clipping and the AdamW step.\n\n" + "\n".join(rows)
    )
    print("\n" + body)
    if not args.no_append:
        append_benchmark("train_throughput", body)
        record("train_throughput",
               "Tandem fwd+bwd " + ", ".join(f"{r['tandem']:.0f} tok/s {p}" for p, r in results.items()),
               "transformers " + " / ".join(f"{r['hf']:.0f}" for r in results.values()) + " tok/s",
               " / ".join(f"{r['tandem'] / r['hf']:.2f}x" for r in results.values()), this_command())


if __name__ == "__main__":
    main()
