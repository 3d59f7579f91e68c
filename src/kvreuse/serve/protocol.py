"""OpenAI request models (strict types: a wrong type is a 400, never a silent coercion), error
bodies, the OpenAI parameters this server does not implement, and the chat template.

Chat template (prefix-stable: appending messages never changes the text of earlier ones, so each
turn of a conversation reuses the cache of the previous turn):

    <|system|>\\n{content}\\n<|user|>\\n{content}\\n<|assistant|>\\n{content}\\n … <|assistant|>\\n
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.exceptions import HTTPException
from starlette.requests import Request as HttpRequest

if TYPE_CHECKING:
    from kvreuse.tokenizer import Tokenizer

# torch.Generator.manual_seed accepts exactly this range (negative seeds are remapped)
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1


class ApiError(Exception):
    """An error answered as {"error": {"message", "type", "param", "code"}}."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (
            status,
            message,
            type,
            param,
            code,
        )

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """The body of every error answer (OpenAI's shape)."""

    error: ErrorDetail


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    include_usage: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # extension (vLLM): 0 or -1 turns it off
    seed: int | None = Field(default=None, ge=SEED_MIN, le=SEED_MAX)
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    cache_salt: str | None = None  # extension (vLLM): isolates tenants in the prefix cache
    ignore_eos: bool = False  # extension (vLLM)
    return_token_ids: bool = False  # extension (vLLM): prompt_token_ids / token_ids in choices
    user: str | None = None


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str] | list[list[int]]


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None


class ChatRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None


# OpenAI parameters this server does not implement, with the values that mean "not used" (a
# client may send those). Anything else is refused by name rather than silently ignored.
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "logprobs": (None, False, 0),
    "top_logprobs": (None, 0),
    "echo": (None, False),
    "best_of": (None, 1),
    "suffix": (None, ""),
    "logit_bias": (None, {}),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "functions": (None, []),
    "function_call": (None, "none"),
    "response_format": (None, {"type": "text"}),
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
}


def _unused(value: Any, allowed: tuple[Any, ...]) -> bool:
    # type-exact: 0 == False in Python, but "logprobs": false and "logprobs": 0 both mean off
    return any(type(value) is type(a) and value == a for a in allowed)


def check_unsupported(body: dict[str, Any]) -> None:
    bad = [k for k, allowed in UNSUPPORTED.items() if k in body and not _unused(body[k], allowed)]
    if bad:
        raise ApiError(
            400,
            f"unsupported parameter(s): {', '.join(bad)}; this server does not implement "
            f"{'it' if len(bad) == 1 else 'them'} (leave them out, or send null)",
            param=bad[0],
            code="unsupported_parameter",
        )


def short(value: Any, limit: int = 40) -> str:
    """A value for an error message, cut when long (a 4,000-digit integer, a huge string)."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}… ({len(text)} characters)"


def parse(model: type[BaseModel], body: Any) -> Any:
    """Validate a JSON body; the first problem becomes a 400 naming its field."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    check_unsupported(body)
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        err = exc.errors()[0]
        param = ".".join(str(x) for x in err["loc"]) or None
        msg = f"{param}: {err['msg']}" if param else err["msg"]
        if (
            err["loc"]
            and err["loc"][0] == "seed"
            and err["type"] in ("less_than_equal", "greater_than_equal")
        ):
            msg = (
                f"seed must be an integer in [{SEED_MIN}, {SEED_MAX}] (a 64-bit generator "
                f"seed), got {short(body.get('seed'))}"
            )
        raise ApiError(400, msg, param=str(err["loc"][0]) if err["loc"] else None) from None


def message_text(msg: ChatMessage, index: int) -> str:
    content = msg.content
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for part in content:
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise ApiError(
                400,
                f"messages[{index}].content: only text parts are supported",
                param=f"messages.{index}.content",
            )
        parts.append(part["text"])
    return "".join(parts)


def render_chat(messages: list[ChatMessage]) -> str:
    """The chat template (see the module docstring); ends with the generation prompt."""
    out = [f"<|{m.role}|>\n{message_text(m, i)}\n" for i, m in enumerate(messages)]
    out.append("<|assistant|>\n")
    return "".join(out)


def prompt_tokens(prompt: Any, tokenizer: Tokenizer) -> list[int]:
    """A completion's `prompt` (already validated by `CompletionRequest`) as token ids: text is
    encoded, a one-item batch unwrapped; a batch of several is a 400."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        if len(prompt) != 1:
            raise ApiError(
                400,
                "batched prompts are not supported; send one prompt per request",
                param="prompt",
            )
        prompt = prompt[0]
    if isinstance(prompt, str):
        return tokenizer.encode(prompt)
    return list(prompt)


async def http_error(http: HttpRequest, exc: HTTPException) -> JSONResponse:
    """The exception handler for Starlette's own HTTP errors (an unknown path, a wrong method),
    as OpenAI's error body; the server and the fleet front both install it."""
    if exc.status_code == 404:
        msg, code = f"no such endpoint: {http.method} {http.url.path}", "not_found"
    elif exc.status_code == 405:
        msg, code = f"{http.method} is not allowed on {http.url.path}", "method_not_allowed"
    else:
        msg, code = str(exc.detail), None
    err = ApiError(exc.status_code, msg, code=code)
    return JSONResponse(err.body(), status_code=exc.status_code, headers=exc.headers)
