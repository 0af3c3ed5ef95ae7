"""The ASGI application of ``lily-py serve`` (Starlette): routes, auth, streaming, disconnects.

    app = build_app(model, model_id="lily-py-demo")      # any ASGI server runs it; see cli.py

Two wire formats share one generation path: OpenAI's (``protocol``: /v1/chat/completions,
/v1/completions) and Anthropic's (``anthropic``: /v1/messages), whose requests become the same
``GenRequest``. Every generation goes through the ``Scheduler`` (one at a time per model, bounded
FIFO queue). Each request watches its connection: when the client goes away, its job is
cancelled (taken out of the queue, or stopped at the next token, the generator closed and the
model freed).
"""
from __future__ import annotations

import asyncio
import contextlib
import functools
import hmac
import inspect
import json
import logging
import time

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from .. import __version__
from ..batch import DEFAULT_PREFILL_STEP
from . import anthropic, protocol
from .protocol import APIError
from .scheduler import CHUNK, DONE, ERROR, Job, QueueFull, Scheduler, ShuttingDown

log = logging.getLogger("lily_py.serve")

MAX_BODY_BYTES = 32 << 20
# A chat request without max_tokens stops here (or at the end of the context, if sooner).
DEFAULT_MAX_TOKENS = 32768
PING_SECONDS = 10.0         # an Anthropic stream sends a ping after this long without an event
SHUTTING_DOWN = APIError(503, "the server is shutting down; the request was stopped",
                         code="server_shutdown")


class ClientGone(Exception):
    """The client closed the connection."""


def error_response(e: APIError) -> JSONResponse:
    headers = {"Retry-After": "1"} if e.status == 503 else None
    return JSONResponse(e.body(), status_code=e.status, headers=headers)


def anthropic_error_response(e: APIError) -> JSONResponse:
    status, body = anthropic.error_body(e)
    headers = {"Retry-After": "1"} if e.status == 503 else None
    return JSONResponse(body, status_code=status, headers=headers)


def api_error(e: BaseException, param: str | None = None) -> APIError:
    """A lily_py exception raised by ``generate`` -> the OpenAI error answered for it."""
    from ..errors import BusyError, ContextLengthError
    if isinstance(e, APIError):
        return e
    if isinstance(e, ContextLengthError):
        return APIError(400, str(e), param=param, code="context_length_exceeded")
    if isinstance(e, ShuttingDown):
        return APIError(503, str(e), code="server_shutdown")
    if isinstance(e, QueueFull):
        return APIError(503, str(e), code="queue_full")
    if isinstance(e, BusyError):
        return APIError(503, str(e), code="busy")
    if isinstance(e, (ValueError, TypeError)):     # also ChatTemplateError
        return APIError(400, str(e), param=param, code="invalid_request")
    return APIError(500, f"internal error: {type(e).__name__}: {e}", code="internal_error")


def dead_end_error(chunk) -> APIError:
    """A generation that ended with finish_reason "error" (its constraint admits no token and
    is not at an accepting state): an error, as vLLM answers a generation that finished with an
    error (500; in a stream, an error event before [DONE]), never a "stop" with broken output."""
    why = getattr(chunk, "error", "") or "the generation failed"
    return APIError(500, f"generation failed: {why}", code="constraint_dead_end")


