"""
The OpenAI protocol of nanoserve: what /v1/completions and /v1/chat/completions accept and answer.

It owns the request schemas, their validation into prompts and SamplingParams, OpenAI's error
body (APIError, with `param` naming the offending field, the engine's InvalidRequest included), and the
builders of response bodies, SSE chunks, logprobs and usage. Input that the engine validates
(prompt ids, context length, sampling ranges) is checked once, by Engine.add_request in the
engine core; its InvalidRequest names the field and its OpenAI code, and this file only renames
the field to the endpoint's (`aliases`). What is checked here is the protocol's own: the schema,
the model name, and the fields the engine has no notion of.
It starts no threads, never steps
the engine and holds no HTTP connections: serve.py owns those and hands outputs in here.
"""
import json
import math
import time
import uuid
from dataclasses import dataclass
from typing import AsyncIterator, Literal, Union

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, ValidationError

from engine import PromptLimits, RequestOutput, SamplingParams, StructuredOutputsParams
from errors import InvalidRequest, quoted
from tokenizer import Tokenizer

MAX_N = 16  # choices per prompt; more would let one request crowd out the batch
MAX_MESSAGE = 400   # characters of an error message: our own fit; one echoing a megabyte of input is cut


# ----------------------------------------------------------------------------- errors

class APIError(Exception):
    """An error that reaches the client as OpenAI's {"error": {...}} body."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict | None = None):
        if len(message) > MAX_MESSAGE:   # e.g. a parser's error that quotes the whole offending input
            message = message[:MAX_MESSAGE] + f"... ({len(message)} characters)"
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers

    def __reduce__(self):  # the engine core process sends these to the front end
        return APIError, (self.status, self.message, self.param, self.code, self.headers)

    def body(self) -> dict:
        kind = {404: "not_found_error"}.get(self.status, "invalid_request_error" if self.status < 500 else "server_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def validation_error(errors: list[dict]) -> APIError:
    """Map the first pydantic error to a 400 naming the offending top-level field."""
    err = errors[0]
    if err["type"] == "json_invalid":
        return APIError(400, f"Invalid JSON body: {err.get('ctx', {}).get('error', err['msg'])}", code="invalid_json")
    loc = [str(x) for x in err["loc"]]
    where = ".".join(loc) or "body"
    if err["type"] == "extra_forbidden":
        return APIError(400, f"Unsupported field '{where}'", loc[0], code="unsupported_field")
    return APIError(400, f"{where}: {err['msg']}", loc[0] if loc else None)


def invalid(exc: InvalidRequest, aliases: dict[str, str]) -> APIError:
    """The engine's error as a 400 naming the field as this endpoint calls it."""
    return APIError(400, str(exc), aliases.get(exc.field, exc.field), code=exc.code)


# ----------------------------------------------------------------------------- request schemas

class Strict(BaseModel):
    # Unknown fields are rejected, never silently ignored; "5" is not an int.
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(Strict):
    include_usage: bool = False


class SamplingRequest(Strict):
    """Fields shared by completions and chat; None means "use the SamplingParams default"."""
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    n: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    priority: int = 0
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None  # vLLM's extra (vllm bench serve sends 1.0)
    min_tokens: int | None = None            # vLLM's extra
    logit_bias: dict[str, float] | None = None
    response_format: dict | None = None      # {"type": "text" | "json_object" | "json_schema", ...}
    structured_outputs: dict | None = None   # vLLM's extra: {"json" | "regex" | "choice" | "grammar" | "json_object": ...}
    cache_salt: str | None = None            # vLLM's: prefix-cache blocks are shared only within one salt
    user: str | None = None                  # the caller's end-user id for its own bookkeeping


class CompletionRequest(SamplingRequest):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class TextPart(Strict):
    type: Literal["text"]
    text: str


