"""``lily-py serve``: arguments and the uvicorn run (the rest of the CLI is lily_py/cli.py)."""
from __future__ import annotations

import argparse
import ipaddress
import os
import signal
import socket
import sys

from ..batch import DEFAULT_PREFILL_STEP

DEMO_ID = "lily-py-demo"
INSTALL = 'pip install ".[serve]" (from a clone of lily_py)'
DEFAULT_MAX_TOKENS = 32768          # = lily_py.serve.app.DEFAULT_MAX_TOKENS (no starlette here)


def add_parser(sub, add_model_args) -> argparse.ArgumentParser:
    s = sub.add_parser("serve", help="OpenAI- and Anthropic-compatible HTTP server",
                       description="Serve one model over the OpenAI API (/v1/chat/completions, "
                       "/v1/completions, /v1/models) and Anthropic's Messages API (/v1/messages, "
                       f"/v1/messages/count_tokens), with /health. Needs the serve extra: {INSTALL}.")
    add_model_args(s)
    s.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default: 127.0.0.1, loopback only)")
    s.add_argument("--port", type=int, default=8000, help="TCP port (default: 8000; 0 picks a free one)")
    s.add_argument("--model-name", default=None,
                   help=f"the model id /v1/models lists first (default: {DEMO_ID!r} for the demo, "
                   "else the first --served-model-name, else the --model argument)")
    s.add_argument("--served-model-name", action="append", default=None, metavar="NAME",
                   help="accept only this model name (repeatable: aliases; --model-name is "
                   "accepted too); other names get 404 (default: any name is accepted)")
    s.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' or 'x-api-key: KEY' on /v1/* "
                   "(default: $LILY_PY_API_KEY, or no key)")
    s.add_argument("--max-queue", type=int, default=16,
                   help="requests that may wait behind the running one; more get 503 (default: 16)")
    s.add_argument("--max-batch", type=int, default=None,
                   help="requests decoded together in one step (default: the engine's most, 8; "
                        "1: one request at a time)")
    s.add_argument("--prefill-step", type=int, default=DEFAULT_PREFILL_STEP,
                   help="prompt tokens prefilled between two decode steps of running requests "
                        f"(default: {DEFAULT_PREFILL_STEP}; smaller keeps their pace steadier, "
                        "larger prefills a new prompt sooner)")
    s.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS,
                   help="max_tokens of an OpenAI chat request that gives none (default: "
                   f"{DEFAULT_MAX_TOKENS}, or the end of the context if sooner; /v1/messages "
                   "requests always give max_tokens, /v1/completions default to 16)")
    s.add_argument("--shutdown-timeout", type=float, default=10.0,
                   help="seconds to let running requests finish on SIGINT/SIGTERM (default: 10)")
    s.add_argument("--log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug"],
                   help="uvicorn's log level (default: info)")
    s.set_defaults(func=cmd_serve)
    return s


def cmd_serve(a) -> int:
    try:
        import uvicorn
        from .app import Server
    except ImportError as e:
        print(f"lily-py: error: lily-py serve needs the serve extra ({e}): {INSTALL}",
              file=sys.stderr)
        return 2
    if a.max_queue < 0:
        raise ValueError(f"--max-queue must be >= 0, got {a.max_queue}")
    if a.max_tokens is not None and a.max_tokens < 1:
        raise ValueError(f"--max-tokens must be >= 1, got {a.max_tokens}")
    api_key = a.api_key or os.environ.get("LILY_PY_API_KEY") or None
    from ..model import load
    model = load(a.model, backend=a.backend, context_length=a.context, revision=a.revision,
                 kv_dtype=a.kv_dtype)
    served = a.served_model_name
    if served is not None and not all(served):
        raise ValueError("--served-model-name must not be empty")
    model_id = a.model_name or (served[0] if served else DEMO_ID if a.model is None else a.model)
    if a.max_batch is not None and a.max_batch < 1:
        raise ValueError(f"--max-batch must be >= 1, got {a.max_batch}")
    server = Server(model, model_id=model_id, api_key=api_key, max_queue=a.max_queue,
                    default_max_tokens=a.max_tokens, served_names=served,
                    max_batch=a.max_batch, prefill_step=a.prefill_step)

    # Bind here so that --port 0 works and the address printed is the real one.
    family = socket.AF_INET6 if ":" in a.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((a.host, a.port))
    except OSError as e:
        sock.close()
        raise ValueError(f"cannot bind {a.host}:{a.port}: {e.strerror}") from None
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if family == socket.AF_INET6 else host
    names = ("only " + ", ".join(map(repr, server.names)) if server.names
             else "any model name")
    print(f"lily-py serve: model {model_id!r} ({model.config.summary()}; backend {model.backend}, "
          f"context {model.context_length}; {server.scheduler.max_batch} requests at once) at http://{shown}:{port}/v1"
          f"{' (API key required)' if api_key else ''}; accepts {names}", file=sys.stderr,
          flush=True)
    if not api_key and not ipaddress.ip_address(host).is_loopback:
        print(f"lily-py serve: warning: listening on {host}, beyond this machine, without "
              "--api-key", file=sys.stderr, flush=True)
    config = uvicorn.Config(server.app, log_level=a.log_level,
                            timeout_graceful_shutdown=a.shutdown_timeout, lifespan="on")
    # uvicorn handles SIGINT/SIGTERM (stop accepting, let running requests finish, then the
    # lifespan shutdown cancels what is left) and afterwards re-raises the signal to the handler
    # it found: a no-op here, so that a requested stop ends with exit status 0.
    previous = {s: signal.signal(s, lambda *_: None) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        uvicorn.Server(config).run(sockets=[sock])
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
    print("lily-py serve: stopped", file=sys.stderr, flush=True)
    return 0
