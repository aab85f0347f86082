"""An OpenAI-compatible HTTP endpoint on the trusted device, so existing clients and tools use splitllm.

It runs the client side of the split (tokenizer, embedding, head and tail layers, LM head); the
remote server still receives only hidden states. One generation runs at a time: the device's cores
are the bottleneck, so requests queue on a lock. Beyond OpenAI's fields a request may set `top_k`,
`repetition_penalty` and `decode` (the decoding mode); every response carries `splitllm`, the
generation's step statistics (streamed: each chunk carries its step's, the last one the summary).
A request that continues a conversation an earlier request left (the whole history re-sent, as chat
clients do) goes on in that conversation's server session and caches and reads only its new tokens
(`client.conversations`).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from importlib import resources
from typing import Any, Literal

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, StreamingResponse
from fastapi.staticfiles import StaticFiles
from pydantic import BaseModel, ConfigDict, Field, model_validator

from splitllm.client.connection import CLIENT_ERRORS
from splitllm.client.conversations import ConversationCache, ReuseLimits
from splitllm.client.session import Generation, SplitClient
from splitllm.decoding.modes import DECODERS, DEFAULT_DECODE, check_mode
from splitllm.decoding.sampling import SamplingParams
from splitllm.threads import ComputeThread

DEFAULT_MAX_TOKENS = 256


class _Strict(BaseModel):
    """A request part whose every field is honoured or refused: an unknown field is a 400 naming it. A
    field sent as null is a field not sent, as OpenAI reads it (clients and tools send some that way)."""

    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _null_is_absent(cls, data: Any) -> Any:
        return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data


class _TextFormat(_Strict):
    """`response_format`: plain text only. JSON modes need constrained decoding this endpoint does not
    have, and free text where JSON was asked for would break the caller later: refused instead."""

    type: Literal["text"]


class _Request(_Strict):
    """Fields shared by both completion kinds. A field the endpoint cannot honour (an unknown one,
    `tools`, a JSON `response_format`, a penalty other than 0) is a 400 naming it, never dropped."""

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0)
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_k: int = Field(default=0, ge=0)
    repetition_penalty: float = Field(default=1.0, gt=0)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    n: Literal[1] = 1
    logprobs: Literal[False] | None = None  # asked for, they would be silently missing: refused instead
    presence_penalty: Literal[0] | None = None  # OpenAI's penalties are not implemented: only their no-op value
    frequency_penalty: Literal[0] | None = None
    response_format: _TextFormat | None = None
    user: str | None = None  # an end-user id for the provider's abuse monitoring: changes no output
    decode: str | None = None

    def sampling(self) -> SamplingParams:
        """OpenAI's convention: temperature 0 is greedy."""
        return SamplingParams(
            do_sample=self.temperature > 0,
            temperature=self.temperature or 1.0,
            top_k=self.top_k,
            top_p=self.top_p,
            repetition_penalty=self.repetition_penalty,
            seed=self.seed,
        )

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def new_tokens(self) -> int:
        return self.max_tokens or DEFAULT_MAX_TOKENS


class _Message(_Strict):  # `name`, `tool_calls`, ...: refused, not dropped

    role: Literal["system", "developer", "user", "assistant"]  # no tools; "developer" is OpenAI's newer "system"
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.get("text", "") for part in self.content if part.get("type") == "text")
        return self.content or ""


class ChatRequest(_Request):
    messages: list[_Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)

    def new_tokens(self) -> int:
        return self.max_completion_tokens or super().new_tokens()


class CompletionRequest(_Request):
    prompt: str | list[int]


class _APIError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": None, "code": None}}


def _error(exc: BaseException) -> _APIError:
    """What a failure looks like to an OpenAI client: its fault (400) or the split server's (502)."""
    if isinstance(exc, _APIError):
        return exc
    if isinstance(exc, ValueError):
        return _APIError(400, str(exc))
    return _APIError(502, f"split server: {exc}", "upstream_error")