class ChatMessage(Strict):
    role: Literal["system", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None


class ChatRequest(SamplingRequest):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None


def reject_unsupported(req: SamplingRequest) -> None:
    """Fields whose combination we cannot honour. (Fields we do not know at all are rejected by
    the schema: e.g. `tools`, `tool_choice`, `functions`; `suffix` and `best_of` > n by CompletionExchange.)"""
    if req.stream_options is not None and not req.stream:
        raise APIError(400, "stream_options is only allowed with stream=true", "stream_options")
    if req.response_format is not None and req.structured_outputs is not None:
        raise APIError(400, "give either response_format or structured_outputs, not both", "structured_outputs")


def structured_outputs(req: SamplingRequest) -> StructuredOutputsParams | None:
    """OpenAI's response_format (or vLLM's structured_outputs) as the engine's StructuredOutputsParams.
    Whether the schema compiles is checked by SamplingParams.validate, under the same field name."""
    if req.structured_outputs is not None:
        kinds = ("json", "regex", "choice", "grammar", "json_object")
        unknown = set(req.structured_outputs) - set(kinds)
        if unknown:
            raise APIError(400, f"structured_outputs: unsupported key(s) {sorted(unknown)}; use one of {kinds}",
                           "structured_outputs")
        return StructuredOutputsParams(**req.structured_outputs)
    fmt = req.response_format
    if fmt is None or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_object":
        return StructuredOutputsParams(json_object=True)
    if fmt.get("type") == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
            raise APIError(400, "response_format.json_schema must be an object whose `schema` is a JSON schema "
                                "object", "response_format")
        return StructuredOutputsParams(json=spec.get("schema", {}))   # OpenAI: a missing schema allows any JSON
    raise APIError(400, f"response_format.type must be 'text', 'json_object' or 'json_schema', got "
                        f"{quoted(fmt.get('type'))}", "response_format")


def logit_bias(req: SamplingRequest) -> dict[int, float] | None:
    """OpenAI sends token ids as JSON object keys, i.e. strings."""
    if req.logit_bias is None:
        return None
    try:
        return {int(k): v for k, v in req.logit_bias.items()}
    except ValueError:
        raise APIError(400, "logit_bias keys must be token ids (integers as strings)", "logit_bias") from None


# ----------------------------------------------------------------------------- what one request may ask for

@dataclass(frozen=True)
class RequestLimits:
    """What one request may ask for, counted in sequences and bytes: each bounds the work a single
    small body can make the engine do, at admission or on every step (serve.py's flags set them).
    Past a limit: a 400 naming the field and the flag."""
    max_seqs_per_request: int = 128     # prompts x n: each is a sequence the scheduler must hold
    max_logit_bias: int = 300           # entries (OpenAI's cap)
    max_stop: int = 64                  # stop strings: each is searched for after every token
    max_stop_chars: int = 256           # characters of one stop string (also what a stream holds back)
    max_stop_token_ids: int = 256
    max_grammar_bytes: int = 64 << 10   # a JSON schema, regex, grammar or choice list, as JSON text

    def check(self, req: "SamplingRequest", num_prompts: int) -> None:
        def need(ok, field, message):
            if not ok:
                raise APIError(400, message, field, code="limit_exceeded")
        n = req.n or 1
        need(num_prompts * n <= self.max_seqs_per_request, "n" if n > 1 else "prompt",
             f"{num_prompts} prompts x n={n} = {num_prompts * n} sequences; at most {self.max_seqs_per_request} "
             f"per request (--max-seqs-per-request)")
        need(len(req.logit_bias or ()) <= self.max_logit_bias, "logit_bias",
             f"logit_bias has {len(req.logit_bias or ())} entries; at most {self.max_logit_bias} (--max-logit-bias)")
        stops = [req.stop] if isinstance(req.stop, str) else req.stop or []
        need(len(stops) <= self.max_stop, "stop", f"stop has {len(stops)} strings; at most {self.max_stop} "
                                                  f"(--max-stop-strings)")
        long = next((s for s in stops if len(s) > self.max_stop_chars), None)
        need(long is None, "stop", f"a stop string has {len(long or '')} characters; at most {self.max_stop_chars} "
                                   f"(--max-stop-chars): {quoted(long)}")
        need(len(req.stop_token_ids or ()) <= self.max_stop_token_ids, "stop_token_ids",
             f"stop_token_ids has {len(req.stop_token_ids or ())} ids; at most {self.max_stop_token_ids} "
             f"(--max-stop-token-ids)")
        field = "structured_outputs" if req.structured_outputs is not None else "response_format"
        spec = req.structured_outputs if req.structured_outputs is not None else req.response_format
        size = 0 if spec is None else len(json.dumps(spec))
        need(size <= self.max_grammar_bytes, field, f"{field} is {size} bytes as JSON; at most "
                                                    f"{self.max_grammar_bytes} (--max-grammar-bytes)")


# ----------------------------------------------------------------------------- the served model's limits

class OpenAIProtocol:
    """Checks requests against the served model (name, vocabulary, context, policy) and renders tokens."""

    def __init__(self, tokenizer: Tokenizer, limits: PromptLimits, scheduling_policy: str, model_name: str,
                 request_limits: RequestLimits = RequestLimits()):
        self.tokenizer, self.limits, self.model_name = tokenizer, limits, model_name
        self.request_limits = request_limits
        self.vocab_size, self.max_model_len = limits.vocab_size, limits.max_model_len
        self.scheduling_policy = scheduling_policy
        self.token_text_cache: dict[int, str] = {}

    def parse(self, body: bytes, schema: type[SamplingRequest]) -> SamplingRequest:
        try:
            req = schema.model_validate_json(body)
        except ValidationError as exc:
            raise validation_error(exc.errors()) from None
        if req.model is not None and req.model != self.model_name:
            raise APIError(404, f"The model '{req.model}' does not exist; this server serves '{self.model_name}'",
                           "model", code="model_not_found")
        reject_unsupported(req)
        # before anything is tokenized or compiled: the request's size in sequences and bytes
        self.request_limits.check(req, len(normalize_prompts(req.prompt)) if isinstance(req, CompletionRequest) else 1)
        return req

    def token_ids(self, prompt: str | list[int]) -> list[int]:
        return self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)

    def sampling_params(self, req: SamplingRequest, max_tokens: int, logprobs: int | None,
                        prompt_logprobs: int | None = None) -> SamplingParams:
        """The request's SamplingParams; their ranges are the engine's to check (at add)."""
        if req.n is not None and req.n > MAX_N:
            raise APIError(400, f"n must be between 1 and {MAX_N}, got {req.n}", "n")
        if req.seed is not None and not 0 <= req.seed < 2**32:  # the engine overflows on huge seeds
            raise APIError(400, f"seed must be an integer in [0, 2**32), got {req.seed}", "seed")
        names = ("n", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids",
                 "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens")
        given = {name: getattr(req, name) for name in names if getattr(req, name) is not None}
        try:
            params = SamplingParams(max_tokens=max_tokens, ignore_eos=req.ignore_eos, logprobs=logprobs,
                                    prompt_logprobs=prompt_logprobs, logit_bias=logit_bias(req),
                                    structured_outputs=structured_outputs(req), **given)
        except TypeError as exc:    # StructuredOutputsParams(**body) with a wrong shape
            raise APIError(400, f"structured_outputs: {exc}", "structured_outputs") from None
        if req.priority and self.scheduling_policy != "priority":
            raise APIError(400, "priority needs --scheduling-policy priority", "priority")
        return params

    def token_text(self, token_id: int) -> str:
        text = self.token_text_cache.get(token_id)
        if text is None:
            text = self.token_text_cache[token_id] = self.tokenizer.decode([token_id])
        return text


