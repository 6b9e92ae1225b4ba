"""
The records a request leaves as it moves through the engine, and what it hands back.

A Request is what add_request accepted: its prompt, SamplingParams and n Completions. Each
Completion owns one Sequence, the scheduler's unit of work: token ids (prompt + output so far),
how many of them have K/V in the cache, and its block table. The scheduler moves Sequences
between queues by Status; kv_cache.py edits their block tables; engine.py appends tokens and
turns a Request into a RequestOutput (vLLM's names) after every step.
Plain data only: no tensors, no locks, no behaviour beyond a few derived counts. RequestMetrics
computes TTFT, TPOT and latency once, for LLM users and the server's histograms alike.

The errors a request can end with live here too, as data: the HTTP layer (openai_api.py) maps them to
OpenAI's error body without parsing message text, and the engine never imports the HTTP protocol.
InvalidRequest is bad input (a 400): it carries the field it is about (OpenAI's `param`) and, where
OpenAI has one, the error `code` (e.g. context_length_exceeded). SamplingParams, Engine.add_request
and the configs raise it at the edge where input arrives; nothing deeper in the engine validates.
EngineError: the engine failed a request that was valid (a 500): a step or an add that raised.
"""
from __future__ import annotations      # the annotations below name types this file need not import

from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sampler import SamplingParams, SamplingState
    from tokenizer import IncrementalDetokenizer


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED = "finished"


@dataclass(eq=False)   # a sequence is itself, not its field values: queue look-ups compare identity, not token lists
class Sequence:
    seq_id: int
    token_ids: list[int]                  # prompt + generated so far
    num_prompt_tokens: int
    max_tokens: int
    priority: int = 0                     # lower runs first
    arrival_time: float = 0.0
    status: Status = Status.WAITING
    num_computed_tokens: int = 0          # tokens whose K/V are in the cache
    block_table: list[int] = field(default_factory=list)
    host_block_table: list[int] = field(default_factory=list)   # where it sits while swapped
    block_hashes: list[int] = field(default_factory=list)       # prefix-cache hash of each full block
    num_preemptions: int = 0
    num_cached_tokens: int = 0            # prompt tokens served from the prefix cache at admission
    waited_steps: int = 0                 # lpm: times it was passed over
    request: Request | None = None        # the request this sequence is a sample of
    spec_token_ids: list[int] = field(default_factory=list)    # drafts to verify next step (spec_decode.py); never in token_ids

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def num_spec_tokens(self) -> int:
        return len(self.spec_token_ids)


@dataclass
class RequestMetrics:
    arrival_time: float
    first_token_time: float | None = None
    finished_time: float | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_generated_tokens: int = 0
    num_preemptions: int = 0
    num_spec_steps: int = 0               # speculative decoding: steps that verified drafts,
    num_draft_tokens: int = 0             # the drafts they verified,
    num_accepted_tokens: int = 0          # and how many of those were accepted

    @property
    def mean_acceptance_length(self):
        """Tokens per verifying step, 1 + accepted / steps (vLLM's definition); None if it never drafted."""
        return 1 + self.num_accepted_tokens / self.num_spec_steps if self.num_spec_steps else None

    @property
    def ttft(self):
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def e2e_latency(self):
        return None if self.finished_time is None else self.finished_time - self.arrival_time

    @property
    def tpot(self):
        """Mean time per output token after the first."""
        if self.finished_time is None or self.first_token_time is None or self.num_generated_tokens < 2:
            return None
        return (self.finished_time - self.first_token_time) / (self.num_generated_tokens - 1)


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[dict] | None
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    stop_reason: str | int | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    prompt_logprobs: list[dict[int, float] | None] | None = None   # None for the first prompt token


@dataclass
class Completion:
    """One of a request's n samples as it is being generated."""
    index: int
    seq: Sequence | None
    detok: IncrementalDetokenizer
    sampling: SamplingState           # its seed's generator, token counts for penalties, its grammar
    text: str = ""
    emitted_text: int = 0             # chars of text already sent as deltas
    emitted_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: list | None = None


@dataclass
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    completions: list[Completion]
    metrics: RequestMetrics
    prompt_logprobs: list | None = None   # filled chunk by chunk during prefill; entry j is token j's
    cache_salt: str | None = None         # prefix-cache blocks are shared only between requests with the same salt

    @property
    def finished(self):
        return all(c.finish_reason is not None for c in self.completions)


# The errors a request can end with (see the top of this file).

MAX_QUOTED = 100     # characters of an offending value an error message repeats


class InvalidRequest(ValueError):
    def __init__(self, field: str, message: str, code: str | None = None):
        super().__init__(message)
        self.field, self.code = field, code

    def __reduce__(self):  # it crosses the pipe from the engine core process to serve.py's front end
        return InvalidRequest, (self.field, str(self), self.code)


class EngineError(RuntimeError):
    def __init__(self, message: str, code: str = "engine_error"):
        super().__init__(message)
        self.code = code

    def __reduce__(self):
        return EngineError, (str(self), self.code)


def quoted(value) -> str:
    """repr(value), cut to MAX_QUOTED characters: an error never echoes a megabyte back."""
    text = repr(value)
    return text if len(text) <= MAX_QUOTED else text[:MAX_QUOTED] + f"... ({len(text)} characters)"


def clipped(text: str, limit: int = 4 * MAX_QUOTED) -> str:
    """A message from elsewhere (a parser's) that may quote the whole input, cut to a few lines."""
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} characters)"


def need(ok: bool, field: str, allowed: str, value) -> None:
    """Raise InvalidRequest('<field> must be <allowed>, got <value>') unless ok."""
    if not ok:
        raise InvalidRequest(field, f"{field} must be {allowed}, got {quoted(value)}")
