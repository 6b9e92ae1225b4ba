"""
The engine side of disaggregated prefill and decode: a request taken out of one engine after its
prefill (export) and put into another (import), with its sampling state, while kv_transfer.py moves
its prompt's KV blocks between the two.

A prefill engine exports a request once its prompt is computed and its first token sampled: the
request leaves the scheduler, and a holder sequence outside it keeps the prompt's blocks until they
are sent (release_export). A decode engine imports it: it takes its own prefix-cache hits, allocates
the rest of the prompt's blocks before the transfer starts (import_request says which are still
needed), and once they arrived (finish_import) starts every sample from them, as forks. The engine
keeps the holders (Engine.exporting / importing), so abort_request frees them and check_invariants
counts them. Owns the hand-off's records and these moves; it never sends a byte (kv_transfer.py) and
never decides which core takes a request (disaggregation.py).
"""
from dataclasses import dataclass

from engine import Engine
from errors import EngineError
from sampler import SamplingState, make_generator
from sequence import Completion, Request, RequestMetrics, Sequence, Status
from tokenizer import IncrementalDetokenizer


@dataclass
class CompletionHandoff:
    """One sample as a prefill engine leaves it after its first token."""
    index: int
    token_ids: list[int]                  # generated so far
    text: str
    detok_pending: bytes                  # the detokenizer's unfinished UTF-8 character
    emitted_text: int
    emitted_tokens: int
    finish_reason: str | None
    stop_reason: str | int | None
    logprobs: list | None
    generator_state: object = None        # torch.Generator.get_state() of a seeded sample: the stream goes on


@dataclass
class Handoff:
    """A request whose prompt a prefill core computed, on its way to a decode core with its KV blocks."""
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: object                        # SamplingParams
    priority: int
    cache_salt: str | None
    metrics: RequestMetrics
    prompt_logprobs: list | None
    completions: list[CompletionHandoff]
    num_blocks: int                       # the prompt's blocks, sent in order


def ready_for_handoff(engine: Engine) -> list[str]:
    """A prefill engine's requests whose prompt is computed and whose samples have their first token."""
    # sample 0 holds the prompt's blocks; if it ended at its first token (n > 1), the rest decode here
    return [rid for rid, req in engine.requests.items() if req.completions[0].finish_reason is None
            and req.completions[0].seq.num_output_tokens >= 1]


def export_request(engine: Engine, request_id: str) -> Handoff:
    """Take the request out of this engine as it stands; its prompt's blocks stay held (by a sequence
    outside the scheduler) until release_export, when kv_transfer.py has sent them."""
    req = engine.requests.pop(request_id)
    first = req.completions[0].seq
    holder = Sequence(next(engine.seq_ids), list(req.prompt_token_ids), len(req.prompt_token_ids), 0,
                      num_computed_tokens=len(req.prompt_token_ids), request=req)
    holder.block_table = first.block_table[:engine.blocks.blocks_needed(len(req.prompt_token_ids))]
    for block in holder.block_table:        # the prompt's blocks (the first token's KV is not computed yet)
        engine.blocks.ref_counts[block] += 1
    completions = []
    for c in req.completions:
        generator = c.sampling.generator
        completions.append(CompletionHandoff(
            c.index, c.seq.token_ids[c.seq.num_prompt_tokens:], c.text, c.detok._pending, c.emitted_text,
            c.emitted_tokens, c.finish_reason, c.stop_reason, c.logprobs,
            None if generator is None else generator.get_state()))
        if c.finish_reason is None:
            engine._remove(c.seq)
    engine.exporting[request_id] = holder
    return Handoff(request_id, req.prompt, req.prompt_token_ids, req.params, first.priority, req.cache_salt,
                   req.metrics, req.prompt_logprobs, completions, len(holder.block_table))


def release_export(engine: Engine, request_id: str):
    """The blocks were sent (or the transfer failed): free them; an aborted request's are free already."""
    holder = engine.exporting.pop(request_id, None)
    if holder is not None:
        engine.blocks.free(holder)


def exported_blocks(engine: Engine, request_id: str) -> list[int]:
    return engine.exporting[request_id].block_table


def import_request(engine: Engine, h: Handoff) -> list[int]:
    """A decode engine takes a request a prefill engine exported: it allocates the prompt's blocks
    now (its own prefix-cache hits first) and returns the indices, among the prompt's blocks, still to
    receive. The request runs once finish_import says they arrived. Raises EngineError when the pool
    cannot hold the prompt."""
    params, ids = h.params, h.prompt_token_ids
    req = Request(h.request_id, h.prompt, ids, params, [], h.metrics, h.prompt_logprobs, h.cache_salt)
    for ch in h.completions:
        state = SamplingState(params, ids, engine.model_config.vocab_size, make_generator(params.seed, ch.index),
                              engine.eos_token_ids, engine._grammar(params.structured_outputs))
        for token in ch.token_ids:          # penalties' counts and the grammar's state, as the prefill left them
            state.append(token)
        if ch.generator_state is not None:
            state.generator.set_state(ch.generator_state)
        detok = IncrementalDetokenizer(engine.tokenizer, skip_special_tokens=True)
        detok._pending = ch.detok_pending
        seq = Sequence(next(engine.seq_ids), ids + ch.token_ids, len(ids), params.max_tokens, h.priority,
                       h.metrics.arrival_time, request=req)
        req.completions.append(Completion(ch.index, seq, detok, state, ch.text, ch.emitted_text, ch.emitted_tokens,
                                          ch.finish_reason, ch.stop_reason, ch.logprobs))
    holder = Sequence(next(engine.seq_ids), list(ids), len(ids), 0, h.priority, h.metrics.arrival_time, request=req)
    hits = engine.blocks.take_cached_prefix(holder) // engine.config.block_size
    if not engine.blocks.can_allocate(holder, len(ids) - holder.num_computed_tokens):
        engine.blocks.free(holder)
        raise EngineError(f"the decode core has no free KV blocks for a {len(ids)}-token prompt")
    engine.blocks.allocate_slots(holder, len(ids) - holder.num_computed_tokens)
    engine.importing[h.request_id] = (req, holder)
    return list(range(hits, h.num_blocks))


def imported_blocks(engine: Engine, request_id: str) -> list[int]:
    return engine.importing[request_id][1].block_table


def finish_import(engine: Engine, request_id: str):
    """The prompt's KV arrived: register its full blocks in the prefix cache and start every
    unfinished sample decoding from them (they share the blocks, as forks do)."""
    req, holder = engine.importing.pop(request_id)
    holder.num_computed_tokens = len(holder.token_ids)
    engine.blocks.cache_full_blocks(holder)
    for c in req.completions:
        if c.finish_reason is None:
            c.seq.num_computed_tokens = holder.num_computed_tokens
            engine.scheduler.fork(holder, c.seq)
        else:
            c.seq.status = Status.FINISHED
    engine.blocks.free(holder)
    engine.requests[request_id] = req
