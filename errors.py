"""
The one error that bad input raises: InvalidRequest, a ValueError that carries the name of
the field it is about, so the HTTP layer (openai_api.py) can fill OpenAI's `param` without
parsing message text. SamplingParams, Engine.add_request and the configs raise it at the
edge where input arrives; nothing deeper in the engine validates.
"""


class InvalidRequest(ValueError):
    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field

    def __reduce__(self):  # it crosses the pipe from the engine core process to serve.py's front end
        return InvalidRequest, (self.field, str(self))


def need(ok: bool, field: str, allowed: str, value) -> None:
    """Raise InvalidRequest('<field> must be <allowed>, got <value>') unless ok."""
    if not ok:
        raise InvalidRequest(field, f"{field} must be {allowed}, got {value!r}")
