"""Helpers for the server tests: a real ``lily-py serve`` process, and the same application
served in-process (uvicorn on a thread) for a scripted model. Loopback addresses only."""
from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import pytest

STARTUP_TIMEOUT = 120.0        # loading the demo on a busy machine
REQUEST_TIMEOUT = 120.0


class ServeProcess:
    """``lily-py serve --port 0 ...`` in a subprocess; stderr goes to a file (never a pipe that
    could fill up), the port is read from the line the server prints."""

    def __init__(self, args: list[str], log_path):
        self.log_path = log_path
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "lily_py.cli", "serve", "--host", "127.0.0.1", "--port", "0",
             *args], stdout=self._log, stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"})
        try:
            self.port = self._wait_port()
            self.base = f"http://127.0.0.1:{self.port}"
            self._wait_health()
        except BaseException:
            self.kill()
            raise

    def log(self) -> str:
        with open(self.log_path) as f:
            return f.read()

    def _wait_port(self) -> int:
        deadline = time.monotonic() + STARTUP_TIMEOUT
        while time.monotonic() < deadline:
            m = re.search(r"at http://127\.0\.0\.1:(\d+)/v1", self.log())
            if m:
                return int(m.group(1))
            if self.proc.poll() is not None:
                raise RuntimeError(f"lily-py serve exited ({self.proc.returncode}):\n{self.log()}")
            time.sleep(0.1)
        raise TimeoutError(f"lily-py serve printed no address in {STARTUP_TIMEOUT}s:\n{self.log()}")

    def _wait_health(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError):
                if self.health()["status"] == "ok":
                    return
            if self.proc.poll() is not None:
                raise RuntimeError(f"lily-py serve exited ({self.proc.returncode}):\n{self.log()}")
            time.sleep(0.1)
        raise TimeoutError(f"/health did not answer in {STARTUP_TIMEOUT}s:\n{self.log()}")

    def health(self) -> dict:
        with urllib.request.urlopen(self.base + "/health", timeout=10) as r:
            return json.load(r)

    def wait_idle(self, timeout: float = 30.0) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            h = self.health()
            if h["running"] == 0 and h["queued"] == 0:
                return h
            if time.monotonic() > deadline:
                raise TimeoutError(f"server still busy after {timeout}s: {h}")
            time.sleep(0.05)

    def client(self, **kw):
        import openai
        return openai.OpenAI(base_url=self.base + "/v1", api_key=kw.pop("api_key", "unused"),
                             max_retries=0, timeout=REQUEST_TIMEOUT, **kw)

    def anthropic(self, **kw):
        """The official ``anthropic`` client on this server (it appends /v1/messages)."""
        import anthropic
        return anthropic.Anthropic(base_url=self.base, api_key=kw.pop("api_key", "unused"),
                                   max_retries=0, timeout=REQUEST_TIMEOUT, **kw)

    def stop(self, sig=signal.SIGINT, timeout: float = 30.0) -> int:
        self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        finally:
            self.kill()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self._log.close()


@pytest.fixture(scope="module")
def serve_factory(tmp_path_factory):
    """Starts real servers; every one is killed at teardown whatever happened."""
    procs = []

    def start(*args: str) -> ServeProcess:
        p = ServeProcess(list(args), tmp_path_factory.mktemp("serve") / "serve.log")
        procs.append(p)
        return p

    yield start
    for p in procs:
        p.kill()


class ThreadServer:
    """The lily-py serve application around any model object, on uvicorn in a thread."""

    def __init__(self, model, **kwargs):
        import uvicorn
        from lily_py.serve.app import Server
        self.server = Server(model, model_id=kwargs.pop("model_id", "scripted"), **kwargs)
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self.base = f"http://127.0.0.1:{self.port}"
        self.uv = uvicorn.Server(uvicorn.Config(self.server.app, log_level="warning",
                                                lifespan="on"))
        self.thread = threading.Thread(target=self.uv.run, kwargs={"sockets": [sock]},
                                       daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.uv.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the in-process server did not start")
            time.sleep(0.02)

    def client(self, **kw):
        import openai
        return openai.OpenAI(base_url=self.base + "/v1", api_key=kw.pop("api_key", "unused"),
                             max_retries=0, timeout=30, **kw)

    def anthropic(self, **kw):
        import anthropic
        return anthropic.Anthropic(base_url=self.base, api_key=kw.pop("api_key", "unused"),
                                   max_retries=0, timeout=30, **kw)

    def status(self) -> dict:
        return self.server.scheduler.status()

    def close(self) -> None:
        self.uv.should_exit = True
        self.thread.join(30)
        assert not self.thread.is_alive(), "the in-process server did not stop"


@pytest.fixture
def inproc():
    """Starts ``ThreadServer``s around given model objects; all are stopped at teardown."""
    servers = []

    def start(model, **kw) -> ThreadServer:
        s = ThreadServer(model, **kw)
        servers.append(s)
        return s

    yield start
    for s in servers:
        s.close()