# ----------------------------------------------------------------------------- response pieces

def sse(obj) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


def finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else -9999.0  # JSON has no -Infinity


def top_entries(logprobs: dict[int, float], k: int) -> list[tuple[int, float]]:
    return sorted(logprobs.items(), key=lambda kv: -kv[1])[:k]


def usage(prompts: list[list[int]], outs: list) -> dict:
    prompt_tokens = sum(len(p) for p in prompts)
    completion_tokens = sum(len(c.token_ids) for out in outs if out for c in out.outputs)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


class ChoiceCursor:
    """What of one choice has been streamed so far: tokens sent, the text offset reached, and the
    echoed prompt still to send in front of the first text (with the prompt's output, for its logprobs)."""

    def __init__(self, echo: str = "", prompt_output: RequestOutput | None = None):
        self.num_tokens, self.text_offset, self.finished, self.echo = 0, len(echo), False, echo
        self.prompt_output = prompt_output

    def has_news(self, c, with_logprobs: bool) -> bool:
        """Worth a chunk: new text, the finish, or (with logprobs) new tokens. Tokens whose text is held
        back (half a UTF-8 character, a possible stop string) make no empty chunk otherwise."""
        if self.finished:
            return False
        new_tokens = with_logprobs and len(c.token_ids) > self.num_tokens
        return bool(c.delta_text or self.echo or c.finish_reason is not None or new_tokens)