def _extension(gen: Generation, decode: str, reused: int) -> dict[str, Any]:
    """splitllm's statistics of a generation; `reused_prompt_tokens`: prompt tokens an earlier request of
    the same conversation had already read (`prompt_tokens` counts only the rest)."""
    summary = gen.summary()
    return {"decode": decode, "reused_prompt_tokens": reused, **{k: v for k, v in summary.items() if k not in ("text", "ids")}}


def _usage(prompt: list[int], gen: Generation) -> dict[str, int]:
    return {"prompt_tokens": len(prompt), "completion_tokens": len(gen.ids), "total_tokens": len(prompt) + len(gen.ids)}


def _sse(payload: dict[str, Any] | str) -> bytes:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n".encode()


class OpenAIEndpoint:
    """The routes' logic over one SplitClient; `create_app` wires it into FastAPI."""

    def __init__(
        self, client: SplitClient, model_name: str, decode: str, compute: ComputeThread, reuse: ReuseLimits
    ) -> None:
        self.client, self.model_name, self.decode = client, model_name, check_mode(decode)
        self.compute = compute
        self.conversations = ConversationCache(client, reuse)  # used on the compute thread, under the lock
        self.created = int(time.time())
        self.lock = asyncio.Lock()

    def models(self) -> dict[str, Any]:
        return {
            "object": "list",
            "data": [{"id": self.model_name, "object": "model", "created": self.created, "owned_by": "splitllm"}],
        }

    def _start(self, prompt: list[int], req: _Request) -> tuple[str, Iterator[tuple[Generation, Any, int]]]:
        """Validate a request up front (so errors come back as 400s before any streaming starts); the
        generation continues the kept conversation the prompt extends, if any."""
        try:
            decode = check_mode(req.decode or self.decode)
            sampling = req.sampling()
        except ValueError as exc:
            raise _APIError(400, str(exc)) from None
        return decode, self.conversations.stream(prompt, req.new_tokens(), decode, sampling, req.stops())

    def chat_prompt(self, req: ChatRequest) -> list[int]:
        tok = self.client.tokenizer
        if not tok.chat_template:
            raise _APIError(400, "this model has no chat template; use /v1/completions")
        messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in req.messages]
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return tok(text, add_special_tokens=False)["input_ids"]

    def text_prompt(self, req: CompletionRequest) -> list[int]:
        return req.prompt if isinstance(req.prompt, list) else self.client.encode_prompt(req.prompt, chat=False)

    async def complete(self, prompt: list[int], req: _Request, chat: bool) -> dict[str, Any]:
        decode, steps = self._start(prompt, req)
        async with self.lock:
            gen, reused = await self.compute.run_async(_last, steps)
        reply = self._head(chat, False)
        if chat:
            message = {"role": "assistant", "content": gen.text}
            reply["choices"] = [{"index": 0, "message": message, "finish_reason": gen.finish_reason}]
        else:
            reply["choices"] = [{"index": 0, "text": gen.text, "finish_reason": gen.finish_reason, "logprobs": None}]
        return {**reply, "usage": _usage(prompt, gen), "splitllm": _extension(gen, decode, reused)}

    async def stream(self, prompt: list[int], req: _Request, chat: bool) -> AsyncIterator[bytes]:
        decode, steps = self._start(prompt, req)
        head = self._head(chat, True)

        def chunk(delta: str, finish: str | None = None, **extra: Any) -> dict[str, Any]:
            choice = {"index": 0, "delta": {"content": delta}} if chat else {"index": 0, "text": delta, "logprobs": None}
            return {**head, "choices": [{**choice, "finish_reason": finish}], **extra}

        async def events() -> AsyncIterator[bytes]:
            async with self.lock:
                gen, sent, reused = None, "", 0
                try:
                    if chat:
                        yield _sse({**head, "choices": [{"index": 0, "delta": {"role": "assistant"}, "finish_reason": None}]})
                    while (item := await self.compute.run_async(next, steps, None)) is not None:
                        gen, out, reused = item
                        if gen.finish_reason is None:  # every step, so a viewer sees each round trip
                            yield _sse(chunk(gen.text[len(sent) :], splitllm={"step": out.stats.as_dict()}))
                            sent = gen.text
                    assert gen is not None
                    summary = {**_extension(gen, decode, reused), "step": gen.steps[-1].as_dict()}
                    yield _sse(chunk(gen.text[len(sent) :], gen.finish_reason, splitllm=summary))
                    if (req.stream_options or {}).get("include_usage"):
                        yield _sse({**head, "choices": [], "usage": _usage(prompt, gen)})
                    yield _sse("[DONE]")
                except CLIENT_ERRORS as exc:
                    yield _sse(_error(exc).body())
                finally:
                    with anyio.CancelScope(shield=True):  # a disconnected client still frees the server session
                        await self.compute.run_async(steps.close)

        return events()

    def _head(self, chat: bool, chunk: bool) -> dict[str, Any]:
        kind = "chat.completion" if chat else "text_completion"
        return {
            "id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}",
            "object": f"{kind}.chunk" if chunk and chat else kind,
            "created": int(time.time()),
            "model": self.model_name,
        }


