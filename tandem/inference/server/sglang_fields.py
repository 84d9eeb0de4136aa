"""Every field of SGLang's `/generate` request (`GenerateReqInput`) and its `sampling_params`
(`SamplingParams`), sorted into what `tandem serve` does with it: honoured (`HONOURED_*`), accepted
with no effect (`ACCEPTED_*`), or refused unless neutral (`REFUSED_*`, neutral values in
`NEUTRAL`: a 400 names the field and why). Numbers in strings as SGLang takes them: lax at the top
level, JSON numbers inside `sampling_params`. See docs/inference.md, "SGLang fields"."""

from __future__ import annotations

import json
from typing import Any

from tandem.inference.server.http_api import ApiError

HONOURED_GENERATE = {
    "rid", "text", "input_ids", "sampling_params", "return_logprob", "logprob_start_len", "top_logprobs_num",
    "return_text_in_logprobs", "stream", "return_routed_experts", "routed_experts_start_len",
}
ACCEPTED_GENERATE = {
    "session_id": "an identity only (SGLang: does not alter the prompt)",
    "log_metrics": "this server keeps no per-request metrics",
    "modalities": "describes multimodal data, which must be empty here",
    "use_audio_in_video": "multimodal only",
    "video_config": "multimodal only",
    "mm_hashes": "multimodal only",
    "mm_content_hashes": "multimodal only",
    "encoder_urls": "multimodal (EPD) only",
    "need_wait_for_mm_inputs": "multimodal (EPD) only",
    "num_items_assigned": "multimodal (EPD) only",
    "max_dynamic_patch": "multimodal only", "min_dynamic_patch": "multimodal only",
    "image_max_dynamic_patch": "multimodal only", "video_max_dynamic_patch": "multimodal only",
    "images_config": "multimodal only",
    "kv_router_hint": "an external router's hint for a KV store this server does not have",
    "routing_key": "a routing hint; one server, one queue",
    "conversation_id": "a tracking label",
    "http_worker_ipc": "SGLang-internal routing between its processes",
    "priority": "scheduling order only (first come, first served here); results do not change",
    "extra_key": "a prefix-cache namespace; the cache is exact, so results do not change",
    "cache_salt": "a prefix-cache namespace; the cache is exact, so results do not change",
    "no_logs": "this server logs no request contents",
    "custom_labels": "metric labels; no metrics here",
    "external_trace_header": "tracing context; no tracing here",
    "received_time": "a timestamp for SGLang's latency metrics",
}
REFUSED_GENERATE = {
    "input_embeds": "prompts are token ids or text here; send input_ids",
    "image_data": "this server serves text-only models",
    "video_data": "this server serves text-only models",
    "audio_data": "this server serves text-only models",
    "token_ids_logprob": "logprobs of chosen token ids are not implemented; use top_logprobs_num",
    "return_sampling_mask": "sampling masks are not reported",
    "return_flat_raw_top_logprobs": "top logprobs come in SGLang's nested form only",
    "return_flat_raw_top_logprobs_b64": "top logprobs come in SGLang's nested form only",
    "return_hidden_states": "hidden states are not returned",
    "return_indexer_topk": "no sparse-attention indexer here",
    "session_params": "sessions (continual prompting) are not implemented; send the whole prompt",
    "lora_path": "LoRA adapters are not supported; update the full weights instead",
    "lora_id": "LoRA adapters are not supported; update the full weights instead",
    "custom_logit_processor": "custom logit processors are not supported",
    "positional_embed_overrides": "embedding overrides are not supported",
    "bootstrap_host": "prefill/decode disaggregation is not supported",
    "bootstrap_port": "prefill/decode disaggregation is not supported",
    "bootstrap_room": "prefill/decode disaggregation is not supported",
    "bootstrap_pair_key": "prefill/decode disaggregation is not supported",
    "decode_tp_size": "prefill/decode disaggregation is not supported",
    "disagg_prefill_dp_rank": "prefill/decode disaggregation is not supported",
    "routed_dp_rank": "this server has one data-parallel rank, 0",
    "data_parallel_rank": "this server has one data-parallel rank, 0",
    "background": "background responses are not supported",
    "require_reasoning": "reasoning control is not supported",
    "max_thinking_tokens": "thinking budgets are not supported",
    "return_bytes": "image generation is not supported",
    "return_entropy": "entropies are not returned",
    "return_prompt_token_ids": "prompt token ids are not echoed; the client has them",
    "multi_item_delimiter_indices": "multi-item scoring is not supported",
}
HONOURED_SAMPLING = {
    "max_new_tokens", "stop", "stop_token_ids", "temperature", "top_p", "top_k", "min_new_tokens", "n",
    "ignore_eos", "skip_special_tokens", "frequency_penalty", "presence_penalty", "sampling_seed",
    "seed",  # tandem's own name for sampling_seed
    "spaces_between_special_tokens", "no_stop_trim",  # text only (slime sends both)
    "min_p", "repetition_penalty",
}
ACCEPTED_SAMPLING = {
    "stream_interval": "streaming sends every token; the granularity does not change results",
    "custom_params": "only read by custom logit processors, which are refused",
}
REFUSED_SAMPLING = {
    "stop_regex": "regex stop conditions are not implemented; use stop or stop_token_ids",
    "json_schema": "grammar-constrained decoding is not implemented",
    "regex": "grammar-constrained decoding is not implemented",
    "ebnf": "grammar-constrained decoding is not implemented",
    "structural_tag": "grammar-constrained decoding is not implemented",
    "logit_bias": "logit biases are not implemented",
}
# Neutral values other than null / false / 0 / "" / [] / {}: SGLang's defaults (none left).
NEUTRAL: dict[str, tuple[Any, ...]] = {}
INT_FIELDS = {"logprob_start_len", "top_logprobs_num", "routed_experts_start_len"}
BOOL_FIELDS = {"return_logprob", "return_text_in_logprobs", "stream", "return_routed_experts"}
# pydantic's lax booleans (what SGLang's HTTP model takes), matched case-insensitively.
_BOOL_STRINGS = {**dict.fromkeys(("true", "t", "yes", "y", "on", "1"), True),
                 **dict.fromkeys(("false", "f", "no", "n", "off", "0"), False)}


