"""A dead engine ends the server process with a non-zero status, so a restart policy revives it.

vLLM's API server notices a dead EngineCore in two places: the exception handler of a request that
fails with `EngineDeadError`, and a watchdog polling `engine_client.errored` every 5 s; both set
`server.should_exit`, and uvicorn then stops with status 0, which a supervisor's `on-failure`
policy reads as a clean stop. `qwen35-serve` adds its own watch, started from the app's lifespan
(`serve.middleware` calls `on_startup` / `on_shutdown`):

- every `POLL_S` seconds it reads `engine_client.errored` (true once the EngineCore process has
  died, reported a fatal error, or the output loop has failed);
- an engine that errors while no shutdown was asked for is a death: it logs an ERROR, records
  it, and asks uvicorn to stop; `serve.launcher` then exits with `ENGINE_DEAD_STATUS`. If the process
  is still alive `HARD_EXIT_S` seconds later (a connection that never closes), it is ended with
  that status at once;
- SIGTERM and SIGINT are recorded as they arrive, before vLLM's handlers stop the engine (which
  also makes it read as errored), so an ordinary stop still exits 0.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading

log = logging.getLogger("vllm.qwen35.serve")

ENGINE_DEAD_STATUS = 3
POLL_S = 0.5
HARD_EXIT_S = 20.0

_died = threading.Event()
_stopping = threading.Event()
_tasks: set[asyncio.Task] = set()


def engine_died() -> bool:
    """Whether the engine died while the server was serving."""
    return _died.is_set()


def _errored(app: object) -> bool:
    client = getattr(getattr(app, "state", None), "engine_client", None)
    try:
        return client is not None and bool(client.errored)
    except Exception:  # an engine client half torn down reads as dead
        return True


def _record_stop_signals() -> None:
    """Record SIGTERM/SIGINT ahead of the handlers already installed.

    The event loop (asyncio's or uvloop's) learns of a signal through the wakeup file descriptor
    that the interpreter writes in its C-level handler, whatever Python-level handler is set; the
    loop's own callbacks (vLLM's shutdown) therefore still run. The Python-level handler installed
    here records the signal, then calls the one it replaces.
    """
    for sig in (signal.SIGTERM, signal.SIGINT):
        previous = signal.getsignal(sig)

        def on_signal(number: int, frame: object, previous: object = previous) -> None:
            _stopping.set()
            if callable(previous):
                previous(number, frame)

        try:
            signal.signal(sig, on_signal)
        except (ValueError, OSError):  # not the main thread
            return


def _declare_dead(app: object, source: str) -> None:
    if _died.is_set():
        return
    _died.set()
    log.error("qwen35-serve: the engine is dead (%s); stopping the server with status %d so that a restart policy "
              "brings it back", source, ENGINE_DEAD_STATUS)  # fmt: skip
    server = getattr(getattr(app, "state", None), "server", None)
    if server is not None:
        server.should_exit = True
    timer = threading.Timer(HARD_EXIT_S, _hard_exit)
    timer.daemon = True
    timer.start()


def _hard_exit() -> None:
    log.error("qwen35-serve: still running %.0f s after the engine died; exiting now", HARD_EXIT_S)
    logging.shutdown()
    os._exit(ENGINE_DEAD_STATUS)


async def _watch(app: object) -> None:
    while not _died.is_set():
        await asyncio.sleep(POLL_S)
        if not _stopping.is_set() and _errored(app):
            _declare_dead(app, "seen by the engine watch")
            return


def on_startup(app: object) -> None:
    """Start the engine watch (from the app's lifespan startup, inside the server's event loop)."""
    if getattr(getattr(app, "state", None), "engine_client", None) is None:
        return  # no engine in this app (a test app, a render-only server)
    loop = asyncio.get_running_loop()
    _record_stop_signals()
    task = loop.create_task(_watch(app))
    _tasks.add(task)
    task.add_done_callback(_tasks.discard)


def on_shutdown(app: object) -> None:
    """At lifespan shutdown: a stop that was not asked for, with the engine errored, is a death
    (vLLM's own handlers may have begun the stop before the watch polled)."""
    if not _stopping.is_set() and _errored(app):
        _declare_dead(app, "found at shutdown")
    for task in list(_tasks):
        task.cancel()