async def _disconnected(receive) -> None:
    """Returns when the client has closed the connection (the request body is already read)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def _next_event(job: Job, watcher: asyncio.Task, timeout: float | None = None):
    """The job's next event; None when ``timeout`` seconds pass without one."""
    if watcher.done():
        raise ClientGone()
    get = asyncio.ensure_future(job.events.get())
    await asyncio.wait({get, watcher}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    if get.done():
        return get.result()
    get.cancel()
    if watcher.done():
        raise ClientGone()
    return None


async def _chunks(job: Job, watcher: asyncio.Task):
    """The job's chunks until it is done (after its START event), for the collecting (not
    streaming) answers: an ERROR event or a chunk that finished with "error" raises APIError."""
    while True:
        kind, value = await _next_event(job, watcher)
        if kind == DONE:
            return
        if kind == ERROR:
            raise api_error(value)
        if value.finish_reason == "error":
            raise dead_end_error(value)
        yield value


class Server:
    """State of one served model; ``app`` is its Starlette application."""

    def __init__(self, model, *, model_id: str, api_key: str | None = None, max_queue: int = 16,
                 default_max_tokens: int | None = DEFAULT_MAX_TOKENS,
                 served_names: list[str] | None = None, max_batch: int | None = None,
                 prefill_step: int = DEFAULT_PREFILL_STEP):
        """``model_id``: the id /v1/models lists first. ``served_names``: None (the default)
        serves the model under any name a request gives; a list accepts only ``model_id`` and
        those names (others: 404). ``default_max_tokens``: the cap of a chat request without
        max_tokens (None: the end of the context). ``max_batch``: requests decoded together
        (None: the engine's most, 8, or 1 on a model without the batched step; 1: one at a
        time); ``prefill_step``: prompt tokens prefilled between two batched steps."""
        self.model, self.model_id, self.api_key = model, model_id, api_key
        self.names = None if served_names is None else list(dict.fromkeys([model_id,
                                                                            *served_names]))
        self.default_max_tokens = default_max_tokens
        self.created = int(time.time())
        self.scheduler = Scheduler(model, max_queue, max_batch, prefill_step)
        # Sampling of a Messages request that leaves it out: the checkpoint's own defaults.
        self.sampling_defaults = anthropic.generation_defaults(getattr(model, "path", None))
        params = inspect.signature(model.generate).parameters
        self._accepts = set(params) if not any(
            p.kind == p.VAR_KEYWORD for p in params.values()) else None
        self.app = Starlette(
            routes=[Route("/health", self.health),
                    Route("/v1/models", self.models),
                    Route("/v1/models/{model_id:path}", self.model_info),
                    Route("/v1/chat/completions", self.chat, methods=["POST"]),
                    Route("/v1/completions", self.completions, methods=["POST"]),
                    Route("/v1/messages", self.messages, methods=["POST"]),
                    Route("/v1/messages/count_tokens", self.count_tokens, methods=["POST"])],
            exception_handlers={HTTPException: self._http_error, Exception: self._internal},
            lifespan=self._lifespan)

    @contextlib.asynccontextmanager
    async def _lifespan(self, app):
        yield
        self.shutdown()

    # ---- plumbing ---------------------------------------------------------------------------
    async def _http_error(self, request, exc: HTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        msg = (f"no route {request.method} {request.url.path}" if exc.status_code in (404, 405)
               else exc.detail)
        return self._error_response(request)(APIError(exc.status_code, msg, code=code,
                                                      type="invalid_request_error"))

    async def _internal(self, request, exc: Exception):
        log.exception("unhandled error")
        return self._error_response(request)(api_error(exc))

    @staticmethod
    def _error_response(request: Request):
        """Anthropic's error shape on its routes (/v1/messages...), OpenAI's elsewhere."""
        if request.url.path.startswith("/v1/messages"):
            return anthropic_error_response
        return error_response

    def shutdown(self) -> None:
        self.scheduler.stop()

    def _auth(self, request: Request) -> None:
        """The API key as OpenAI's clients send it (``Authorization: Bearer KEY``) or as
        Anthropic's do (``x-api-key: KEY``); either one matching is enough."""
        if self.api_key is None:
            return
        key = self.api_key.encode()
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key):
            return
        if hmac.compare_digest(request.headers.get("x-api-key", "").strip().encode(), key):
            return
        raise APIError(401, "missing or wrong API key: send 'Authorization: Bearer <key>' or "
                       "'x-api-key: <key>' with the key given to lily-py serve --api-key",
                       code="invalid_api_key")

    async def _json(self, request: Request):
        raw = await request.body()
        if len(raw) > MAX_BODY_BYTES:
            raise APIError(413, f"the request body is {len(raw)} bytes; the limit is "
                           f"{MAX_BODY_BYTES}", code="body_too_large")
        try:
            return json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise APIError(400, f"the request body is not valid JSON: {e}",
                           code="invalid_json") from None

    # ---- small routes -----------------------------------------------------------------------
    async def health(self, request: Request):
        return JSONResponse({"status": "ok", "model": self.model_id,
                             "backend": getattr(self.model, "backend", None),
                             "context_length": getattr(self.model, "context_length", None),
                             **self.scheduler.status()})

    def _model_card(self, name: str) -> dict:
        """A model object in OpenAI's shape and Anthropic's at once (each client reads its own
        fields): id, object, created, owned_by; type, display_name, created_at."""
        return {"id": name, "object": "model", "created": self.created, "owned_by": "lily-py",
                "type": "model", "display_name": name,
                "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.created))}

    async def models(self, request: Request):
        try:
            self._auth(request)
        except APIError as e:
            return error_response(e)
        names = self.names or [self.model_id]
        return JSONResponse({"object": "list", "data": [self._model_card(n) for n in names],
                             "has_more": False, "first_id": names[0], "last_id": names[-1]})

    async def model_info(self, request: Request):
        try:
            self._auth(request)
            self._check_model(request.path_params["model_id"])
        except APIError as e:
            return error_response(e)
        return JSONResponse(self._model_card(request.path_params["model_id"]))

    def _check_model(self, name: str) -> None:
        if self.names is not None and name not in self.names:
            raise APIError(404, f"the model {name!r} is not served here; this server serves "
                           f"{', '.join(map(repr, self.names))} (GET /v1/models)", param="model",
                           code="model_not_found")

    # ---- generation -------------------------------------------------------------------------
    async def chat(self, request: Request):
        return await self._generate(request, protocol.parse_chat)

    async def completions(self, request: Request):
        return await self._generate(request, protocol.parse_completion)

    async def messages(self, request: Request):
        return await self._generate(request, functools.partial(
            anthropic.parse_messages, defaults=self.sampling_defaults), messages=True)

    async def count_tokens(self, request: Request):
        """``{"input_tokens": N}``: the prompt's length as /v1/messages would render it (chat
        template, tools, thinking switch); not queued behind generations."""
        try:
            self._auth(request)
            req = anthropic.parse_count_tokens(await self._json(request))
            self._check_model(req.model)
            self._require_template()
            n = await asyncio.get_running_loop().run_in_executor(None, self._count, req)
        except Exception as e:         # also ChatTemplateError
            return anthropic_error_response(api_error(e, "messages"))
        return JSONResponse({"input_tokens": n})

    def _count(self, req: protocol.GenRequest) -> int:
        """Tokens of the prompt ``generate`` would feed (a prompt longer than the context is
        counted too: the answer is how much to cut)."""
        tok = self.model.tokenizer
        return len(tok.encode(tok.apply_chat_template(
            req.prompt, add_generation_prompt=True, tools=req.tools,
            enable_thinking=req.chat_template_kwargs["enable_thinking"])))

    def _require_template(self) -> None:
        if getattr(self.model.tokenizer, "chat_template", None) is None:
            raise protocol.bad("this model has no chat template; use /v1/completions",
                               "messages", "no_chat_template")

    def _kwargs(self, req: protocol.GenRequest) -> dict:
        cap = self.default_max_tokens if req.kind == "chat" else None
        max_tokens = req.max_tokens or cap or self.model.context_length
        kw = dict(max_tokens=max_tokens, **req.sampling)
        if req.kind == "chat":
            ctk = dict(req.chat_template_kwargs)
            kw["enable_thinking"] = ctk.pop("enable_thinking", None)
            kw["tools"] = req.tools
            if ctk:
                kw["chat_template_kwargs"] = ctk
            if req.response_format is not None:
                kw["response_format"] = req.response_format
            if req.tool_choice not in ("auto", "none"):
                kw["tool_choice"] = req.tool_choice
                kw["parallel_tool_calls"] = req.parallel_tool_calls
        if req.logprobs:
            kw["logprobs"] = True
            if req.top_logprobs:
                kw["top_logprobs"] = req.top_logprobs
        if self._accepts is not None:
            unsupported = [k for k, v in kw.items() if k not in self._accepts and v is not None]
            if unsupported:
                raise protocol.bad(f"this lily_py build does not support "
                                   f"{', '.join(unsupported)}", unsupported[0], "unsupported_value")
            kw = {k: v for k, v in kw.items() if k in self._accepts}
        return kw

    async def _generate(self, request: Request, parse, messages: bool = False):
        """Validate, queue, then answer: streamed or whole, in OpenAI's format or (``messages``)
        Anthropic's."""
        answer_error = anthropic_error_response if messages else error_response
        try:
            self._auth(request)
            req = parse(await self._json(request))
            self._check_model(req.model)
            if req.kind == "chat":
                self._require_template()
            job = Job(req.prompt, self._kwargs(req), asyncio.get_running_loop())
            self.scheduler.submit(job)
        except (APIError, QueueFull) as e:
            return answer_error(api_error(e))

        watcher = asyncio.ensure_future(_disconnected(request.receive))
        param = "messages" if req.kind == "chat" else "prompt"
        handed_over = False
        try:
            kind, value = await _next_event(job, watcher)     # START (prompt tokens) or ERROR
            if kind == ERROR:
                msg = str(value)
                for field_name in ("response_format", "tool_choice"):
                    if msg.startswith(field_name + ":"):
                        param = field_name      # the compiler's message about that field
                return answer_error(api_error(value, param))
            if messages and req.stream:
                handed_over = True
                return _SSE(self._message_events(req, job, watcher, value), job, watcher,
                            named=True)
            if messages:
                return JSONResponse(await self._collect_message(req, job, watcher))
            if req.stream:
                handed_over = True
                return _SSE(self._sse_events(req, job, watcher), job, watcher)
            return JSONResponse(await self._collect(req, job, watcher))
        except ClientGone:
            return JSONResponse({}, status_code=499)      # nobody reads it
        except APIError as e:
            return answer_error(e)
        except asyncio.CancelledError:
            # uvicorn's shutdown timeout ran out: answer instead of dying with a traceback
            return answer_error(SHUTTING_DOWN)
        finally:
            if not handed_over:
                job.cancel()
                watcher.cancel()

    async def _collect(self, req, job, watcher) -> dict:
        message: dict = {"role": "assistant", "content": None}
        text, reason, stats, saw_calls = [], None, None, False
        lps = []
        async for value in _chunks(job, watcher):
            lp = protocol.answer_logprob(value, req.kind)
            if lp is not None:
                lps.append(lp)
            if req.kind == "chat":
                d = protocol.chunk_delta(value)
                saw_calls |= "tool_calls" in d
                protocol.merge_delta(message, d)
            else:
                text.append(value.text)
            if value.finish_reason is not None:
                reason, stats = value.finish_reason, value.stats
        head = {"id": protocol.new_id(req.kind), "created": protocol.created(),
                "model": req.model, "system_fingerprint": self._fingerprint()}
        fr = protocol.finish_reason(reason, saw_calls)
        if req.kind == "chat":
            if message["content"] is None and not saw_calls:
                message["content"] = ""
            choice = {"index": 0, "message": message, "finish_reason": fr, "logprobs": None}
            if req.logprobs:
                tk = self.model.tokenizer
                choice["logprobs"] = {"content": [protocol.chat_logprobs(tk, lp) for lp in lps],
                                      "refusal": None}
            return {**head, "object": "chat.completion", "choices": [choice],
                    "usage": protocol.usage(stats)}
        choice = {"index": 0, "text": "".join(text), "finish_reason": fr, "logprobs": None}
        if req.logprobs:
            choice["logprobs"] = protocol.completion_logprobs(self.model.tokenizer, lps)
        return {**head, "object": "text_completion", "choices": [choice],
                "usage": protocol.usage(stats)}

    async def _collect_message(self, req, job, watcher) -> dict:
        blocks = anthropic.Blocks(req.thinking)
        reason, stats, stop = None, None, ""
        async for value in _chunks(job, watcher):
            blocks.feed(value)
            if value.finish_reason is not None:
                reason, stats = value.finish_reason, value.stats
                stop = getattr(value, "stop_sequence", "")
        blocks.finish()
        sr, seq = anthropic.stop_reason(reason, blocks.saw_tool_use, stop)
        return anthropic.message(anthropic.new_message_id(), req.model, blocks.content, sr, seq,
                                 anthropic.usage(stats))

    async def _message_events(self, req, job, watcher, prompt_tokens: int | None):
        """Anthropic's stream: message_start, ping, the blocks' events, message_delta (stop
        reason, usage), message_stop; a ping after PING_SECONDS without an event (a long
        prefill); an error event if the generation fails."""
        start = anthropic.message(anthropic.new_message_id(), req.model, [], None, None,
                                  anthropic.usage(None, prompt_tokens))
        yield {"type": "message_start", "message": start}
        yield {"type": "ping"}
        blocks = anthropic.Blocks(req.thinking)
        reason, stats, stop = None, None, ""
        while True:
            event = await _next_event(job, watcher, PING_SECONDS)
            if event is None:
                yield {"type": "ping"}
                continue
            kind, value = event
            if kind == DONE:
                break
            if kind == ERROR or value.finish_reason == "error":
                e = api_error(value) if kind == ERROR else dead_end_error(value)
                yield anthropic.error_body(e)[1]
                return
            for ev in blocks.feed(value):
                yield ev
            if value.finish_reason is not None:
                reason, stats = value.finish_reason, value.stats
                stop = getattr(value, "stop_sequence", "")
        for ev in blocks.finish():
            yield ev
        sr, seq = anthropic.stop_reason(reason, blocks.saw_tool_use, stop)
        yield {"type": "message_delta", "delta": {"stop_reason": sr, "stop_sequence": seq},
               "usage": anthropic.usage(stats)}
        yield {"type": "message_stop"}

    def _fingerprint(self) -> str:
        return f"lily-py-{__version__}-{getattr(self.model, 'backend', '?')}"

    async def _sse_events(self, req, job, watcher):
        """The data lines of a streamed answer (dicts, then "[DONE]")."""
        chat = req.kind == "chat"
        head = {"id": protocol.new_id(req.kind), "object": "chat.completion.chunk" if chat
                else "text_completion", "created": protocol.created(), "model": req.model,
                "system_fingerprint": self._fingerprint()}

        tk = self.model.tokenizer
        offset = 0

        def choice(d=None, text=None, fr=None, lp=None):
            nonlocal offset
            c = {"index": 0, "delta": d} if chat else {"index": 0, "text": text}
            lpd = None
            if lp is not None:
                lpd = {"content": [protocol.chat_logprobs(tk, lp)], "refusal": None} if chat \
                    else protocol.completion_logprobs(tk, [lp], offset)
                if not chat:
                    offset += len(lpd["tokens"][0])
            return {**head, "choices": [{**c, "finish_reason": fr, "logprobs": lpd}]}

        if chat:
            yield choice({"role": "assistant", "content": ""})
        reason, stats, saw_calls = None, None, False
        while True:
            kind, value = await _next_event(job, watcher)
            if kind == DONE:
                break
            if kind == ERROR:
                yield api_error(value).body()
                yield "[DONE]"
                return
            if value.finish_reason == "error":
                yield dead_end_error(value).body()
                yield "[DONE]"
                return
            if value.finish_reason is not None:
                reason, stats = value.finish_reason, value.stats
            lp = protocol.answer_logprob(value, req.kind) if req.logprobs else None
            if chat:
                d = protocol.chunk_delta(value)
                saw_calls |= "tool_calls" in d
                if d or lp is not None:
                    yield choice(d, lp=lp)
            elif value.text or lp is not None:
                yield choice(text=value.text, lp=lp)
        fr = protocol.finish_reason(reason, saw_calls)
        yield choice({}, fr=fr) if chat else choice(text="", fr=fr)
        if req.include_usage:
            yield {**head, "choices": [], "usage": protocol.usage(stats)}
        yield "[DONE]"


class _SSE:
    """A server-sent-events answer; cancels its job when the client goes away or when the
    response ends in any way. OpenAI's events are ``data:`` lines ending with ``[DONE]``;
    Anthropic's (``named``) are named by their ``type``: ``event: TYPE`` then ``data:``."""

    def __init__(self, events, job: Job, watcher: asyncio.Task, named: bool = False):
        self.events, self.job, self.watcher = events, job, watcher
        self.named = named

    def _frame(self, data) -> bytes:
        line = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
        if self.named:
            return f"event: {data['type']}\ndata: {line}\n\n".encode()
        return f"data: {line}\n\n".encode()

    async def __call__(self, scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream; charset=utf-8"),
                                (b"cache-control", b"no-cache"),
                                (b"x-accel-buffering", b"no")]})
        try:
            async for data in self.events:
                await send({"type": "http.response.body", "body": self._frame(data),
                            "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except (ClientGone, OSError):
            pass        # the client left: nothing more to send
        except asyncio.CancelledError:
            # uvicorn's shutdown timeout ran out: end the stream with an error event
            last = [anthropic.error_body(SHUTTING_DOWN)[1]] if self.named else \
                [SHUTTING_DOWN.body(), "[DONE]"]
            with contextlib.suppress(Exception):
                await send({"type": "http.response.body", "more_body": False,
                            "body": b"".join(self._frame(d) for d in last)})
        finally:
            self.job.cancel()
            self.watcher.cancel()
            await self.events.aclose()


def build_app(model, **kwargs):
    """The Starlette application serving ``model`` (see ``Server`` for the options)."""
    return Server(model, **kwargs).app
