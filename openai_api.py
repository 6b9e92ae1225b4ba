"""
The OpenAI protocol of nanoserve: what /v1/completions and /v1/chat/completions answer.

It owns the validation of a parsed request (openai_request.py's schemas) into prompts and
SamplingParams, the chat template's rendering (vLLM's add_generation_prompt, continue_final_message,
chat_template_kwargs), and the builders of response bodies, SSE chunks, logprobs and usage. Input
that the engine validates (prompt ids, context length, sampling ranges) is checked once, by
Engine.add_request in the engine core; its InvalidRequest names the field and its OpenAI code, and
this file only renames the field to the endpoint's (`aliases`). What is checked here is the
protocol's own: the model name, and the fields the engine has no notion of.
It starts no threads, never steps the engine and holds no HTTP connections: serve.py owns those and
hands outputs in here.
"""
import json
import math
import time
import uuid
from typing import AsyncIterator

from pydantic import ValidationError

from engine import PromptLimits, RequestOutput, SamplingParams
from openai_request import APIError, ChatRequest, CompletionRequest, RequestLimits, SamplingRequest, \
    logit_bias, reject_unsupported, structured_field, structured_outputs, validation_error
from sequence import InvalidRequest
from tokenizer import Tokenizer

__all__ = ["APIError", "ChatExchange", "ChatRequest", "CompletionExchange", "CompletionRequest", "Exchange",
           "OpenAIProtocol", "RequestLimits"]

MAX_N = 16  # choices per prompt; more would let one request crowd out the batch


# ----------------------------------------------------------------------------- errors

