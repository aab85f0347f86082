"""An OpenAI-compatible HTTP endpoint on the trusted device, so existing clients and tools use splitllm.

It runs the client side of the split (tokenizer, embedding, first and last stages, LM head); the
remote server still receives only hidden states. One generation runs at a time: the device's cores
are the bottleneck, so requests queue on a lock. Beyond OpenAI's fields a request may set `top_k`,
`repetition_penalty` and `decode` (the decoding mode); every response carries `splitllm`, the
generation's step statistics (streamed: each chunk carries its step's, the last one the summary).
`response_format` JSON and forced tool calls are decoded under a grammar (decoding/grammar.py);
tools are rendered by the model's chat template and its calls read back (api/tools.py).
A request that continues a conversation an earlier request left (the whole history re-sent, as chat
clients do) goes on in that conversation's server session and caches and reads only its new tokens
(`client.conversations`).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable, Generator, Iterator
from importlib import resources
from dataclasses import replace
from typing import Annotated, Any, Literal, NamedTuple, cast

import anyio
import llguidance
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, StreamingResponse
from fastapi.staticfiles import StaticFiles
from pydantic import BaseModel, ConfigDict, Field, model_validator

from splitllm.client.connection import CLIENT_ERRORS
from splitllm.client.conversations import ConversationCache, ReuseLimits
from splitllm.api.tools import ToolCall, ToolCallReader, call_grammar, takes_tools
from splitllm.client.client import Generation, SplitClient
from splitllm.decoding.grammar import Grammar, grammar_tokenizer
from splitllm.decoding.mode_names import DEFAULT_DECODE
from splitllm.decoding.modes import DECODERS, check_mode
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
    type: Literal["text"]


class _JsonObjectFormat(_Strict):
    type: Literal["json_object"]


class _JsonSchema(_Strict):
    name: str
    definition: dict[str, Any] = Field(default_factory=lambda: {"type": "object"}, alias="schema")
    description: str | None = None
    strict: bool | None = None  # the schema is always enforced: strict or not changes nothing


class _JsonSchemaFormat(_Strict):
    type: Literal["json_schema"]
    json_schema: _JsonSchema


ResponseFormat = Annotated[_TextFormat | _JsonObjectFormat | _JsonSchemaFormat, Field(discriminator="type")]


class _Request(_Strict):
    """Fields shared by both completion kinds. A field the endpoint cannot honour (an unknown one,
    logprobs, a penalty other than 0) is a 400 naming it, never dropped."""

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
    response_format: ResponseFormat | None = None
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


class _FunctionCall(_Strict):
    name: str
    arguments: str  # JSON text

    def template(self) -> dict[str, Any]:
        """The call as chat templates render it: the arguments as an object."""
        try:
            arguments = json.loads(self.arguments)
        except json.JSONDecodeError:
            arguments = None
        if not isinstance(arguments, dict):
            raise _APIError(400, f"messages: the arguments of a call to {self.name!r} are not a JSON object")
        return {"type": "function", "function": {"name": self.name, "arguments": arguments}}


class _Call(_Strict):
    id: str | None = None
    type: Literal["function"] = "function"
    function: _FunctionCall


class _Message(_Strict):  # `name` and other fields: refused, not dropped

    role: Literal["system", "developer", "user", "assistant", "tool"]  # "developer" is OpenAI's newer "system"
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[_Call] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool's answer: the call it answers

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.get("text", "") for part in self.content if part.get("type") == "text")
        return self.content or ""

    def template(self) -> dict[str, Any]:
        """The message as the chat template takes it."""
        message: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": self.text()}
        if self.tool_calls:
            message["tool_calls"] = [c.function.template() for c in self.tool_calls]
        return message


class _Function(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # forced calls always follow `parameters`: strict or not changes nothing


class _Tool(_Strict):
    type: Literal["function"]
    function: _Function


class _Named(_Strict):
    name: str


class _ToolChoice(_Strict):
    type: Literal["function"]
    function: _Named


class ChatRequest(_Request):
    messages: list[_Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    tools: list[_Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | _ToolChoice | None = None
    parallel_tool_calls: bool = True

    def new_tokens(self) -> int:
        return self.max_completion_tokens or super().new_tokens()

    def offers_tools(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"

    def forced_tool(self) -> str | None | Literal[False]:
        """The tool a call is forced to (None: any offered one), or False when the model may answer in text."""
        if not self.offers_tools() or self.tool_choice in (None, "auto"):
            return False
        return self.tool_choice.function.name if isinstance(self.tool_choice, _ToolChoice) else None


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
    return {"decode": decode, "reused_prompt_tokens": reused,
            **{k: v for k, v in summary.items() if k not in ("text", "ids")}}


def _usage(gen: Generation, reused: int) -> dict[str, int]:
    prompt = reused + len(gen.prompt_ids)
    return {"prompt_tokens": prompt, "completion_tokens": len(gen.ids), "total_tokens": prompt + len(gen.ids)}


class Prompt(NamedTuple):
    """A request's prompt: its tokens, and its text when a chat template made it (see ConversationCache)."""

    ids: list[int]
    text: str | None = None


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
        self._grammar_tokenizer: llguidance.LLTokenizer | None = None  # built on the first constrained request

    def models(self) -> dict[str, Any]:
        return {
            "object": "list",
            "data": [{"id": self.model_name, "object": "model", "created": self.created, "owned_by": "splitllm"}],
        }

    async def _start(
        self, prompt: Prompt, req: _Request, owner: str | None
    ) -> tuple[str, Generator[tuple[Generation, Any, int], None, None]]:
        """Validate a request up front (so errors come back as 400s before any streaming starts); the
        generation continues the kept conversation the prompt extends, if any."""
        try:
            decode = check_mode(req.decode or self.decode)
            sampling = req.sampling()
            grammar = await anyio.to_thread.run_sync(self._grammar, req)  # compiling takes a while
        except ValueError as exc:
            raise _APIError(400, str(exc)) from None
        sampling = replace(sampling, grammar=grammar)
        steps = self.conversations.stream(prompt.ids, req.new_tokens(), decode, sampling, req.stops(), prompt.text,
                                          owner)
        return decode, steps

    def _grammar(self, req: _Request) -> Grammar | None:
        """The grammar a request's output must follow: its JSON format, or the calls it forces."""
        forced = req.forced_tool() if isinstance(req, ChatRequest) else False
        fmt = req.response_format
        json_format = fmt is not None and fmt.type != "text"
        if forced is not False and json_format:
            raise _APIError(400, "response_format: a JSON format and a forced tool call cannot both hold; pick one")
        if forced is False and not json_format:
            return None
        if self._grammar_tokenizer is None:
            client = self.client
            self._grammar_tokenizer = grammar_tokenizer(client.tokenizer, client.files.hf_config.vocab_size,
                                                        client.stop_ids)
        if isinstance(fmt, _JsonSchemaFormat):
            return Grammar.json_schema(self._grammar_tokenizer, fmt.json_schema.definition)
        if isinstance(fmt, _JsonObjectFormat):
            return Grammar.json_schema(self._grammar_tokenizer)
        assert isinstance(req, ChatRequest) and req.tools
        return call_grammar(self._grammar_tokenizer, [t.model_dump() for t in req.tools], forced or None,
                            req.parallel_tool_calls)

    def chat_prompt(self, req: ChatRequest) -> Prompt:
        tok = self.client.tokenizer
        if not tok.chat_template:
            raise _APIError(400, "this model has no chat template; use /v1/completions")
        tools: list[dict[str, Any]] = [t.model_dump(exclude_none=True) for t in req.tools or ()]
        uses_tools = tools or req.tool_choice is not None or any(m.role == "tool" or m.tool_calls for m in req.messages)
        if uses_tools and not takes_tools(tok):
            raise _APIError(400, "tools: this model's chat template takes no tools (the Qwen2.5 models' does)")
        if req.tool_choice not in (None, "none", "auto") and not tools:
            raise _APIError(400, "tool_choice: it forces a call, but the request offers no tools")
        named = req.tool_choice.function.name if isinstance(req.tool_choice, _ToolChoice) else None
        if named is not None and all(t["function"]["name"] != named for t in tools):
            raise _APIError(400, f"tool_choice: {named!r} is not among the tools offered")
        messages = [m.template() for m in req.messages]
        # With tool_choice "none" the tools stay in the prompt (as vLLM keeps them) and calls are not read
        # back: the prompt stays the one the conversation's earlier turns had, so it goes on.
        # transformers types `tools` as a list of dicts or callables (a list of dicts is one), and its
        # result as every form it can return: untokenized, it is the text.
        offered = cast("list[dict[Any, Any] | Callable[..., Any]]", tools)
        text = cast(str, tok.apply_chat_template(messages, tools=offered or None, tokenize=False,
                                                 add_generation_prompt=True))
        return Prompt(tok(text, add_special_tokens=False)["input_ids"], text)

    def text_prompt(self, req: CompletionRequest) -> Prompt:
        return Prompt(req.prompt if isinstance(req.prompt, list) else self.client.encode_prompt(req.prompt, chat=False))

    async def complete(self, prompt: Prompt, req: _Request, chat: bool, owner: str | None) -> dict[str, Any]:
        decode, steps = await self._start(prompt, req, owner)
        async with self.lock:
            gen, reused = await self.compute.run_async(_last, steps)
        reply = self._head(chat, False)
        if chat:
            calls = _Calls(req)
            calls.feed(gen.text, True)
            message: dict[str, Any] = {"role": "assistant", "content": calls.content(gen.text)}
            if calls.found:
                message["tool_calls"] = [c.openai() for c in calls.found]
            reply["choices"] = [{"index": 0, "message": message, "finish_reason": calls.finish(gen)}]
        else:
            reply["choices"] = [{"index": 0, "text": gen.text, "finish_reason": gen.finish_reason, "logprobs": None}]
        return {**reply, "usage": _usage(gen, reused), "splitllm": _extension(gen, decode, reused)}

    async def stream(self, prompt: Prompt, req: _Request, chat: bool, owner: str | None) -> AsyncIterator[bytes]:
        decode, steps = await self._start(prompt, req, owner)
        head = self._head(chat, True)
        calls = _Calls(req)

        def chunks(gen: Generation, **extra: Any) -> Iterator[dict[str, Any]]:
            """The new content (one chunk, even empty, so a viewer sees each round trip), then each new call;
            the last chunk carries `extra` and, once the generation ended, its finish reason."""
            delta, found = calls.feed(gen.text, gen.finish_reason is not None)
            finish = calls.finish(gen)
            choice = {"index": 0, "delta": {"content": delta}} if chat else {"index": 0, "text": delta,
                                                                             "logprobs": None}
            deltas = [choice] + [{"index": 0, "delta": {"tool_calls": [c.openai(len(calls.found) - len(found) + i)]}}
                                 for i, c in enumerate(found)]
            for i, d in enumerate(deltas):
                last = i == len(deltas) - 1
                yield {**head, "choices": [{**d, "finish_reason": finish if last else None}], **(extra if last else {})}

        async def events() -> AsyncIterator[bytes]:
            async with self.lock:
                gen, reused = None, 0
                try:
                    if chat:
                        yield _sse({**head,
                                    "choices": [{"index": 0, "delta": {"role": "assistant"}, "finish_reason": None}]})
                    while (item := await self.compute.run_async(next, steps, None)) is not None:
                        gen, out, reused = item
                        if gen.finish_reason is None:  # every step, so a viewer sees each round trip
                            for c in chunks(gen, splitllm={"step": out.stats.as_dict()}):
                                yield _sse(c)
                    assert gen is not None
                    summary = {**_extension(gen, decode, reused), "step": gen.steps[-1].as_dict()}
                    for c in chunks(gen, splitllm=summary):
                        yield _sse(c)
                    if (req.stream_options or {}).get("include_usage"):
                        yield _sse({**head, "choices": [], "usage": _usage(gen, reused)})
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


