"""
Scale-out: the wings that run the core engine on more than one rank or core. Tensor parallelism
(parallel.py), engine cores behind a router (data_parallel.py, router.py) and disaggregated
prefill/decode (disaggregation.py, handoff.py, kv_transfer.py). These modules import the core; the
core never imports them: it reaches them through one seam, builder_for in llm.py (which builder
makes the engine's model, KV pool and runner) and launcher.py (which client serve.py talks to).
"""