def invalid(exc: InvalidRequest, aliases: dict[str, str]) -> APIError:
    """The engine's error as a 400 naming the field as this endpoint calls it."""
    return APIError(400, str(exc), aliases.get(exc.field, exc.field), code=exc.code)


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

    def token_ids(self, prompt: str | list[int], req: SamplingRequest, add_special_tokens: bool) -> list[int]:
        """A prompt's ids, cut to its last truncate_prompt_tokens (-1: the context length) if asked."""
        ids = self.tokenizer.encode(prompt, add_special_tokens) if isinstance(prompt, str) else list(prompt)
        keep = req.truncate_prompt_tokens
        if keep is not None:
            keep = self.max_model_len if keep == -1 else keep
            ids = ids[-keep:]
        return ids

    def sampling_params(self, req: SamplingRequest, max_tokens: int, logprobs: int | None,
                        prompt_logprobs: int | None = None) -> SamplingParams:
        """The request's SamplingParams; their ranges are the engine's to check (at add)."""
        if req.n is not None and req.n > MAX_N:
            raise APIError(400, f"n must be between 1 and {MAX_N}, got {req.n}", "n")
        if req.seed is not None and not 0 <= req.seed < 2**32:  # the engine overflows on huge seeds
            raise APIError(400, f"seed must be an integer in [0, 2**32), got {req.seed}", "seed")
        names = ("n", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids",
                 "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens", "allowed_token_ids",
                 "include_stop_str_in_output", "skip_special_tokens", "spaces_between_special_tokens")
        given = {name: getattr(req, name) for name in names if getattr(req, name) is not None}
        try:
            params = SamplingParams(max_tokens=max_tokens, ignore_eos=req.ignore_eos, logprobs=logprobs,
                                    prompt_logprobs=prompt_logprobs, logit_bias=logit_bias(req),
                                    structured_outputs=structured_outputs(req), bad_words=req.bad_words or None,
                                    **given)
        except TypeError as exc:    # StructuredOutputsParams(**body) with a wrong shape
            field = structured_field(req)
            raise APIError(400, f"{field}: {exc}", field) from None
        if req.priority and self.scheduling_policy != "priority":
            raise APIError(400, "priority needs --scheduling-policy priority", "priority")
        return params

    def token_text(self, token_id: int, as_id: bool = False) -> str:
        """A token's text, or with as_id (return_tokens_as_token_ids) "token_id:{id}", which any text survives."""
        if as_id:
            return f"token_id:{token_id}"
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
                 logprobs: int | None, aliases: dict[str, str], echoes: list[str], echo_logprobs: int | None = None):
        if req.best_of is not None and req.best_of != (req.n or 1):
            raise APIError(400, "best_of is not supported (must equal n)", "best_of")
        aliases = {**aliases, "structured_outputs": structured_field(req)}
        self.api, self.req, self.prompts, self.aliases, self.echoes = api, req, prompts, aliases, echoes
        # the prompt's logprobs ride on its prefill: for echo (legacy logprobs) and prompt_logprobs alike
        wanted = [k for k in (echo_logprobs, req.prompt_logprobs) if k is not None]
        self.params = api.sampling_params(req, max_tokens, logprobs, max(wanted) if wanted else None)
        self.check_as_the_engine_will()
        self.request_id = f"{self.prefix}-{uuid.uuid4().hex}"      # the engine's: unique whatever the client sends
        response_id = f"{self.prefix}-{req.request_id}" if req.request_id else self.request_id
        self.head = {"id": response_id, "object": self.object_name, "created": int(time.time()),
                     "model": api.model_name}
        self.cursors: dict[int, ChoiceCursor] = {}
        self.as_ids, self.with_ids = bool(req.return_tokens_as_token_ids), bool(req.return_token_ids)

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
        """The streamed answer as SSE lines; an error mid-stream becomes an error event before [DONE].
        With stream_options.continuous_usage_stats every chunk carries its choice's usage so far, as
        vLLM sends it: its prompt's tokens and the tokens that choice has generated."""
        options, outs = self.req.stream_options, [None] * len(self.prompts)
        include_usage = options is not None and options.include_usage
        continuous = include_usage and options.continuous_usage_stats
        try:
            for j, choice in enumerate(self.opening()):
                ids = {"prompt_token_ids": self.prompts[0]} if self.with_ids and j == 0 else {}
                yield sse({**self.head, "choices": [choice], **ids, **(self.usage_so_far(0, 0) if continuous else {})})
            async for index, out in outputs:
                outs[index] = out
                for c in out.outputs:
                    choice = self.chunk(index, c, out)
                    if choice is not None:
                        extra = self.usage_so_far(index, len(c.token_ids)) if continuous else {}
                        yield sse({**self.head, "choices": [choice], **extra})
            if include_usage:
                yield sse({**self.head, "choices": [], "usage": usage(self.prompts, outs)})
        except APIError as exc:
            yield sse(exc.body())
        yield "data: [DONE]\n\n"

    def usage_so_far(self, index: int, completion_tokens: int) -> dict:
        prompt_tokens = len(self.prompts[index])
        return {"usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                          "total_tokens": prompt_tokens + completion_tokens}}

    def chunk(self, index: int, c, out: RequestOutput) -> dict | None:
        """The streamed choice for what is new in c since its last chunk, or None if nothing is."""
        choice_index = index * self.params.n + c.index
        cursor = self.cursors.setdefault(choice_index, ChoiceCursor(self.echoes[index], out))
        if not cursor.has_news(c, self.params.logprobs is not None or self.with_ids):
            return None
        choice = {"index": choice_index, **self.delta(c, cursor)}
        if self.with_ids:     # vLLM's return_token_ids: this chunk's tokens
            choice["token_ids"] = c.token_ids[cursor.num_tokens:]
        cursor.num_tokens, cursor.finished, cursor.echo = len(c.token_ids), c.finish_reason is not None, ""
        return choice

    def prompt_logprobs(self, out: RequestOutput) -> list | None:
        """vLLM's prompt_logprobs: per prompt token (the first has none) its top prompt_logprobs entries
        and itself, as {id: {logprob, rank, decoded_token}}. A rank is known within the entries the
        engine kept (the top max(prompt_logprobs, echo's logprobs)); the token's own outside them is null."""
        k = self.req.prompt_logprobs
        if k is None:
            return None
        entries = []
        for token_id, logprobs in zip(out.prompt_token_ids, out.prompt_logprobs):
            if logprobs is None:
                entries.append(None)
                continue
            ranked = top_entries(logprobs, len(logprobs))
            top_n = self.params.prompt_logprobs
            rank = {t: r + 1 for r, (t, _) in enumerate(ranked[:top_n])}
            keep = [t for t, _ in ranked[:k]] + ([] if token_id in dict(ranked[:k]) else [token_id])
            entries.append({str(t): {"logprob": finite(logprobs[t]), "rank": rank.get(t),
                                     "decoded_token": self.api.token_text(t, self.as_ids)} for t in keep})
        return entries

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
        texts = normalize_prompts(req.prompt)
        add_special = req.add_special_tokens is not False          # vLLM's completions default: true
        prompts = [api.token_ids(p, req, add_special) for p in texts]
        max_tokens = 16 if req.max_tokens is None else req.max_tokens   # OpenAI's legacy default
        echoes = [api.tokenizer.decode(ids) if req.echo else "" for ids in prompts]
        # echo with logprobs: the prompt's logprobs, computed during its prefill
        super().__init__(api, req, prompts, max_tokens, req.logprobs, {}, echoes, req.logprobs if req.echo else None)

    def message(self, c, echo: str, out: RequestOutput) -> dict:
        top_n = self.params.logprobs
        logprobs = None
        if top_n is not None:
            logprobs = self.logprobs(c, 0, len(c.token_ids), len(echo), top_n)[0]
            if echo:
                logprobs = join_logprobs(self.echo_logprobs(out, top_n), logprobs)
        choice = {"text": echo + c.text, "logprobs": logprobs, "finish_reason": c.finish_reason}
        if self.req.prompt_logprobs is not None:
            choice["prompt_logprobs"] = self.prompt_logprobs(out)
        if self.with_ids:
            choice.update(prompt_token_ids=out.prompt_token_ids, token_ids=c.token_ids)
        return choice

    def delta(self, c, cursor: ChoiceCursor) -> dict:
        top_n, logprobs = self.params.logprobs, None
        if top_n is not None:
            logprobs, cursor.text_offset = self.logprobs(c, cursor.num_tokens, len(c.token_ids),
                                                         cursor.text_offset, top_n)
            if cursor.echo:
                logprobs = join_logprobs(self.echo_logprobs(cursor.prompt_output, top_n), logprobs)
        first = {"prompt_token_ids": cursor.prompt_output.prompt_token_ids} \
            if self.with_ids and cursor.num_tokens == 0 and cursor.prompt_output is not None else {}
        return {"text": cursor.echo + c.delta_text, "logprobs": logprobs, "finish_reason": c.finish_reason, **first}

    def echo_logprobs(self, out: RequestOutput, top_n: int) -> dict:
        """The echoed prompt's part of legacy logprobs; the first token has none (null), as in OpenAI."""
        tokens, token_logprobs, top, offsets, text_offset = [], [], [], [], 0
        for token_id, logprobs in zip(out.prompt_token_ids, out.prompt_logprobs):
            text = self.api.token_text(token_id)
            tokens.append(self.api.token_text(token_id, self.as_ids))
            token_logprobs.append(None if logprobs is None else finite(logprobs[token_id]))
            top.append(None if logprobs is None else
                       {self.api.token_text(t, self.as_ids): finite(v) for t, v in top_entries(logprobs, top_n)})
            offsets.append(text_offset)
            text_offset += len(text)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}

    def logprobs(self, c, start: int, end: int, text_offset: int, top_n: int) -> tuple[dict, int]:
        """OpenAI's legacy logprobs for tokens [start, end) of choice c, and the text offset after them."""
        tokens, token_logprobs, top, offsets = [], [], [], []
        for token_id, logprobs in zip(c.token_ids[start:end], c.logprobs[start:end]):
            text = self.api.token_text(token_id)
            tokens.append(self.api.token_text(token_id, self.as_ids))
            token_logprobs.append(finite(logprobs[token_id]))
            top.append({self.api.token_text(t, self.as_ids): finite(v) for t, v in top_entries(logprobs, top_n)})
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
        if req.top_logprobs and not req.logprobs:     # 0 asks for nothing (vLLM accepts it)
            raise APIError(400, "top_logprobs requires logprobs=true", "top_logprobs")
        self.object_name = "chat.completion.chunk" if req.stream else "chat.completion"
        prompt = api.token_ids(render_chat(api, req), req, bool(req.add_special_tokens))
        max_field = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        if max_tokens is None:   # OpenAI: up to the context length; capped at what the KV pool holds, as vLLM does
            fits = api.limits.usable_blocks * api.limits.block_size
            max_tokens = max(1, min(api.max_model_len, fits) - len(prompt))
        aliases = {"prompt": "messages", "logprobs": "top_logprobs", "max_tokens": max_field}
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        super().__init__(api, req, [prompt], max_tokens, logprobs, aliases, [chat_echo(req)])

    def body(self, outs: list[RequestOutput]) -> dict:
        body = super().body(outs)
        if self.req.prompt_logprobs is not None:    # vLLM puts a chat's beside its choices
            body["prompt_logprobs"] = self.prompt_logprobs(outs[0])
        if self.with_ids:
            body["prompt_token_ids"] = self.prompts[0]
        return body

    def opening(self) -> list[dict]:  # OpenAI opens every choice with the role alone
        return [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
                for i in range(self.params.n)]

    def message(self, c, echo: str, out: RequestOutput) -> dict:
        choice = {"message": {"role": "assistant", "content": echo + c.text},
                  "logprobs": self.logprobs(c, 0), "finish_reason": c.finish_reason}
        return {**choice, "token_ids": c.token_ids} if self.with_ids else choice

    def delta(self, c, cursor: ChoiceCursor) -> dict:
        text = cursor.echo + c.delta_text
        delta = {"content": text} if text or c.finish_reason is None else {}
        return {"delta": delta, "logprobs": self.logprobs(c, cursor.num_tokens), "finish_reason": c.finish_reason}

    def logprobs(self, c, start: int) -> dict | None:
        """OpenAI's chat logprobs for the tokens of choice c from start on; None unless asked for."""
        top_n = self.params.logprobs
        if top_n is None:
            return None

        def entry(token_id, logprob):  # bytes are exact even where a token holds half a UTF-8 character
            return {"token": self.api.token_text(token_id, self.as_ids), "logprob": finite(logprob),
                    "bytes": list(self.api.tokenizer.token_bytes(token_id))}
        return {"content": [{**entry(t, lps[t]), "top_logprobs": [entry(k, v) for k, v in top_entries(lps, top_n)]}
                            for t, lps in zip(c.token_ids[start:], c.logprobs[start:])]}