class _Calls:
    """How an answer's text reads back: plain content, or content and tool calls when tools were offered."""

    def __init__(self, req: _Request) -> None:
        tools = req.tools if isinstance(req, ChatRequest) and req.offers_tools() else None
        self.reader = ToolCallReader([t.function.name for t in tools]) if tools else None
        self.parallel = not isinstance(req, ChatRequest) or req.parallel_tool_calls
        self.found: list[ToolCall] = []
        self._sent = 0

    def feed(self, text: str, final: bool) -> tuple[str, list[ToolCall]]:
        """New content and new calls, given the whole text so far (`final`: the generation ended)."""
        if self.reader is None:
            delta, self._sent = text[self._sent :], len(text)
            return delta, []
        delta, new = self.reader.feed(text, final)
        new = new[: max(0, 1 - len(self.found))] if not self.parallel else new  # parallel_tool_calls false: the first
        self.found += new
        return delta, new

    def content(self, text: str) -> str | None:
        return text if self.reader is None else self.reader.content(text)

    def finish(self, gen: Generation) -> str | None:
        return "tool_calls" if self.found and gen.finish_reason == "stop" else gen.finish_reason


def _last(steps: Iterator[tuple[Generation, Any, int]]) -> tuple[Generation, int]:
    gen, reused = None, 0
    for gen, _, reused in steps:  # noqa: B007 (drained: the last step is read after the loop)
        pass
    if gen is None:
        raise ValueError("the generation produced no step")
    return gen, reused


