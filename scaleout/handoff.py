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
counts them. HandoffCore is the engine core loop of a prefill or a decode core: it exports, imports,
and has kv_transfer.py send and receive the blocks. Owns the hand-off's records, its messages and these
moves; it never decides which core takes a request (disaggregation.py).
"""
import logging
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection

from engine import Engine
from engine_core import CoreUpdate, EngineCore
from scaleout.kv_transfer import KVTransfer, TransferGroup
from sequence import Completion, EngineError, Request, RequestMetrics, Sequence, Status
from tokenizer import IncrementalDetokenizer

log = logging.getLogger("nanoserve.handoff")


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


@dataclass
class ImportRequest:
    """Front end -> decode core (disaggregation): take this request from prefill core `src`; its blocks
    come with gloo tag `tag`."""
    handoff: "Handoff"
    src: int
    tag: int


@dataclass
class SendBlocks:
    """Front end -> prefill core: send these of the request's prompt blocks (indices) to rank `dst`."""
    request_id: str
    indices: list[int]
    dst: int
    tag: int



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
    # the prompt's blocks (the first token's KV is not computed yet)
    engine.blocks.hold_for_export(first, holder, len(req.prompt_token_ids))
    completions = []
    for c in req.completions:
        generator = c.sampling.generator
        completions.append(CompletionHandoff(
            c.index, c.seq.token_ids[c.seq.num_prompt_tokens:], c.text, c.detok._pending, c.emitted_text,
            c.emitted_tokens, c.finish_reason, c.stop_reason, c.logprobs,
            None if generator is None else generator.get_state()))
        if c.finish_reason is None:
            engine.remove_sequence(c.seq)
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
        state = engine.sampling_state(params, ids, ch.index)
        for token in ch.token_ids:          # penalties' counts and the grammar's state, as the prefill left them
            state.append(token)
        if ch.generator_state is not None:
            state.generator.set_state(ch.generator_state)
        detok = IncrementalDetokenizer(engine.tokenizer, skip_special_tokens=params.skip_special_tokens)
        detok._pending = ch.detok_pending
        seq = Sequence(next(engine.seq_ids), ids + ch.token_ids, len(ids), params.max_tokens, h.priority,
                       h.metrics.arrival_time, request=req)
        req.completions.append(Completion(ch.index, seq, detok, state, ch.text, ch.emitted_text, ch.emitted_tokens,
                                          ch.finish_reason, ch.stop_reason, ch.logprobs))
    holder = Sequence(next(engine.seq_ids), list(ids), len(ids), 0, h.priority, h.metrics.arrival_time, request=req)
    hits = engine.blocks.allocate_for_import(holder)
    if hits is None:
        raise EngineError(f"the decode core has no free KV blocks for a {len(ids)}-token prompt")
    engine.kv_pool.run(engine.blocks.take_pending_ops())     # a prefix restored from an offload tier
    engine.importing[h.request_id] = (req, holder)
    return list(range(hits, h.num_blocks))


def imported_blocks(engine: Engine, request_id: str) -> list[int]:
    return engine.importing[request_id][1].block_table


def finish_import(engine: Engine, request_id: str):
    """The prompt's KV arrived: register its full blocks in the prefix cache and start every
    unfinished sample decoding from them (they share the blocks, as forks do)."""
    req, holder = engine.importing.pop(request_id)
    engine.blocks.finish_import(holder)
    for c in req.completions:
        if c.finish_reason is None:
            c.seq.num_computed_tokens = holder.num_computed_tokens
            engine.scheduler.fork(holder, c.seq)
        else:
            c.seq.status = Status.FINISHED
    engine.blocks.free(holder)
    engine.requests[request_id] = req


# ----------------------------------------------------------------------------- the core loop of one role

class HandoffCore(EngineCore):
    """A prefill core (exports each request once its prompt is done and sends its blocks where the front
    end says) or a decode core (imports requests, receives their blocks, decodes them)."""

    def __init__(self, engine: Engine, conn: Connection, grammar_timeout: float, transfer: KVTransfer, role: str):
        super().__init__(engine, conn, grammar_timeout)
        self.transfer, self.role = transfer, role       # role: prefill | decode
        if role == "prefill" and engine.overlap is not None:   # a hand-off needs the first token on the host
            log.info("async_scheduling off: a prefill core hands each request off after its first token")
            engine.overlap = None

    @classmethod
    def joining(cls, group: TransferGroup, role: str, engine: Engine, conn: Connection,
                grammar_timeout: float) -> "HandoffCore":
        """engine_core.run_core_process's make_core: join the KV-transfer group (waits for every core of it)."""
        try:
            transfer = KVTransfer(group)
        except Exception as exc:
            raise RuntimeError(f"joining the KV transfer group failed: {exc!r}") from exc
        return cls(engine, conn, grammar_timeout, transfer, role)

    def handle(self, command, update: CoreUpdate) -> None:
        if isinstance(command, ImportRequest):
            self.import_request(command, update)
        elif isinstance(command, SendBlocks):
            if command.request_id in self.engine.exporting:   # else aborted meanwhile
                blocks = exported_blocks(self.engine, command.request_id)
                self.transfer.send(self.engine.kv_pool, command.request_id,
                                   [blocks[i] for i in command.indices], command.dst, command.tag)
        else:
            super().handle(command, update)

    def abort(self, request_ids: list[str], update: CoreUpdate) -> None:
        super().abort(request_ids, update)
        for request_id in request_ids:
            self.transfer.drop(request_id)

    def after_step(self, update: CoreUpdate) -> None:
        if self.role == "prefill":   # prompt done and first token out: the rest decodes elsewhere
            update.handoffs = [export_request(self.engine, rid) for rid in ready_for_handoff(self.engine)]

    def waiting_elsewhere(self) -> bool:
        return self.transfer.busy()

    def close(self) -> None:
        self.transfer.close()

    # -- the engine allocates and frees, kv_transfer.py moves the bytes
    def import_request(self, command: ImportRequest, update: CoreUpdate) -> None:
        request_id = command.handoff.request_id
        try:
            needed = import_request(self.engine, command.handoff)
        except Exception as exc:    # no room, or a grammar that does not compile here
            update.failed.append((request_id, exc if isinstance(exc, EngineError) else EngineError(repr(exc))))
            return
        blocks = imported_blocks(self.engine, request_id)
        self.transfer.receive(self.engine.kv_pool, request_id, [blocks[i] for i in needed], command.src, command.tag)
        update.wanted.append((request_id, needed, command.tag))

    def poll_elsewhere(self, update: CoreUpdate) -> None:
        if not self.transfer.busy():
            return
        sent, received, failed = self.transfer.poll(self.engine.kv_pool)
        now = time.monotonic()
        for t in sent:
            release_export(self.engine, t.request_id)
            update.sent.append((t.request_id, t.nbytes, now - t.started))
        for t in received:
            finish_import(self.engine, t.request_id)
            update.received.append((t.request_id, t.nbytes, now - t.started))
        for request_id, exc in failed:     # the peer died: free this side's blocks; a decode core fails the request
            log.error("KV transfer of %s failed: %r", request_id, exc)
            if request_id in self.engine.importing:
                update.failed.append((request_id, EngineError(f"KV transfer failed: {exc}")))
            self.engine.abort_request(request_id)
