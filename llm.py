"""
The offline front end: `LLM(...).generate(prompts, SamplingParams(...))`, vLLM's names.

LLM owns an Engine (engine.py) and nothing else: it turns prompts (text, token ids, or vLLM's
{"prompt" | "prompt_token_ids", "cache_salt"} dicts) into engine requests, all or none, then calls
Engine.step() until they finish (generate), or yields each step's outputs (stream). Chat applies
the model's chat template first. Scheduling, KV blocks, the model and sampling live below it.
build_engine is the one place a builder is chosen (builder.py): tensor parallelism's, from the
scale-out package, only when the config asks for more than one rank; engine_core.py builds with it too.
"""
import itertools

from builder import EngineBuilder
from engine import Engine, EngineConfig, InvalidRequest, RequestOutput, SamplingParams, StructuredOutputsParams

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "build_engine"]


def builder_for(config: EngineConfig) -> EngineBuilder:
    if config.tensor_parallel_size > 1:
        from scaleout.parallel import TensorParallelBuilder   # an optional wing: loaded only when asked for
        return TensorParallelBuilder()
    return EngineBuilder()


def build_engine(config: EngineConfig | None = None, *, loaded_model=None, **overrides) -> Engine:
    """An Engine with the builder its config needs (one process, or rank 0 of a tensor-parallel group)."""
    config = EngineConfig.with_overrides(config, overrides)
    return Engine(config, builder=builder_for(config), loaded_model=loaded_model)


class LLM:
    """Offline generation: `LLM().generate(prompts, SamplingParams(...))`, names as in vLLM."""

    def __init__(self, model: str | None = None, **engine_kwargs):
        self.engine = build_engine(EngineConfig(model=model), **engine_kwargs)
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def _add_all(self, prompts, sampling_params, priority):
        """prompts: a string, token ids, or vLLM's {"prompt" | "prompt_token_ids", "cache_salt"}, or a list of them."""
        if isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise InvalidRequest("sampling_params", f"sampling_params: got {len(params)} for {len(prompts)} prompts")
        priority = priority or [0] * len(prompts)
        ids = []
        try:
            for prompt, p, prio in zip(prompts, params, priority):
                ids.append(f"llm-{next(self._ids)}")
                salt = None
                if isinstance(prompt, dict):
                    salt, prompt = prompt.get("cache_salt"), prompt.get("prompt", prompt.get("prompt_token_ids"))
                self.engine.add_request(ids[-1], prompt, p or SamplingParams(), prio, cache_salt=salt)
        except InvalidRequest:
            for rid in ids:                                 # all or nothing: no half-added batch
                self.engine.abort_request(rid)
            raise
        return ids

    def stream(self, prompts, sampling_params=None, priority=None):
        """Yield RequestOutputs (with delta_text/delta_token_ids) as tokens are produced."""
        ids = set(self._add_all(prompts, sampling_params, priority))
        try:
            while ids and self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.request_id in ids:
                        yield out
                        if out.finished:
                            ids.discard(out.request_id)
        finally:
            for rid in ids:                                 # a consumer that stops early aborts the rest
                self.engine.abort_request(rid)

    def generate(self, prompts, sampling_params=None, use_tqdm=False, priority=None) -> list[RequestOutput]:
        ids = self._add_all(prompts, sampling_params, priority)
        final, bar = {}, None
        if use_tqdm:
            from tqdm import tqdm
            bar = tqdm(total=len(ids), desc="generate")
        try:
            while len(final) < len(ids):
                for out in self.engine.step():
                    if out.finished:
                        final[out.request_id] = out
                        if bar:
                            bar.update(1)
        finally:
            for rid in ids:
                if rid not in final:
                    self.engine.abort_request(rid)
            if bar:
                bar.close()
        return [final[rid] for rid in ids]

    def chat(self, messages, sampling_params=None, use_tqdm=False) -> list[RequestOutput]:
        """messages: one conversation (list of {"role", "content"}) or a list of them."""
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.tokenizer.apply_chat_template(m, add_generation_prompt=True) for m in convs]
        return self.generate(prompts, sampling_params, use_tqdm)