def create_app(
    client: SplitClient, model_name: str | None = None, decode: str = DEFAULT_DECODE,
    compute: ComputeThread | None = None,
    reuse: ReuseLimits = ReuseLimits(), api_keys: frozenset[str] = frozenset(),
) -> FastAPI:
    """The FastAPI app: /v1/models, /v1/chat/completions, /v1/completions (streaming over SSE), and the
    web chat at / (its files under /static, its settings at /splitllm/info). Every generation runs on
    `compute` (default: a new one), which should be the thread that loaded `client` (see ComputeThread).
    `reuse` bounds the conversations kept open so a follow-up request reads only its new tokens. With
    `api_keys`, every /v1 request must carry one (`Authorization: Bearer KEY`), and a conversation kept
    for one key is never continued for another."""
    endpoint = OpenAIEndpoint(client, model_name or client.files.path.name, decode, compute or ComputeThread(), reuse)
    app = FastAPI(title="splitllm", summary="OpenAI-compatible endpoint over a split model")
    app.state.endpoint = endpoint
    _add_error_handlers(app)
    owner = _key_check(api_keys)

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        owner(request)
        return endpoint.models()

    _add_web_chat(app, endpoint, bool(api_keys))
    _add_completions(app, endpoint, owner)
    return app


def _add_error_handlers(app: FastAPI) -> None:
    """Errors as OpenAI's JSON bodies; a request that fails validation is a 400 naming its fields."""

    @app.exception_handler(_APIError)
    async def api_error(_request: Request, exc: _APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def invalid(_request: Request, exc: RequestValidationError) -> JSONResponse:
        message = "; ".join(f"{'.'.join(map(str, e['loc'][1:]))}: {e['msg']}" for e in exc.errors())
        return JSONResponse(_APIError(400, message).body(), status_code=400)


def _key_check(api_keys: frozenset[str]) -> Callable[[Request], str | None]:
    """A request's API key (None when none are configured); a 401 unless it is one of `api_keys`."""

    def owner(request: Request) -> str | None:
        if not api_keys:
            return None
        scheme, _, key = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not any(hmac.compare_digest(key.encode(), k.encode()) for k in api_keys):
            raise _APIError(401, "a valid API key is needed: Authorization: Bearer <key>", "invalid_request_error")
        return key

    return owner


def _add_web_chat(app: FastAPI, endpoint: OpenAIEndpoint, keyed: bool) -> None:
    """The local web chat: its page, its files and what it shows (`keyed`: /v1 requests need an API key)."""
    app.mount("/static", StaticFiles(packages=[("splitllm.api", "web")]), name="static")

    @app.get("/", response_class=HTMLResponse)
    async def chat_page() -> str:
        """The local web chat: plain HTML, CSS and JS shipped with the package."""
        return resources.files("splitllm.api").joinpath("web/index.html").read_text()

    @app.get("/splitllm/info")
    async def info() -> dict[str, Any]:
        """What the chat page shows and offers: the model, where the middle runs, the decoding modes."""
        return {"model": endpoint.model_name, "server": endpoint.client.server, "modes": list(DECODERS),
                "decode": endpoint.decode, "api_key": keyed}


def _add_completions(app: FastAPI, endpoint: OpenAIEndpoint, owner: Callable[[Request], str | None]) -> None:
    """/v1/chat/completions and /v1/completions, whole or streamed."""

    async def respond(prompt: Prompt, req: _Request, chat: bool, key: str | None) -> Any:
        try:
            if req.stream:
                return StreamingResponse(await endpoint.stream(prompt, req, chat, key), media_type="text/event-stream")
            return await endpoint.complete(prompt, req, chat, key)
        except CLIENT_ERRORS as exc:
            raise _error(exc) from None

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatRequest, request: Request) -> Any:
        key = owner(request)
        return await respond(endpoint.chat_prompt(req), req, True, key)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request) -> Any:
        key = owner(request)
        return await respond(endpoint.text_prompt(req), req, False, key)