# ----------------------------------------------------------------------------- one request, either endpoint

class Exchange:
    """One validated request (its prompts and SamplingParams) and the builder of its answer.

    Choice i*n + j is sample j of prompt i, as OpenAI numbers them. Subclasses give the endpoint's
    input checks and the shape of one choice, whole (`message`) or streamed (`delta`)."""
    prefix = object_name = ""

    def __init__(self, api: OpenAIProtocol, req: SamplingRequest, prompts: list[list[int]], max_tokens: int,
                 logprobs: int | None, aliases: dict[str, str], echoes: list[str], prompt_logprobs: int | None = None):
        if req.response_format is not None:
            aliases = {**aliases, "structured_outputs": "response_format"}
        self.api, self.req, self.prompts, self.aliases, self.echoes = api, req, prompts, aliases, echoes
        self.params = api.sampling_params(req, max_tokens, logprobs, prompt_logprobs)
        self.check_as_the_engine_will()
        self.request_id = f"{self.prefix}-{uuid.uuid4().hex}"
        self.head = {"id": self.request_id, "object": self.object_name, "created": int(time.time()),
                     "model": api.model_name}
        self.cursors: dict[int, ChoiceCursor] = {}

    def check_as_the_engine_will(self) -> None:
        """The engine's own checks (sampling ranges, prompt ids, context length, cache_salt), run here
        too, off the event loop: bad input gets its 400 before it is counted against the queue (a 503
        under load would hide it), and the engine core never spends a turn on it. add_request checks
        again; it is the authority."""
        try:
            self.params.validate(self.api.vocab_size)
            for ids in self.prompts:
                self.api.limits.check(ids, self.params.max_tokens)
            if self.req.cache_salt is not None and not self.req.cache_salt:
                raise InvalidRequest("cache_salt", "cache_salt must be a non-empty string or None")
        except InvalidRequest as exc:
            raise self.engine_error(exc) from None

    def engine_error(self, exc: InvalidRequest) -> APIError:
        """The engine rejected the input at add time: a 400 naming the field as this endpoint does."""
        return invalid(exc, self.aliases)

    def body(self, outs: list[RequestOutput]) -> dict:
        """The non-streamed answer, from each prompt's final output."""
        choices = [{"index": i * self.params.n + c.index, **self.message(c, self.echoes[i], out)}
                   for i, out in enumerate(outs) for c in out.outputs]
        return {**self.head, "choices": choices, "usage": usage(self.prompts, outs)}

    async def events(self, outputs: AsyncIterator[tuple[int, RequestOutput]]):
        """The streamed answer as SSE lines; an error mid-stream becomes an error event before [DONE]."""
        outs = [None] * len(self.prompts)
        try:
            for choice in self.opening():
                yield sse({**self.head, "choices": [choice]})
            async for index, out in outputs:
                outs[index] = out
                for c in out.outputs:
                    choice = self.chunk(index, c, out)
                    if choice is not None:
                        yield sse({**self.head, "choices": [choice]})
            if self.req.stream_options and self.req.stream_options.include_usage:
                yield sse({**self.head, "choices": [], "usage": usage(self.prompts, outs)})
        except APIError as exc:
            yield sse(exc.body())
        yield "data: [DONE]\n\n"

    def chunk(self, index: int, c, out: RequestOutput) -> dict | None:
        """The streamed choice for what is new in c since its last chunk, or None if nothing is."""
        choice_index = index * self.params.n + c.index
        cursor = self.cursors.setdefault(choice_index, ChoiceCursor(self.echoes[index], out))
        if not cursor.has_news(c, self.params.logprobs is not None):
            return None
        choice = {"index": choice_index, **self.delta(c, cursor)}
        cursor.num_tokens, cursor.finished, cursor.echo = len(c.token_ids), c.finish_reason is not None, ""
        return choice

    def opening(self) -> list[dict]:
        return []

    def message(self, c, echo: str, out: RequestOutput) -> dict:
        raise NotImplementedError

    def delta(self, c, cursor: ChoiceCursor) -> dict:
        raise NotImplementedError


