"""
What a request to /v1/completions and /v1/chat/completions may contain, and how it is refused.

It owns OpenAI's error body (APIError, whose `param` names the offending field), the request
schemas with every field OpenAI's and vLLM's clients send, each either honoured, accepted with no
effect (bookkeeping that means nothing here, like `user` or `metadata`) or refused with a 400 naming
it where the client would expect a behaviour this server lacks (docs/request-fields.md lists every
field and which it is; a test sends each one), the translation of the structured-output spellings
(response_format, structured_outputs, vLLM's guided_*) and the per-request size limits.
Unknown fields are refused too (`unsupported_field`): nothing a client sends is silently dropped.
It never tokenizes and never sees the engine: openai_api.py turns a parsed request into work.
"""
import json
from dataclasses import dataclass
from typing import Any, Literal, Union

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict

from sampler import StructuredOutputsParams
from sequence import quoted

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


def refuse(field: str, why: str) -> APIError:
    return APIError(400, f"{field}: {why}", field, code="unsupported_value")


# ----------------------------------------------------------------------------- request schemas

class Strict(BaseModel):
    # Unknown fields are rejected, never silently ignored; "5" is not an int.
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(Strict):
    include_usage: bool = True               # vLLM's default once stream_options is given
    continuous_usage_stats: bool = False     # vLLM's: usage in every chunk too
    include_obfuscation: bool | None = None  # OpenAI's padding against length side channels: no effect here


class SamplingRequest(Strict):
    """Fields shared by completions and chat; None means "use the default"."""
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    n: int | None = None
    best_of: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    echo: bool = False
    ignore_eos: bool = False
    priority: int = 0
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    logit_bias: dict[str, float] | None = None
    response_format: dict | None = None      # {"type": "text" | "json_object" | "json_schema", ...}
    structured_outputs: dict | None = None   # vLLM's: {"json" | "regex" | "choice" | "grammar" | "json_object": ...}
    guided_json: str | dict | None = None    # vLLM's older spellings of structured_outputs
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None    # one backend here (llguidance): same constraint, no effect
    guided_whitespace_pattern: str | None = None  # refused
    cache_salt: str | None = None            # prefix-cache blocks are shared only within one salt
    user: str | None = None                  # the caller's end-user id for its own bookkeeping
    request_id: str | None = None            # the response's id ends with it
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: int | None = None
    prompt_logprobs: int | None = None
    return_tokens_as_token_ids: bool | None = None
    return_token_ids: bool | None = None     # prompt_token_ids and token_ids beside the text
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    add_special_tokens: bool | None = None   # default: true for completions, false for chat (vLLM's)
    use_beam_search: bool = False            # refused when true
    length_penalty: float | None = None      # beam search's only: no effect
    logits_processors: list | None = None    # refused: code named by the client
    kv_transfer_params: dict | None = None   # refused: vLLM's disaggregation connector protocol
    vllm_xargs: dict | None = None           # refused: no custom extension reads them
    repetition_detection: dict | None = None  # refused: no n-gram repetition stop


class CompletionRequest(SamplingRequest):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    logprobs: int | None = None
    suffix: str | None = None
    prompt_embeds: Any = None                # refused


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
    add_generation_prompt: bool | None = None     # default true; false with continue_final_message
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[dict[str, str]] | None = None
    mm_processor_kwargs: dict | None = None  # text-only models: no effect
    media_io_kwargs: dict | None = None      # no media to load: no effect
    structural_tag: str | None = None        # refused
    tools: list | None = None                # refused unless empty
    tool_choice: Any = None                  # refused unless "none"
    parallel_tool_calls: bool | None = None  # without tools: no effect
    functions: list | None = None            # OpenAI's older tools: refused
    function_call: Any = None                # refused
    reasoning_effort: str | None = None      # refused: no reasoning model here
    include_reasoning: bool = True           # no reasoning parser, so no reasoning_content: no effect
    store: bool | None = None                # OpenAI's bookkeeping: no effect
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    prediction: dict | None = None           # predicted outputs only change latency: no effect
    modalities: list[str] | None = None      # refused unless ["text"]
    audio: dict | None = None                # refused
    web_search_options: dict | None = None   # refused
    verbosity: str | None = None             # refused


