"""
The seam between the engine and how its parts are made: the model, its KV pool and its model runner.

EngineBuilder makes them for one process. scaleout/parallel.py's TensorParallelBuilder makes rank 0's
instead (they broadcast each step to the other ranks), and llm.builder_for picks one from the config.
Engine takes whichever it is given and never asks which kind it got. Owns no scheduling and no
requests: only what is built, and the shutdown of whatever building it started.
"""
import torch

from errors import need
from kv_cache import KVCachePool
from model_runner import ModelRunner
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

    def runner(self, *args) -> ModelRunner:
        return ModelRunner(*args)

    def shutdown(self):
        """Stop whatever load_model started (nothing, in one process)."""