class CompletionExchange(Exchange):
    prefix, object_name = "cmpl", "text_completion"

    def __init__(self, api: OpenAIProtocol, req: CompletionRequest):
        if req.suffix:
            raise APIError(400, "suffix is not supported", "suffix")
        if req.best_of is not None and req.best_of != (req.n or 1):
            raise APIError(400, "best_of is not supported (must equal n)", "best_of")
        texts = normalize_prompts(req.prompt)
        prompts = [api.token_ids(p) for p in texts]
        max_tokens = 16 if req.max_tokens is None else req.max_tokens   # OpenAI's legacy default
        echoes = [(t if isinstance(t, str) else api.tokenizer.decode(t)) if req.echo else "" for t in texts]
        # echo with logprobs: the prompt's logprobs, computed during its prefill
        prompt_logprobs = req.logprobs if req.echo else None
        super().__init__(api, req, prompts, max_tokens, req.logprobs, {}, echoes, prompt_logprobs)

    def message(self, c, echo: str, out: RequestOutput) -> dict:
        top_n = self.params.logprobs
        logprobs = None
        if top_n is not None:
            logprobs = self.logprobs(c, 0, len(c.token_ids), len(echo), top_n)[0]
            if echo:
                logprobs = join_logprobs(self.echo_logprobs(out, top_n), logprobs)
        return {"text": echo + c.text, "logprobs": logprobs, "finish_reason": c.finish_reason}

    def delta(self, c, cursor: ChoiceCursor) -> dict:
        top_n, logprobs = self.params.logprobs, None
        if top_n is not None:
            logprobs, cursor.text_offset = self.logprobs(c, cursor.num_tokens, len(c.token_ids),
                                                         cursor.text_offset, top_n)
            if cursor.echo:
                logprobs = join_logprobs(self.echo_logprobs(cursor.prompt_output, top_n), logprobs)
        return {"text": cursor.echo + c.delta_text, "logprobs": logprobs, "finish_reason": c.finish_reason}

    def echo_logprobs(self, out: RequestOutput, top_n: int) -> dict:
        """The echoed prompt's part of legacy logprobs; the first token has none (null), as in OpenAI."""
        tokens, token_logprobs, top, offsets, text_offset = [], [], [], [], 0
        for token_id, logprobs in zip(out.prompt_token_ids, out.prompt_logprobs):
            text = self.api.token_text(token_id)
            tokens.append(text)
            token_logprobs.append(None if logprobs is None else finite(logprobs[token_id]))
            top.append(None if logprobs is None else
                       {self.api.token_text(t): finite(v) for t, v in top_entries(logprobs, top_n)})
            offsets.append(text_offset)
            text_offset += len(text)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}

    def logprobs(self, c, start: int, end: int, text_offset: int, top_n: int) -> tuple[dict, int]:
        """OpenAI's legacy logprobs for tokens [start, end) of choice c, and the text offset after them."""
        tokens, token_logprobs, top, offsets = [], [], [], []
        for token_id, logprobs in zip(c.token_ids[start:end], c.logprobs[start:end]):
            text = self.api.token_text(token_id)
            tokens.append(text)
            token_logprobs.append(finite(logprobs[token_id]))
            top.append({self.api.token_text(t): finite(v) for t, v in top_entries(logprobs, top_n)})
            offsets.append(text_offset)
            text_offset += len(text)
        body = {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}
        return body, text_offset