# ----------------------------------------------------------------------------- the chat template

def message_text(message) -> str:
    return message.content if isinstance(message.content, str) else "".join(p.text for p in message.content)


def chat_echo(req: ChatRequest) -> str:
    """vLLM's echo for chat: the last message's text goes in front of the answer when it is the role
    that answers (the assistant, or with add_generation_prompt off, whoever spoke last)."""
    answering = "assistant" if generation_prompt(req) else req.messages[-1].role
    return message_text(req.messages[-1]) if req.echo and req.messages[-1].role == answering else ""


def generation_prompt(req: ChatRequest) -> bool:
    """add_generation_prompt, default true, but off when continuing the final message."""
    return req.add_generation_prompt if req.add_generation_prompt is not None else not req.continue_final_message


TEMPLATE_NAMES = ("messages", "add_generation_prompt", "chat_template", "bos_token", "eos_token", "documents")


def render_chat(api: OpenAIProtocol, req: ChatRequest) -> str:
    """The prompt text: the chat template (the model's, or the request's chat_template) over the
    messages, with chat_template_kwargs and documents. continue_final_message leaves the last message
    open, as transformers does: the text ends where that message's content ends."""
    plain = [{"role": m.role, "content": message_text(m)} for m in req.messages]
    kwargs = dict(req.chat_template_kwargs or {})
    clash = sorted(set(kwargs) & set(TEMPLATE_NAMES))
    if clash:
        raise APIError(400, f"chat_template_kwargs may not set {clash}; use the request's own fields",
                       "chat_template_kwargs")
    if req.documents is not None:
        kwargs["documents"] = req.documents
    try:
        rendered = api.tokenizer.apply_chat_template(plain, add_generation_prompt=generation_prompt(req),
                                                     chat_template=req.chat_template, **kwargs)
    except Exception as exc:  # a template may reject e.g. an unexpected role order
        field = "chat_template" if req.chat_template else "messages"
        raise APIError(400, f"messages could not be rendered with the chat template: {exc}", field) from None
    if req.continue_final_message:
        last = plain[-1]["content"]
        at = rendered.rfind(last) if last else -1
        if at == -1 and last.strip():   # a template that strips the content
            last = last.strip()
            at = rendered.rfind(last)
        if at == -1:
            raise APIError(400, "continue_final_message: the final message does not appear in the rendered chat",
                           "continue_final_message")
        rendered = rendered[:at + len(last)]
    return rendered
