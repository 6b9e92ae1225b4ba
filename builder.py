"""
The seam between the engine and how its parts are made: the model, its KV pool, its model runner, its
scheduler and its speculator.

EngineBuilder makes them for one process. scaleout/parallel.py's TensorParallelBuilder makes rank 0's
instead (they broadcast each step to the other ranks), and llm.builder_for picks one from the config.
Engine takes whichever it is given and never asks which kind it got. The parts a config may leave out
(the static baseline, speculative decoding, a draft model, the KV tiers, the overlap loop) are imported
only when it asks for them, so a reader of the continuous path never loads them. Owns no scheduling and no requests: only what is built,
and the shutdown of whatever building it started.
"""
import torch

from kv_cache import KVCachePool
from model_runner import ModelRunner
from scheduler import Scheduler
from sequence import need
from weights import load_model


class EngineBuilder:
    """One process: the model loaded here (or one already loaded, shared), a plain pool and runner."""
    tp = None                           # the tensor-parallel group a builder started (scaleout's), if any

    def load_model(self, config, dtype: torch.dtype, device: torch.device, attention_backend: str,
                   loaded_model=None) -> tuple:
        """-> (model, ModelConfig, model_dir); loaded_model: such a triple to share instead of loading."""
        need(config.tensor_parallel_size == 1, "tensor_parallel_size",
             "1 for Engine(...) itself; LLM(...) and llm.build_engine build more ranks", config.tensor_parallel_size)
        return loaded_model or load_model(config.model, dtype, device, None, config.quantization)

    def kv_pool(self, *args) -> KVCachePool:
        return KVCachePool(*args)

    def runner(self, *args, num_speculative_tokens: int = 0) -> ModelRunner:
        return ModelRunner(*args, num_speculative_tokens=num_speculative_tokens)

    def offloader(self, config, pool, blocks, model_id: str, dtype):
        """The prefix cache's tiers below the device (kv_offload.py), or None when the config asks for none."""
        if not (config.kv_offload_memory or config.kv_offload_dir):
            return None
        import kv_offload                   # an optional wing: loaded only when asked for
        return kv_offload.build(config, pool, blocks, model_id, dtype, config.tensor_parallel_size > 1)

    def overlap_loop(self, engine):
        """async_scheduling's two-slot pipeline around the engine's step (async_engine.py)."""
        from async_engine import OverlapLoop   # loaded only when asked for (the default on CUDA)
        return OverlapLoop(engine)

    def device_sampler(self, vocab_size: int, device: torch.device):
        """The sampler's state on the device (sampling_slots.py): on a GPU, and under async scheduling."""
        from sampling_slots import SamplingSlots   # the CPU's plain loop samples from host state (sampler.py)
        return SamplingSlots(vocab_size, device)

    def scheduler(self, config, blocks) -> Scheduler:
        """The continuous-batching scheduler, or (scheduler_mode="static") the baseline it replaces."""
        if config.scheduler_mode == "static":
            from static_scheduler import StaticScheduler       # off the main path: loaded when asked for
            return StaticScheduler(config, blocks)
        return Scheduler(config, blocks)

    def speculator(self, config, dtype: torch.dtype, device: torch.device, attention_backend: str, blocks,
                   vocab_size: int, max_model_len: int, bounds):
        """speculative_config's Speculator (spec_decode.py), with a draft model on a pool of as many blocks
        as ours for method "draft_model" (its runner sized by the scheduler's step bounds); None without
        speculative decoding."""
        spec = config.speculative_config
        if spec is None:
            return None
        from spec_decode import Speculator                     # optional, as is the draft model
        draft = None
        if spec.method == "draft_model":
            from draft_model import DraftModelProposer
            draft = DraftModelProposer(spec.model, dtype, device, attention_backend, blocks.num_blocks,
                                       config.block_size, vocab_size, bounds, max_model_len,
                                       config.enforce_eager)
        return Speculator(spec, max_model_len, draft)

    def shutdown(self):
        """Stop whatever load_model started (nothing, in one process)."""