def _neutral(name: str, value: Any) -> bool:
    if value is None or value is False or (isinstance(value, (str, list, dict)) and not value):
        return True
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value == 0 and name not in NEUTRAL:
        return True
    return any((value == v and type(value) is not bool) or value is v for v in NEUTRAL.get(name, ()))


def check_generate(body: dict[str, Any]) -> dict[str, Any]:
    """Refuse unknown fields and non-neutral refused ones; -> the body with the top-level numbers
    and booleans that SGLang's pydantic model would coerce from strings coerced."""
    known = HONOURED_GENERATE | set(ACCEPTED_GENERATE) | set(REFUSED_GENERATE)
    unknown = sorted(set(body) - known)
    if unknown:
        raise ApiError(f"unknown request field(s) {unknown}; SGLang's GenerateReqInput has no such field "
                       "(docs/inference.md lists every field and what this server does with it)")
    for name, why in REFUSED_GENERATE.items():
        if name in body and not _neutral(name, body[name]):
            if name in ("routed_dp_rank", "data_parallel_rank") and _as_int(body[name], name) == 0:
                continue
            raise ApiError(f"field {name!r} = {json.dumps(body[name])[:80]} is refused: {why}; drop it "
                           "(or send null)")
    out = dict(body)
    for name in INT_FIELDS & set(out):
        if out[name] is not None:
            out[name] = _as_int(out[name], name)
    for name in BOOL_FIELDS & set(out):
        value = out[name]
        if isinstance(value, str) and value.lower() in _BOOL_STRINGS:
            out[name] = _BOOL_STRINGS[value.lower()]
        elif isinstance(value, int | float) and not isinstance(value, bool) and value in (0, 1):
            out[name] = bool(value)
    return out


def check_sampling(raw: dict[str, Any], where: str = "sampling_params") -> dict[str, Any]:
    """Refuse unknown and non-neutral refused sampling fields; -> the fields tandem's
    `SamplingParams.from_dict` takes (sampling_seed becomes seed; null means the default)."""
    known = HONOURED_SAMPLING | set(ACCEPTED_SAMPLING) | set(REFUSED_SAMPLING)
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ApiError(f"unknown {where} field(s) {unknown}; valid fields: {sorted(known)}")
    for name, why in REFUSED_SAMPLING.items():
        if name in raw and not _neutral(name, raw[name]):
            raise ApiError(f"field '{where}.{name}' = {json.dumps(raw[name])[:80]} is refused: {why}; drop it")
    if "max_new_tokens" in raw and raw["max_new_tokens"] is None:
        raise ApiError(f"field '{where}.max_new_tokens' is null (SGLang: up to the context limit); send an integer")
    out = {k: v for k, v in raw.items() if k in HONOURED_SAMPLING and v is not None}
    if "sampling_seed" in out:
        seed = out.pop("sampling_seed")
        if "seed" in out and out["seed"] != seed:
            raise ApiError(f"'{where}.seed' and '{where}.sampling_seed' differ; send one")
        out["seed"] = seed
    return out


def _as_int(value: Any, name: str) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, float) and value.is_integer():  # pydantic (lax) takes 5.0 as 5
        return int(value)
    if isinstance(value, str):
        try:
            return int(value.strip())
        except ValueError:
            pass
    raise ApiError(f"field {name!r} must be an integer (or an integer in a string), got {json.dumps(value)[:80]}")