def reject_unsupported(req: SamplingRequest) -> None:
    """Fields that ask for something this server cannot do, refused with a 400 naming them. (Fields
    no schema knows are refused by it; suffix and best_of by CompletionExchange.)"""
    if req.stream_options is not None and not req.stream:
        raise APIError(400, "stream_options is only allowed with stream=true", "stream_options")
    if req.prompt_logprobs is not None and req.stream:
        raise APIError(400, "prompt_logprobs are not available with stream=true", "prompt_logprobs")
    if req.truncate_prompt_tokens is not None and not (req.truncate_prompt_tokens >= 1
                                                       or req.truncate_prompt_tokens == -1):
        raise APIError(400, f"truncate_prompt_tokens must be >= 1 (or -1: the context length), got "
                            f"{req.truncate_prompt_tokens}", "truncate_prompt_tokens")
    wants = [  # (field, asks for what we lack, why)
        ("use_beam_search", req.use_beam_search, "beam search is not implemented; sample with n instead"),
        ("logits_processors", req.logits_processors, "this server runs no code named by a request"),
        ("kv_transfer_params", req.kv_transfer_params is not None,
         "vLLM's KV-transfer connectors are not spoken here (serve.py --disaggregation moves KV itself)"),
        ("vllm_xargs", req.vllm_xargs, "no custom extension is installed to read them"),
        ("repetition_detection", req.repetition_detection is not None,
         "repetition detection is not implemented; stop, stop_token_ids and max_tokens end a sequence"),
        ("guided_whitespace_pattern", req.guided_whitespace_pattern is not None,
         "the grammar engine takes no whitespace pattern; structured_outputs.disable_any_whitespace is the knob"),
        ("prompt_embeds", getattr(req, "prompt_embeds", None) is not None, "prompts are text or token ids here"),
    ]
    if isinstance(req, ChatRequest):
        wants += [
            ("tools", req.tools, "the served model has no tool-call format and no parser"),
            ("tool_choice", req.tool_choice not in (None, "none"), "tools are not supported (only \"none\")"),
            ("functions", req.functions, "the served model has no tool-call format and no parser"),
            ("function_call", req.function_call not in (None, "none"), "functions are not supported"),
            ("reasoning_effort", req.reasoning_effort is not None, "the served model has no reasoning mode"),
            ("structural_tag", req.structural_tag is not None, "structural tags are not supported"),
            ("modalities", req.modalities not in (None, ["text"]), "this server writes text only"),
            ("audio", req.audio is not None, "this server writes text only"),
            ("web_search_options", req.web_search_options is not None, "this server has no web search"),
            ("verbosity", req.verbosity is not None, "the served model takes no verbosity setting"),
        ]
        if req.continue_final_message and req.add_generation_prompt:
            raise APIError(400, "continue_final_message and add_generation_prompt cannot both be true",
                           "continue_final_message")
    for field, asks, why in wants:
        if asks:
            raise refuse(field, why)
    spellings = [name for name in ("response_format", "structured_outputs", *GUIDED)
                 if getattr(req, name) is not None]
    if len(spellings) > 1:
        raise APIError(400, f"give one of {spellings}, not several", spellings[-1])


GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def structured_outputs(req: SamplingRequest) -> StructuredOutputsParams | None:
    """OpenAI's response_format, vLLM's structured_outputs or its guided_* as the engine's
    StructuredOutputsParams. Whether the schema compiles is checked by SamplingParams.validate."""
    for name, kind in GUIDED.items():
        if getattr(req, name) is not None:
            return StructuredOutputsParams(**{kind: getattr(req, name)})
    if req.structured_outputs is not None:
        kinds = ("json", "regex", "choice", "grammar", "json_object", "disable_any_whitespace")
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


def structured_field(req: SamplingRequest) -> str:
    """The field the request spelled its structured output with (errors name it)."""
    return next((name for name in (*GUIDED, "structured_outputs") if getattr(req, name) is not None),
                "response_format")


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
    max_stop: int = 64                  # stop strings (and bad_words): each is searched for after every token
    max_stop_chars: int = 256           # characters of one stop string (also what a stream holds back)
    max_stop_token_ids: int = 256
    max_grammar_bytes: int = 64 << 10   # a JSON schema, regex, grammar or choice list, as JSON text
    # a request's own chat_template runs in the jinja sandbox, but its loops cost what they like (vLLM's flag)
    trust_request_chat_template: bool = False

    def check(self, req: SamplingRequest, num_prompts: int) -> None:
        def need(ok, field, message):
            if not ok:
                raise APIError(400, message, field, code="limit_exceeded")
        n = req.n or 1
        need(num_prompts * n <= self.max_seqs_per_request, "n" if n > 1 else "prompt",
             f"{num_prompts} prompts x n={n} = {num_prompts * n} sequences; at most {self.max_seqs_per_request} "
             f"per request (--max-seqs-per-request)")
        need(len(req.logit_bias or ()) <= self.max_logit_bias, "logit_bias",
             f"logit_bias has {len(req.logit_bias or ())} entries; at most {self.max_logit_bias} (--max-logit-bias)")
        for field in ("stop", "bad_words"):
            words = [getattr(req, field)] if isinstance(getattr(req, field), str) else getattr(req, field) or []
            need(len(words) <= self.max_stop, field, f"{field} has {len(words)} strings; at most {self.max_stop} "
                                                     f"(--max-stop-strings)")
            long = next((s for s in words if len(s) > self.max_stop_chars), None)
            need(long is None, field, f"a {field} string has {len(long or '')} characters; at most "
                                      f"{self.max_stop_chars} (--max-stop-chars): {quoted(long)}")
        need(len(req.stop_token_ids or ()) <= self.max_stop_token_ids, "stop_token_ids",
             f"stop_token_ids has {len(req.stop_token_ids or ())} ids; at most {self.max_stop_token_ids} "
             f"(--max-stop-token-ids)")
        if getattr(req, "chat_template", None) is not None and not self.trust_request_chat_template:
            raise refuse("chat_template", "this server renders only the model's chat template; start it with "
                                          "--trust-request-chat-template to allow a request's own")
        field = structured_field(req)
        spec = getattr(req, field)
        size = 0 if spec is None else len(json.dumps(spec))
        need(size <= self.max_grammar_bytes, field, f"{field} is {size} bytes as JSON; at most "
                                                    f"{self.max_grammar_bytes} (--max-grammar-bytes)")
