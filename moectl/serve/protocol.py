"""The OpenAI request bodies `moectl serve` accepts, its error bodies, and stop-string matching.

Unknown fields are ignored (clients send many); known ones are type-checked and a wrong one is a 400
with the OpenAI error body `{"error": {"message", "type", "param", "code"}}`.
"""

from __future__ import annotations

from typing import Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, field_validator


class ApiError(Exception):
    """An OpenAI-style error answer: HTTP status, message, type, offending parameter, code."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: StrictStr


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[StrictStr, list[TextPart], None] = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: StrictBool = False


class Sampling(BaseModel):
    """Fields both endpoints share. temperature 0 is greedy decoding."""
    model_config = ConfigDict(extra="ignore")
    model: StrictStr
    max_tokens: Optional[StrictInt] = Field(None, ge=1)
    temperature: StrictFloat = Field(1.0, ge=0.0, le=2.0)       # a JSON integer is a number too (bools are not)
    top_p: StrictFloat = Field(1.0, gt=0.0, le=1.0)
    seed: Optional[StrictInt] = Field(None, ge=-(2**63), lt=2**64)          # int64 or uint64: mod 2**64
    stop: Union[StrictStr, list[StrictStr], None] = Field(None, validate_default=True)   # -> list[str]
    stream: StrictBool = False
    stream_options: Optional[StreamOptions] = None
    n: StrictInt = Field(1, ge=1, le=1)          # batch-1 runtime: one choice per request
    ignore_eos: StrictBool = False               # vLLM's extension: generate max_tokens even past EOS

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > 4 or any(s == "" for s in stops):
            raise ValueError("stop takes at most 4 non-empty strings")
        return stops

    def token_limit(self) -> int | None:
        return self.max_tokens


class ChatRequest(Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: Optional[StrictInt] = Field(None, ge=1)

    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(Sampling):
    prompt: Union[StrictStr, list[StrictInt], list[StrictStr]]
    max_tokens: Optional[StrictInt] = Field(16, ge=1)            # the OpenAI default for completions

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v):
        if isinstance(v, list) and v and isinstance(v[0], str):
            if len(v) != 1:
                raise ValueError("one prompt per request (the runtime is batch-1)")
            return v[0]
        if isinstance(v, list) and not v:
            raise ValueError("the prompt is empty")
        return v


# the names pydantic gives the members of a union field in an error's location, as a reader says them
UNION_MEMBERS = {"str": "a string", "int": "an integer", "float": "a number", "bool": "true or false",
                 "list[str]": "a list of strings", "list[int]": "a list of token ids (integers)",
                 "list[TextPart]": "a list of text parts"}


def validation_error(errors: list[dict]) -> ApiError:
    """A pydantic/FastAPI validation failure as a 400, naming the first bad parameter. A field that takes one of
    several types (`stop`: a string or a list of strings) is one message listing them, not its first member's
    error ("stop.str: Input should be a valid string")."""
    first = errors[0] if errors else {}
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    if first.get("type") == "json_invalid":
        return ApiError(400, f"the request body is not valid JSON: {first.get('ctx', {}).get('error', '')}".rstrip(": "),
                        code="invalid_json")
    param = loc[0] if loc else None
    msg = first.get("msg", "invalid request")
    got = repr(first.get("input"))
    got = got if len(got) <= 40 else got[:37] + "..."
    tag = next((i for i, p in enumerate(loc) if p in UNION_MEMBERS), None)
    if tag is not None:
        path = loc[:tag]
        kinds = [UNION_MEMBERS[e_loc[tag]] for e in errors
                 if len(e_loc := [str(p) for p in e.get("loc", ()) if p != "body"]) > tag and e_loc[:tag] == path
                 and e_loc[tag] in UNION_MEMBERS]
        msg, loc = f"should be {' or '.join(dict.fromkeys(kinds))}, not {got}", path
    elif str(first.get("type", "")).endswith(("_type", "_parsing")):       # a value of the wrong type: say which
        msg = f"{msg}, not {got}"
    return ApiError(400, f"{'.'.join(loc)}: {msg}" if loc else msg, param=param, code="invalid_value")


class StopMatcher:
    """Cuts streamed text at the first stop string, holding back a tail that could still start one."""

    def __init__(self, stops: list[str]):
        self.stops, self.pending, self.stopped = stops, "", False

    def feed(self, piece: str) -> str:
        """Text safe to send now (empty once stopped)."""
        if self.stopped:
            return ""
        text = self.pending + piece
        cuts = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if cuts:
            self.stopped, self.pending = True, ""
            return text[:min(cuts)]
        hold = max((k for s in self.stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
        self.pending = text[len(text) - hold:] if hold else ""
        return text[:len(text) - hold]

    def flush(self) -> str:
        out, self.pending = ("" if self.stopped else self.pending), ""
        return out
