"""OpenAI request models (strict types: a wrong type is a 400, never a silent coercion), error
bodies, and the chat template.

Chat template (prefix-stable: appending messages never changes the text of earlier ones, so each
turn of a conversation reuses the cache of the previous turn):

    <|system|>\\n{content}\\n<|user|>\\n{content}\\n<|assistant|>\\n{content}\\n … <|assistant|>\\n
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError


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


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    include_usage: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # extension (vLLM)
    seed: int | None = None
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


def parse(model: type[BaseModel], body: Any) -> Any:
    """Validate a JSON body; the first problem becomes a 400 naming its field."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        err = exc.errors()[0]
        param = str(err["loc"][0]) if err["loc"] else None
        msg = f"{param}: {err['msg']}" if param else err["msg"]
        raise ApiError(400, msg, param=param) from None


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