def _last(steps: Iterator[tuple[Generation, Any, int]]) -> tuple[Generation, int]:
    gen, reused = None, 0
    for gen, _, reused in steps:
        pass
    if gen is None:
        raise ValueError("the generation produced no step")
    return gen, reused


def create_app(
    client: SplitClient, model_name: str | None = None, decode: str = DEFAULT_DECODE, compute: ComputeThread | None = None,
    reuse: ReuseLimits = ReuseLimits(),
) -> FastAPI:
    """The FastAPI app: /v1/models, /v1/chat/completions, /v1/completions (streaming over SSE), and the
    web chat at / (its files under /static, its settings at /splitllm/info). Every generation runs on
    `compute` (default: a new one), which should be the thread that loaded `client` (see ComputeThread).
    `reuse` bounds the conversations kept open so a follow-up request reads only its new tokens."""
    endpoint = OpenAIEndpoint(client, model_name or client.files.path.name, decode, compute or ComputeThread(), reuse)
    app = FastAPI(title="splitllm", summary="OpenAI-compatible endpoint over a split model")
    app.state.endpoint = endpoint

    @app.exception_handler(_APIError)
    async def api_error(_request: Request, exc: _APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def invalid(_request: Request, exc: RequestValidationError) -> JSONResponse:
        message = "; ".join(f"{'.'.join(map(str, e['loc'][1:]))}: {e['msg']}" for e in exc.errors())
        return JSONResponse(_APIError(400, message).body(), status_code=400)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return endpoint.models()

    app.mount("/static", StaticFiles(packages=[("splitllm.api", "web")]), name="static")

    @app.get("/", response_class=HTMLResponse)
    async def chat_page() -> str:
        """The local web chat: plain HTML, CSS and JS shipped with the package."""
        return resources.files("splitllm.api").joinpath("web/index.html").read_text()

    @app.get("/splitllm/info")
    async def info() -> dict[str, Any]:
        """What the chat page shows and offers: the model, where the middle runs, the decoding modes."""
        return {"model": endpoint.model_name, "server": client.server, "modes": list(DECODERS), "decode": endpoint.decode}

    async def respond(prompt: list[int], req: _Request, chat: bool) -> Any:
        try:
            if req.stream:
                return StreamingResponse(await endpoint.stream(prompt, req, chat), media_type="text/event-stream")
            return await endpoint.complete(prompt, req, chat)
        except CLIENT_ERRORS as exc:
            raise _error(exc) from None

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatRequest) -> Any:
        return await respond(endpoint.chat_prompt(req), req, True)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest) -> Any:
        return await respond(endpoint.text_prompt(req), req, False)

    return app