def join_logprobs(first: dict, then: dict) -> dict:
    return {key: first[key] + then[key] for key in first}


def normalize_prompts(prompt) -> list[str | list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise APIError(400, "prompt must not be empty", "prompt")
    if isinstance(prompt[0], int):
        return [prompt]
    return list(prompt)


class ChatExchange(Exchange):
    prefix = "chatcmpl"

    def __init__(self, api: OpenAIProtocol, req: ChatRequest):
        if not req.messages:
            raise APIError(400, "messages must contain at least one message", "messages")
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "top_logprobs requires logprobs=true", "top_logprobs")
        self.object_name = "chat.completion.chunk" if req.stream else "chat.completion"
        prompt = render_chat(api, req.messages)
        max_field = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        if max_tokens is None:   # OpenAI: up to the context length; capped at what the KV pool holds, as vLLM does
            fits = api.limits.usable_blocks * api.limits.block_size
            max_tokens = max(1, min(api.max_model_len, fits) - len(prompt))
        aliases = {"prompt": "messages", "logprobs": "top_logprobs", "max_tokens": max_field}
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        super().__init__(api, req, [prompt], max_tokens, logprobs, aliases, [""])

    def opening(self) -> list[dict]:  # OpenAI opens every choice with the role alone
        return [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
                for i in range(self.params.n)]

    def message(self, c, echo: str, out: RequestOutput) -> dict:
        return {"message": {"role": "assistant", "content": c.text},
                "logprobs": self.logprobs(c, 0), "finish_reason": c.finish_reason}

    def delta(self, c, cursor: ChoiceCursor) -> dict:
        delta = {"content": c.delta_text} if c.delta_text or c.finish_reason is None else {}
        return {"delta": delta, "logprobs": self.logprobs(c, cursor.num_tokens), "finish_reason": c.finish_reason}

    def logprobs(self, c, start: int) -> dict | None:
        """OpenAI's chat logprobs for the tokens of choice c from start on; None unless asked for."""
        top_n = self.params.logprobs
        if top_n is None:
            return None

        def entry(token_id, logprob):  # bytes are exact even where a token holds half a UTF-8 character
            return {"token": self.api.token_text(token_id), "logprob": finite(logprob),
                    "bytes": list(self.api.tokenizer.token_bytes(token_id))}
        return {"content": [{**entry(t, lps[t]), "top_logprobs": [entry(k, v) for k, v in top_entries(lps, top_n)]}
                            for t, lps in zip(c.token_ids[start:], c.logprobs[start:])]}


def render_chat(api: OpenAIProtocol, messages: list[ChatMessage]) -> list[int]:
    plain = [{"role": m.role, "content": m.content if isinstance(m.content, str)
              else "".join(part.text for part in m.content)} for m in messages]
    try:
        rendered = api.tokenizer.apply_chat_template(plain, add_generation_prompt=True)
    except Exception as exc:  # a template may reject e.g. an unexpected role order
        raise APIError(400, f"messages could not be rendered with the chat template: {exc}", "messages") from None
    return api.token_ids(rendered)
