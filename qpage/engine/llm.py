"""The offline API, with vLLM's names and shapes: ``LLM(...).generate(prompts, params)``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from qpage.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig, field_default
from qpage.engine.engine import LLMEngine, PromptType
from qpage.engine.outputs import RequestOutput
from qpage.sampling_params import SamplingParams

Message = dict[str, Any]


class LLM:
    """An engine for offline batches. Arguments mirror vLLM's ``LLM``; defaults come from
    the config dataclasses."""

    def __init__(
        self,
        model: str | None = field_default(ModelConfig, "model"),
        dtype: str = field_default(ModelConfig, "dtype"),
        max_model_len: int | None = field_default(ModelConfig, "max_model_len"),
        max_num_seqs: int = field_default(SchedulerConfig, "max_num_seqs"),
        max_num_batched_tokens: int = field_default(SchedulerConfig, "max_num_batched_tokens"),
        kv_cache_memory: int | str = field_default(CacheConfig, "kv_cache_memory"),
        enable_prefix_caching: bool = field_default(CacheConfig, "enable_prefix_caching"),
        seed: int = field_default(EngineConfig, "seed"),
        logprobs_mode: str = field_default(EngineConfig, "logprobs_mode"),
        device: str = field_default(ModelConfig, "device"),
        allow_pickle: bool = field_default(ModelConfig, "allow_pickle"),
        trust_remote_code: bool = field_default(ModelConfig, "trust_remote_code"),
        log_stats: bool = field_default(EngineConfig, "log_stats"),
        kv_cache_dtype: str = field_default(CacheConfig, "kv_cache_dtype"),
        kv_cache_scales: str = field_default(CacheConfig, "kv_cache_scales"),
        kv_cache_rotation: bool = field_default(CacheConfig, "kv_cache_rotation"),
        attention_backend: str = field_default(ModelConfig, "attention_backend"),
        dequantize_weights: bool = field_default(ModelConfig, "dequantize_weights"),
        tensor_parallel_size: int = field_default(ParallelConfig, "tensor_parallel_size"),
        distributed_timeout: float = field_default(ParallelConfig, "distributed_timeout"),
        speculative_config: dict[str, Any] | str | None = None,
    ) -> None:
        config = EngineConfig(
            model=ModelConfig(model=model, dtype=dtype, max_model_len=max_model_len,
                              allow_pickle=allow_pickle, trust_remote_code=trust_remote_code,
                              device=device, attention_backend=attention_backend,
                              dequantize_weights=dequantize_weights),
            cache=CacheConfig(kv_cache_memory=kv_cache_memory, enable_prefix_caching=enable_prefix_caching,
                              kv_cache_dtype=kv_cache_dtype, kv_cache_scales=kv_cache_scales,
                              kv_cache_rotation=kv_cache_rotation),
            scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens),
            parallel=ParallelConfig(tensor_parallel_size=tensor_parallel_size,
                                    distributed_timeout=distributed_timeout),
            seed=seed,
            logprobs_mode=logprobs_mode,
            log_stats=log_stats,
            speculative_config=speculative_config,  # type: ignore[arg-type]  # parsed by EngineConfig
        )
        self.llm_engine = LLMEngine(config)

    def shutdown(self) -> None:
        """Stop the tensor-parallel worker processes now (they also stop when this object is
        collected or the process exits)."""
        self.llm_engine.shutdown()

    def get_tokenizer(self) -> Any:
        return self.llm_engine.tokenizer

    def get_metrics(self) -> dict[str, Any]:
        """Engine metrics keyed by their Prometheus names (``qpage:...``)."""
        return self.llm_engine.get_metrics()

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        return self._run(list(prompts), sampling_params, use_tqdm, add_special_tokens=True)

    def chat(
        self,
        messages: list[Message] | list[list[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to conversations; ``tools`` (OpenAI's function tools) are passed to
        the chat template. Calls are not parsed here: constrain them with ``structured_outputs``."""
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts: list[PromptType] = [
            self.apply_chat_template(c, chat_template, add_generation_prompt, tools)  # type: ignore[arg-type]
            for c in convs
        ]
        return self._run(prompts, sampling_params, use_tqdm, add_special_tokens=False)

    def apply_chat_template(
        self, conversation: list[Message], chat_template: str | None = None,
        add_generation_prompt: bool = True, tools: list[dict[str, Any]] | None = None,
    ) -> str:
        tok = self.llm_engine.tokenizer
        if chat_template is None and not getattr(tok, "chat_template", None):
            raise ValueError(
                f"{self.llm_engine.model_dir} has no chat template; use generate() or pass chat_template="
            )
        return tok.apply_chat_template(
            conversation, chat_template=chat_template, tokenize=False, tools=tools,
            add_generation_prompt=add_generation_prompt,
        )

    def _run(
        self, prompts: list[PromptType],
        params: SamplingParams | Sequence[SamplingParams] | None, use_tqdm: bool,
        add_special_tokens: bool,
    ) -> list[RequestOutput]:
        if params is None:
            params = SamplingParams()
        if isinstance(params, SamplingParams):
            plist = [params] * len(prompts)
        else:
            plist = list(params)
            if len(plist) != len(prompts):
                raise ValueError(
                    f"got {len(prompts)} prompts but {len(plist)} SamplingParams; give one, or one per prompt"
                )
        engine = self.llm_engine
        ids: list[str] = []
        try:
            for p, sp in zip(prompts, plist, strict=True):
                ids.append(engine.add_request(p, sp, add_special_tokens=add_special_tokens))
        except Exception:
            for rid in ids:  # leave the engine as it was: other callers' requests go on
                engine.abort_request(rid)
            raise
        return self._drain(ids, use_tqdm)

    def _drain(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        pending = set(ids)
        done: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(ids), desc="Processed prompts", dynamic_ncols=True)
        try:
            while pending:
                for out in self.llm_engine.step():
                    if out.finished and out.request_id in pending:
                        pending.discard(out.request_id)
                        done[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
        except BaseException:
            for rid in pending:
                self.llm_engine.abort_request(rid)
            raise
        finally:
            if bar is not None:
                bar.close()
        return [done[i] for i in ids]
