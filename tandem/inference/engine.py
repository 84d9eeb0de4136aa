"""`LLMEngine`: requests in, one scheduled model step at a time, finished outputs out.

Single-threaded by design: a server calls `add_request` / `abort` / `load_weights` and `step()`
from one thread (or under one lock). Aborted requests are answered by the next `step()`.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from tandem.inference import cpu_kernels
from tandem.inference.block_manager import BlockManager
from tandem.inference.errors import EngineBusyError, RequestError
from tandem.inference.fused_norm import fuse_norms, fusing_available
from tandem.inference.model_runner import ModelRunner
from tandem.inference.outputs import ABORT_BEFORE_PREFILL, Detokenizer, RequestOutput, TokenDelta, make_output
from tandem.inference.packed_linear import pack_linears, packing_available
from tandem.inference.request import GenerationRequest
from tandem.inference.sampler import logprob_temperature, sample, top_logprobs
from tandem.inference.sampling_params import SamplingParams
from tandem.inference.scheduler import Scheduler
from tandem.inference.sequence import Sequence
from tandem.inference.weight_swap import Key, get_weight, stage_weights, swap_weights
from tandem.models import load_model, read_hf_config


class LLMEngine:
    def __init__(self, model_path: str | os.PathLike[str], *, max_num_seqs: int = 256,
                 max_num_batched_tokens: int = 8192, kv_cache_tokens: int = 32768, block_size: int = 16,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32, seed: int = 0,
                 batch_invariant: bool = False):
        self.model_path = str(model_path)
        self.device, self.dtype = _with_index(torch.device(device)), dtype
        self.model = load_model(model_path, dtype=dtype, device=device).eval()
        if packing_available(self.device, dtype):
            pack_linears(self.model)  # prepacked oneDNN weights, repacked after every weight change
        if fusing_available(self.device, dtype):
            fuse_norms(self.model)  # one C++ pass per row
        if self.device.type == "cpu":
            cpu_kernels.sampler()  # built (or loaded) now, not inside the first request's step
        self.max_model_len = int(self.model.args.max_seq_len)
        self.vocab_size = int(self.model.args.vocab_size)
        self.eos_ids = _eos_ids(model_path)
        self.detokenizer = Detokenizer(load_tokenizer(model_path))
        num_blocks = kv_cache_tokens // block_size
        if num_blocks < 1:
            raise RequestError(f"kv_cache_tokens={kv_cache_tokens} holds no block of {block_size} tokens")
        self.block_manager = BlockManager(num_blocks, block_size)
        self.scheduler = Scheduler(self.block_manager, max_num_seqs, max_num_batched_tokens)
        self.runner = ModelRunner(self.model, num_blocks, block_size, self.device, dtype, batch_invariant)
        self.weight_version = 0  # set by each weight swap that names one; stamped on every output
        self._seeds = torch.Generator().manual_seed(seed)
        self._live: dict[str, list[Sequence]] = {}  # rid -> its sequences (one until forked)
        self._streaming: set[str] = set()
        self._deltas: list[TokenDelta] = []
        self._done: list[RequestOutput] = []  # aborted between steps, answered by the next step
        self.num_generated_tokens = 0

    @property
    def max_total_num_tokens(self) -> int:
        return self.block_manager.num_blocks * self.block_manager.block_size

    # --------------------------------------------------------------------------- requests
    def add_request(self, request: GenerationRequest) -> None:
        """Queue `request` (its fields: `GenerationRequest`). With `logprob_start_len` >= 0 its
        prompt's logprobs are computed now, with the weights that admit it. RequestError when it
        cannot run (a rid in flight, a prompt too long, routed experts from a dense model...)."""
        rid, input_ids, params = request.rid, request.input_ids, request.params
        if rid in self._live:
            raise RequestError(f"request id {rid!r} is already in flight")
        self.check_request(input_ids, params)
        if request.return_routed_experts and not self.has_routed_experts:
            raise RequestError(f"return_routed_experts needs a mixture-of-experts model; {self.model_path} "
                               f"({type(self.model.args).__name__}) routes no experts: drop the flag")
        seeds = [params.seed + i if params.seed is not None else self._draw_seed() for i in range(params.n)]
        seq = Sequence(rid, list(input_ids), params, self._generator(seeds[0]), request.return_logprob,
                       return_routed_experts=request.return_routed_experts, sibling_seeds=seeds[1:],
                       arrival_time=time.monotonic(),
                       top_logprobs_num=request.top_logprobs_num if request.return_logprob else 0)
        if request.return_logprob and request.logprob_start_len >= 0:
            seq.input_logprobs, seq.input_top_logprobs = self.prompt_logprobs(
                input_ids, request.logprob_start_len, logprob_temperature(params), seq.top_logprobs_num)
        self._live[rid] = [seq]
        if request.stream:
            self._streaming.add(rid)
        self.scheduler.add(seq)

    def check_request(self, input_ids: list[int], params: SamplingParams) -> None:
        if not input_ids:
            raise RequestError("input_ids is empty; send at least one token")
        if not all(isinstance(t, int) and 0 <= t < self.vocab_size for t in input_ids):
            raise RequestError(f"input_ids must be token ids in [0, {self.vocab_size})")
        total = len(input_ids) + params.max_new_tokens
        limit = min(self.max_model_len, self.max_total_num_tokens)
        if total > limit:
            raise RequestError(
                f"prompt ({len(input_ids)} tokens) + max_new_tokens ({params.max_new_tokens}) = {total} exceeds "
                f"the context limit {limit} (max_position_embeddings {self.max_model_len}, "
                f"KV cache {self.max_total_num_tokens} tokens)"
            )
        if params.n > self.scheduler.max_num_seqs:
            raise RequestError(f"sampling_params.n={params.n} exceeds max_num_seqs={self.scheduler.max_num_seqs}")
        if params.stop and self.detokenizer.tokenizer is None:
            raise RequestError("sampling_params.stop needs a tokenizer; the model directory has none")

    def abort(self, rid_prefix: str | None = None, abort_all: bool = False, exact: bool = False) -> list[str]:
        """Abort requests whose rid starts with `rid_prefix` (equals it with `exact`), or all;
        -> the aborted rids. Their outputs (partial tokens and logprobs if they ran) come from the
        next `step()`."""
        if exact and not abort_all:
            rids = [rid_prefix] if rid_prefix in self._live else []
        else:
            rids = [r for r in self._live if abort_all or (rid_prefix is not None and r.startswith(rid_prefix))]
        for rid in rids:
            self._end(rid, {"type": "abort", "message": "aborted by request"})
        return rids

    @property
    def has_routed_experts(self) -> bool:
        """Whether requests may ask for routed experts (a mixture-of-experts model)."""
        return self.runner.routed_expert_cache is not None

    def unknown_routed_experts(self, num_tokens: int) -> torch.Tensor:
        """`RequestOutput.routed_experts` of `num_tokens` tokens this engine never computed (all -1)."""
        return self.runner.routed_expert_cache.read([], num_tokens)

    def has_unfinished(self) -> bool:
        return bool(self._live or self._done)

    # --------------------------------------------------------------------------- stepping
    def step(self) -> list[RequestOutput]:
        """Run one model step; -> outputs of requests that finished (or were aborted) since the last."""
        seqs, is_prefill = self.scheduler.schedule()
        if seqs:
            copies, self.block_manager.pending_copies = self.block_manager.pending_copies, []
            shared = (None if is_prefill or self.runner.batch_invariant
                      else [self.block_manager.num_shared_blocks(s) for s in seqs])
            logits = self.runner.run(seqs, is_prefill, copies, shared)
            rows, batch = [], []
            for row, seq in enumerate(seqs):
                if not seq.was_started:
                    seq.cached_tokens, seq.was_started = seq.num_computed_tokens, True
                for s in self._fork(seq):
                    rows.append(row)
                    batch.append(s)
            # Rows are the identity unless a request forked into its n samples this step: then
            # copy once (a [B, vocab] float32 copy per use cost ~1 ms a step at 256 x 8192).
            batch_logits = logits if len(rows) == len(seqs) else logits[rows]
            tokens, logprobs = sample(batch_logits, batch, self.eos_ids)
            tops = top_logprobs(batch_logits, [logprob_temperature(s.params) for s in batch],
                                [s.top_logprobs_num for s in batch])
            failed: set[str] = set()
            for seq, token, logprob, top in zip(batch, tokens, logprobs, tops, strict=True):
                if seq.rid in failed:
                    continue
                if not math.isfinite(logprob):  # NaN or +inf among its logits: no distribution to sample
                    failed.add(seq.rid)
                    self._fail(seq.rid, f"the model's logits were not finite (NaN or inf) at output token "
                                        f"{seq.num_output_tokens + 1} (weight version {self.weight_version}): "
                                        "its activations overflowed or the weights are broken; the request "
                                        "was stopped, other requests go on")
                    continue
                seq.append(token, logprob)
                if seq.top_logprobs_num:
                    seq.output_top_logprobs.append(top)
                seq.num_computed_tokens = len(seq) - 1
                self.num_generated_tokens += 1
                if seq.rid in self._streaming:
                    self._deltas.append(TokenDelta(seq.rid, seq.index, [token], [logprob],
                                                   [top] if seq.top_logprobs_num else None))
                if (reason := self._finish_reason(seq)) is not None:
                    self._finish(seq, reason)
        done, self._done = self._done, []
        return done

    def pop_deltas(self) -> list[TokenDelta]:
        """Tokens produced by streaming requests since the last call, in order."""
        deltas, self._deltas = self._deltas, []
        return deltas

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams] | None = None,
                 return_logprob: bool = True, return_routed_experts: bool = False) -> list[RequestOutput]:
        """Offline: run `prompts` to completion; -> outputs ordered by prompt, then sample index."""
        if self.has_unfinished():
            raise EngineBusyError("generate() needs an idle engine; requests are in flight")
        plist = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        for i, (ids, p) in enumerate(zip(prompts, plist, strict=True)):
            self.add_request(GenerationRequest(f"generate-{i}", ids, p, return_logprob,
                                               return_routed_experts=return_routed_experts))
        outputs: list[RequestOutput] = []
        while self.has_unfinished():
            outputs += self.step()
        return sorted(outputs, key=lambda o: (int(o.rid.rsplit("-", 1)[1]), o.index))

    def _fork(self, seq: Sequence) -> list[Sequence]:
        """After its prompt's prefill, a request with n samples becomes n sequences sharing blocks."""
        if seq.fork_n == 1:
            return [seq]
        children = [seq.fork(i + 1, self._generator(s)) for i, s in enumerate(seq.sibling_seeds)]
        seq.sibling_seeds = []
        for child in children:
            self.block_manager.fork(seq, child)
            self.scheduler.add_running(child)
        self._live[seq.rid] += children
        return [seq, *children]

    def _finish_reason(self, seq: Sequence) -> dict[str, Any] | None:
        # SGLang's order: the length budget first, then nothing before min_new_tokens, then stops.
        p, token = seq.params, seq.token_ids[-1]
        if seq.num_output_tokens >= p.max_new_tokens:
            return {"type": "length", "length": p.max_new_tokens}
        if seq.num_output_tokens < p.min_new_tokens:
            return None
        if (not p.ignore_eos and token in self.eos_ids) or token in p.stop_token_ids:
            return {"type": "stop", "matched": token}
        if (matched := self.detokenizer.matched_stop_string(seq)) is not None:
            return {"type": "stop", "matched": matched}
        return None

    def _end(self, rid: str, reason: dict[str, Any]) -> None:
        """Finish every unfinished sample of request `rid` with `reason` (outputs from the next step)."""
        for seq in [s for s in self._live[rid] if not s.is_finished]:
            why = reason
            if reason.get("type") == "abort" and not seq.was_started:
                why = {**reason, "message": ABORT_BEFORE_PREFILL}
            # A request with n samples still queued is one sequence: answer for each sample.
            for i, seed in enumerate(seq.sibling_seeds):
                self._done.append(self._output(seq.fork(i + 1, self._generator(seed)), why))
            self._finish(seq, why)

    def _fail(self, rid: str, message: str) -> None:
        """End request `rid` with `{"type": "error", "message": ...}` (every sample; the failing
        token is not kept). The blocks only it held are zeroed and leave the prefix cache: their KV
        may hold NaN or inf, which the masked slots of their next owner would feed into attention."""
        blocks = {b for s in self._live[rid] for b in s.block_table}
        self._end(rid, {"type": "error", "message": message})
        freed = sorted(b for b in blocks if self.block_manager.blocks[b].ref_count == 0)
        self.block_manager.forget(freed)
        self.runner.zero_blocks(freed)

    def _output(self, seq: Sequence, reason: dict[str, Any]) -> RequestOutput:
        """The output of a finished `seq`; read before its blocks are freed (its routed experts live there)."""
        seq.finish_reason = reason
        routed = self.runner.routed_experts(seq, len(seq) - 1) if seq.return_routed_experts else None
        return make_output(seq, self.weight_version, self.detokenizer.final_text(seq), routed)

    def _finish(self, seq: Sequence, reason: dict[str, Any]) -> None:
        self._done.append(self._output(seq, reason))
        self.scheduler.finish(seq)
        siblings = self._live.get(seq.rid, [])
        if seq in siblings and all(s.is_finished for s in siblings):
            del self._live[seq.rid]
            self._streaming.discard(seq.rid)

    def _draw_seed(self) -> int:
        return int(torch.randint(0, 2**62, (1,), generator=self._seeds))

    def _generator(self, seed: int) -> torch.Generator:
        return torch.Generator(device=self.device).manual_seed(seed)

    # --------------------------------------------------------------------------- control
    def flush_cache(self) -> None:
        """Drop the prefix cache. Raises EngineBusyError while requests are in flight."""
        if self.has_unfinished():
            raise EngineBusyError("cannot flush the cache while requests are in flight")
        self.block_manager.flush()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], weight_version: int | None = None,
                     strict_dtype: bool = True) -> None:
        """Replace all weights atomically (HF names): `stage_weights` checks the whole set first
        (names, shapes, dtypes, finite values) and raises WeightUpdateError naming the first bad
        tensor, with nothing changed; then `swap_staged`."""
        self.swap_staged(stage_weights(self.model, weights, strict_dtype), weight_version)

    def swap_staged(self, staged: dict[Key, torch.Tensor], weight_version: int | None = None) -> bool:
        """Swap in a set `stage_weights` returned (native names and pieces; a caller may validate it on
        another thread) and flush the prefix cache, which is now stale. -> whether the parameters
        adopted the staged tensors as their storage (`swap_weights`)."""
        adopted = swap_weights(self.model, staged)
        self.block_manager.flush()
        if weight_version is not None:
            self.weight_version = weight_version
        return adopted

    @torch.inference_mode()
    def prompt_logprobs(self, input_ids: list[int], start: int, temperature: float,
                        top_n: int = 0) -> tuple[list[float | None], list[list[tuple[float, int]] | None]]:
        """Logprobs of the prompt's own tokens from position `start` on, as the sampler defines
        them (`log_softmax(logits / T)` in float32 of the previous position's logits; T = 1 for
        greedy), from one cache-free forward of the prompt with the current weights (the paged KV
        cache and prefix cache play no part). -> (one entry per position start..len-1, position 0's
        being None: nothing precedes it; with top_n > 0 each position's top_n `(logprob, id)` pairs,
        position 0's None, else []). The trainer's recompute of the same tokens is the same
        computation."""
        if not 0 <= start < len(input_ids):
            raise RequestError(f"logprob_start_len={start} must be in [0, {len(input_ids) - 1}] "
                               f"(the prompt has {len(input_ids)} tokens)")
        ids = torch.tensor(input_ids, device=self.device)
        cu = torch.tensor([0, len(input_ids)], dtype=torch.int32, device=self.device)
        first = max(start, 1) - 1  # logits at position p - 1 predict token p
        hidden = self.model.hidden_states(ids, cu)[first:-1]
        logprobs = torch.log_softmax(self.model.logits_from_hidden(hidden).float() / temperature, dim=-1)
        targets = ids[first + 1:]
        chosen = logprobs.gather(1, targets[:, None])[:, 0].tolist() if len(targets) else []
        lead: list[float | None] = [None] if start == 0 else []
        tops: list[list[tuple[float, int]] | None] = []
        if top_n > 0:
            k = min(top_n, logprobs.shape[1])
            tops = [None] if start == 0 else []
            for row in logprobs:
                order = torch.sort(row, descending=True, stable=True).indices[:k]
                tops.append(list(zip(row[order].tolist(), order.tolist(), strict=True)))
        return lead + chosen, tops

    def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list[float]:
        return get_weight(self.model, name, truncate_size)

    def stats(self) -> dict[str, Any]:
        bm = self.block_manager
        return {
            "running": len(self.scheduler.running), "waiting": len(self.scheduler.waiting),
            "free_blocks": bm.num_free_blocks, "used_blocks": bm.num_used_blocks,
            "cached_blocks": bm.num_cached_blocks, "num_blocks": bm.num_blocks, "block_size": bm.block_size,
            "max_total_num_tokens": self.max_total_num_tokens, "generated_tokens": self.num_generated_tokens,
            "preemptions": self.scheduler.num_preemptions, "weight_version": self.weight_version,
        }


def _eos_ids(model_path: str | os.PathLike[str]) -> frozenset[int]:
    """EOS ids from generation_config.json and config.json (each may be an int or a list)."""
    ids: set[int] = set()
    gen_file = Path(model_path) / "generation_config.json"
    sources = [read_hf_config(model_path)]
    if gen_file.is_file():
        sources.append(json.loads(gen_file.read_text()))
    for cfg in sources:
        eos = cfg.get("eos_token_id")
        ids.update([eos] if isinstance(eos, int) else (eos or []))
    return frozenset(ids)


def load_tokenizer(model_path: str | os.PathLike[str]) -> Any | None:
    """The model directory's HF tokenizer, or None when it has none (the server then speaks token ids)."""
    root = Path(model_path)
    if not any((root / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "vocab.json")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(root))


def _with_index(device: torch.device) -> torch.device:
    """"cuda" as the GPU it means here ("cuda:N"): tensors made on it report their index, and a
    device compared with theirs must too (a staging buffer on "cuda:0" is not "cuda")."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device
