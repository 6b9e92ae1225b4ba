"""
The errors the engine raises, as data: the HTTP layer (openai_api.py) maps them to OpenAI's error
body without parsing message text, and the engine never imports the HTTP protocol.

InvalidRequest: bad input (a 400). It carries the field it is about (OpenAI's `param`) and, where
OpenAI has one, the error `code` (e.g. context_length_exceeded). SamplingParams, Engine.add_request
and the configs raise it at the edge where input arrives; nothing deeper in the engine validates.
EngineError: the engine failed a request that was valid (a 500): a step or an add that raised.
"""

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
