"""vLLM in this process: the local mode of `RemotevLLMEngine`.

`LocalvLLMServer` builds an ``AsyncLLM`` in the calling process from ``vllm serve`` arguments and
serves vLLM's own OpenAI app for it on a loopback port, on an event loop of a background thread.
The engine then drives it through exactly the routes it drives a remote server through, so the
two modes share every line of generation, pause, version and update code. (The ``AsyncLLM``'s
engine core and TP workers are vLLM's own processes either way; only the API server moves in.)

The engine needs vLLM's RL routes and token-in generate route, so the server always runs with
``VLLM_SERVER_DEV_MODE=1`` (set in this process's environment when unset) and
``--enable-scale-out``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import threading
from collections.abc import Sequence
from typing import Any

__all__ = ["LocalvLLMServer"]


class LocalvLLMServer:
    """An in-process ``AsyncLLM`` behind vLLM's OpenAI app on ``127.0.0.1`` (module docstring).

    ``serve_args`` are ``vllm serve`` command-line arguments (``["--model", path,
    "--tensor-parallel-size", "2", ...]``); ``--host`` and ``--port`` are chosen here."""

    def __init__(self, serve_args: Sequence[str]) -> None:
        """Parse ``serve_args`` with vLLM's own parser (an unknown flag raises here)."""
        from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
        from vllm.utils.argparse_utils import FlexibleArgumentParser

        args = list(serve_args)
        if "--enable-scale-out" not in args:
            args.append("--enable-scale-out")
        self.args = make_arg_parser(FlexibleArgumentParser()).parse_args(args)
        validate_parsed_serve_args(self.args)
        self.url: str | None = None
        self.engine_client: Any = None  # the AsyncLLM, once started
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._server: Any = None
        self._thread: threading.Thread | None = None

    def start(self, timeout: float = 600.0) -> str:
        """Build the engine and the app, start serving, and return the URL; raises what vLLM
        raised if it failed to start, or `TimeoutError`."""
        os.environ.setdefault("VLLM_SERVER_DEV_MODE", "1")
        sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self._thread = threading.Thread(target=self._run, args=(sock,), name="vllm-local-server", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout):
            self.stop()
            raise TimeoutError(f"the local vLLM server did not start within {timeout:.0f} s")
        if self._error is not None:
            self.stop()
            raise RuntimeError(f"the local vLLM server failed to start: {self._error}") from self._error
        return self.url

    def _run(self, sock: socket.socket) -> None:
        loop = asyncio.new_event_loop()
        try:
            loop.run_until_complete(self._serve(sock))
        except BaseException as exc:  # noqa: BLE001 - handed to start() or logged by vLLM already
            self._error = exc
        finally:
            self._ready.set()
            sock.close()
            loop.close()

    async def _serve(self, sock: socket.socket) -> None:
        import uvicorn
        from vllm.entrypoints.launchers.api_server.app_state import init_app_state
        from vllm.entrypoints.launchers.api_server.entry import build_async_engine_client
        from vllm.entrypoints.launchers.app import build_app

        async with build_async_engine_client(self.args) as client:
            self.engine_client = client
            tasks = await client.get_supported_tasks()
            app = build_app(self.args, tasks, client.model_config)
            await init_app_state(client, app.state, self.args, tasks)
            config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on")
            self._server = uvicorn.Server(config)
            serving = asyncio.ensure_future(self._server.serve(sockets=[sock]))
            while not self._server.started and not serving.done():
                await asyncio.sleep(0.05)
            self._ready.set()
            await serving

    def stop(self, timeout: float = 60.0) -> None:
        """Stop serving and shut the engine down (its engine core and workers exit)."""
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        self._server = None
        self.engine_client = None

    def __enter__(self) -> LocalvLLMServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        with contextlib.suppress(Exception):
            self.stop()
