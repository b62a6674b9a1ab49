"""How ``mars-vllm serve`` lives and dies: engine death, orphans, socket files.

vLLM 0.32 on its own (measured, issue #13): when the EngineCore dies, in-flight calls get a
500 ``EngineCore encountered an issue`` (streams: an SSE error with code 500), the server
shuts itself down and the command exits with status **0**, so a supervisor that restarts on
failure does not; when the API-server process is SIGKILLed, the EngineCore and its worker
stay orphaned for minutes; and the engine's events socket file stays in the temp directory.
Each piece here uses a documented extension point or plain process mechanics:

* :class:`EngineDeathMiddleware`: an ASGI middleware given to vLLM's own ``--middleware``
  option. Once the engine client reports itself errored, a 5xx answer becomes a **503 with
  Retry-After** (the call may succeed after a restart) and a stream's error event gets code
  503; at shutdown it tells a death from a requested stop, so that :func:`exit_status` makes
  the command fail only for the former.
* :func:`die_with_parent`: a vLLM general plugin; the EngineCore and the workers ask the
  kernel for SIGKILL when their parent dies (``PR_SET_PDEATHSIG``).
* :func:`remove_ipc_at_exit`: the serving process removes the ``ipc://`` file it named.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import multiprocessing
import os
import signal

from mars import launch

logger = logging.getLogger(__name__)

MIDDLEWARE = "mars.engine.serve.lifecycle.EngineDeathMiddleware"
#: seconds clients are told to wait after an engine death: a supervisor must restart the
#: whole server (the model loads again), so retrying sooner only adds load; an order of
#: magnitude, not a tuned value, and the sidecar answers its own 503s while the engine is
#: down with its --retry-after
RETRY_AFTER_S = 5
DEATH_MESSAGE = ("the inference engine died; the server is shutting down and will not finish "
                 "this request: retry once it is back")
STOP_MESSAGE = ("the server is shutting down (draining for --shutdown-timeout): it takes no new "
                "request and ends what did not finish in time; retry on another instance or "
                "once it is back")
#: after the engine client's shutdown returned, a call still running gets this long to end
#: by itself before the middleware ends it (vLLM delivers what it has within milliseconds)
HANGING_GRACE_S = 1.0

_died = False
#: vLLM asked the engine client to shut down (set by the wrapper _on_startup installs)
_requested = False
#: set once that shutdown has returned: the engine is gone, nothing more will be delivered
_stopped: asyncio.Event | None = None


def engine_died() -> bool:
    """Whether the engine failed during this process's life (decided at server shutdown)."""
    return _died


def exit_status() -> int:
    """The status ``mars-vllm serve`` should exit with once vLLM's server has returned."""
    return 1 if _died else 0


def _client(scope):
    try:
        return scope["app"].state.engine_client
    except (KeyError, AttributeError):
        return None


def _errored(scope) -> bool:
    client = _client(scope)
    return bool(client is not None and client.errored)


def _on_startup(scope) -> None:
    """Note when vLLM asks its engine client to shut down (SIGTERM, Ctrl-C): wrap the
    client's ``shutdown`` on this instance. After the fact a requested shutdown and an engine
    death look alike (client errored, engines gone; a drain that overran
    ``--shutdown-timeout`` even ends in SIGKILL), so the request must be seen as it
    happens."""
    global _requested, _stopped
    _requested = False
    client = _client(scope)
    if client is None:
        return
    original = client.shutdown
    loop = asyncio.get_running_loop()
    stopped = _stopped = asyncio.Event()

    def shutdown(*args, **kwargs):
        global _requested
        _requested = True
        try:
            return original(*args, **kwargs)
        finally:  # vLLM calls this from an executor thread
            loop.call_soon_threadsafe(stopped.set)

    client.shutdown = shutdown


def _on_shutdown(scope) -> None:
    """Was the server stopped because the engine failed (errored with no shutdown asked)?"""
    global _died
    if _requested or not _errored(scope):
        return
    _died = True
    logger.error("mars: the engine died; the command will exit with status 1")


def _error_json(code: int) -> bytes:
    message = STOP_MESSAGE if _requested else DEATH_MESSAGE
    return json.dumps({"error": {"message": message, "type": "service_unavailable",
                                 "param": None, "code": code}}).encode()


class _Response:
    """What one request has sent so far (the middleware must end it correctly)."""

    __slots__ = ("started", "sse", "finished", "replacing")

    def __init__(self) -> None:
        self.started = self.sse = self.finished = self.replacing = False


class EngineDeathMiddleware:
    """Turns vLLM's answers after an engine death or a stop into "unavailable, retry later",
    and ends the calls vLLM would leave hanging.

    Why a middleware and not an exception handler: a stream's failure is not raised (its 200
    was sent), vLLM writes it as an SSE ``error`` event, so only the bytes can be fixed. The
    engine's state is read from ``app.state.engine_client`` (set by vLLM at start-up); a 5xx
    while that client is healthy is left as vLLM wrote it.

    Hanging calls: when a requested shutdown stops the engine (the drain time ran out), vLLM
    cancels its output handler and the calls still in flight wait for outputs that never
    come -- their clients hang until their own timeout (measured: a stream hung 60 s, until
    the client gave up). Once the engine client's shutdown has returned, a call that does not
    end within :data:`HANGING_GRACE_S` is cancelled and answered here: 503, or for a stream
    that already started, an SSE error event and ``[DONE]``.
    """

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            async def receive_lifespan():
                message = await receive()
                if message.get("type") == "lifespan.startup":
                    _on_startup(scope)
                elif message.get("type") == "lifespan.shutdown":
                    _on_shutdown(scope)
                return message

            await self.app(scope, receive_lifespan, send)
            return
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        state = _Response()

        async def send_checked(message) -> None:
            kind = message["type"]
            if kind == "http.response.start":
                state.started = True
                headers = message.get("headers", [])
                state.sse = any(k.lower() == b"content-type" and v.startswith(b"text/event-stream")
                                for k, v in headers)
                if message["status"] >= 500 and _errored(scope):
                    state.replacing = True
                    message = {**message, "status": 503, "headers": _error_headers(headers)}
            elif kind == "http.response.body":
                if state.replacing:
                    if message.get("more_body", False):
                        return  # swallow vLLM's body; ours goes out with the last message
                    message = {**message, "body": _error_json(503)}
                else:
                    message = self._fix_stream_error(scope, message)
                state.finished = not message.get("more_body", False)
            await send(message)

        if _requested and scope.get("method") == "POST":
            # draining: vLLM would accept the call and answer an empty "abort" completion
            body = _error_json(503)
            await send({"type": "http.response.start", "status": 503,
                        "headers": _error_headers([])})
            await send({"type": "http.response.body", "body": body})
            return
        stopped = _stopped
        if stopped is None:
            await self.app(scope, receive, send_checked)
            return
        call = asyncio.ensure_future(self.app(scope, receive, send_checked))
        stop = asyncio.ensure_future(stopped.wait())
        try:
            await asyncio.wait({call, stop}, return_when=asyncio.FIRST_COMPLETED)
            if not call.done():
                done, _ = await asyncio.wait({call}, timeout=HANGING_GRACE_S)
                if not done:
                    call.cancel()
                    with contextlib.suppress(BaseException):
                        await call
                    await self._end(state, send)
                    return
            call.result()  # re-raise what the app raised
        finally:
            stop.cancel()
            if not call.done():  # our own task was cancelled (client gone, server stop)
                call.cancel()

    @staticmethod
    async def _end(state: _Response, send) -> None:
        """Answer a call vLLM left hanging after the engine stopped."""
        if state.finished:
            return
        if not state.started:
            body = _error_json(503)
            await send({"type": "http.response.start", "status": 503,
                        "headers": _error_headers([])})
            await send({"type": "http.response.body", "body": body})
        elif state.sse:
            await send({"type": "http.response.body",
                        "body": b"data: " + _error_json(503) + b"\n\ndata: [DONE]\n\n"})
        else:
            await send({"type": "http.response.body", "body": b""})

    def _fix_stream_error(self, scope, message):
        body = message.get("body", b"")
        if b'data: {"error"' not in body or not _errored(scope):
            return message
        frames = body.split(b"\n\n")
        fixed = [b"data: " + _error_json(503) if f.startswith(b'data: {"error"') else f
                 for f in frames]
        return {**message, "body": b"\n\n".join(fixed)}


def _error_headers(headers) -> list[tuple[bytes, bytes]]:
    body = _error_json(503)
    out = [(k, v) for k, v in headers
           if k.lower() not in (b"content-length", b"content-type", b"retry-after")]
    return out + [(b"content-type", b"application/json"),
                  (b"content-length", str(len(body)).encode()),
                  (b"retry-after", str(RETRY_AFTER_S).encode())]


#: set by ``mars-vllm serve`` for its children: only then does the plugin arm anything
DIE_WITH_PARENT_ENV = "MARS_DIE_WITH_PARENT"


def die_with_parent() -> bool:
    """vLLM general plugin (entry point ``vllm.general_plugins``): vLLM loads it in its
    EngineCore and in every worker process. There, ask the kernel to SIGKILL the process the
    moment its parent dies (Linux ``PR_SET_PDEATHSIG``): EngineCore with its API server,
    a worker with its EngineCore; and leave the server's process group
    (:func:`_leave_process_group`). Returns whether it was armed.

    SIGKILL, not SIGTERM: vLLM's EngineCore answers SIGTERM by draining for
    ``--shutdown-timeout``, a bound its API server enforces; with the server gone nothing
    would, and a long stream could hold the GPU for minutes. Armed only in processes of
    ``mars-vllm serve`` (:data:`DIE_WITH_PARENT_ENV`), and only in multiprocessing children
    (EngineCore, workers, the extra API servers of ``--api-server-count``), never in the
    main API server or in a process that embeds vLLM (the offline engine, tests); forked
    children are armed by :func:`arm_forked_children` instead.
    """
    parent = multiprocessing.parent_process()
    if os.environ.get(DIE_WITH_PARENT_ENV) != "1":
        return False
    arm_forked_children()
    if parent is None:
        return False
    armed = launch.die_with_parent(signal.SIGKILL)
    if armed and not parent.is_alive():  # it died before prctl took effect
        os.kill(os.getpid(), signal.SIGKILL)
    if armed:
        _leave_process_group()
    return armed


_fork_hook = False


def arm_forked_children() -> None:
    """Arm every child this process forks as :func:`die_with_parent` arms a spawned one.

    vLLM loads its general plugins once per process and a forked child inherits the "loaded"
    flag, so the plugin never runs in an EngineCore or worker that was forked -- vLLM's
    default start method on GPUs (it spawns only on CPU, where the suite runs, or once CUDA
    is initialised). An at-fork hook runs in the child of every ``os.fork`` this process
    (and, inherited, its forked children) makes, multiprocessing's included; ``subprocess``
    children exec at once and are not touched. Called by ``mars-vllm serve`` and by the
    plugin in its spawned children. Idempotent."""
    global _fork_hook
    if _fork_hook or not hasattr(os, "register_at_fork"):
        return
    _fork_hook = True

    def _in_child() -> None:
        if launch.die_with_parent(signal.SIGKILL, expected_parent=os.getppid()):
            _leave_process_group()

    os.register_at_fork(after_in_child=_in_child)


def _leave_process_group() -> None:
    """Move this engine process into a process group of its own.

    A signal to the server's process group (Ctrl-C in a terminal, ``kill -TERM -PGID``, a
    supervisor that signals the group) reached vLLM's worker too, which exits at once on
    SIGTERM / SIGINT: an engine death in the middle of the drain the API server had just
    begun (in-flight calls got 503, the command exited 1). Out of the group, the engine
    hears only its own server, which drains for ``--shutdown-timeout`` and then stops it;
    it still dies with its parent (``PR_SET_PDEATHSIG``), so it cannot outlive the server.
    Only safe because the death signal is armed first: a process out of the group is no
    longer reached by a group SIGKILL either. A systemd unit with the default
    ``KillMode=control-group`` signals every process of the cgroup, groups notwithstanding
    (docs/sidecar.md: use ``KillMode=mixed``).
    """
    with contextlib.suppress(OSError):  # already a group or session leader: nothing to do
        os.setpgid(0, 0)


def propagate_startup_interrupts() -> None:
    """Let a stop during the engine's start-up handshake stop the start-up.

    vLLM turns SIGTERM during start-up into ``KeyboardInterrupt`` so that the start-up
    unwinds, but the context manager around the front-end's handshake socket
    (``vllm.utils.network_utils.zmq_socket_ctx``, used by ``launch_core_engines``) swallows
    ``KeyboardInterrupt``. A stop that lands while the front-end waits for the EngineCore's
    hello (the first seconds of every start) therefore ended the handshake half-way and went
    on: the front-end then waited for a ready message, the EngineCore for the rest of the
    handshake, each for ``VLLM_ENGINE_READY_TIMEOUT_S`` (600 s). Found by the test of a
    sidecar that dies during start-up, one run in three on this machine (plain ``vllm
    serve`` behaves the same under a SIGTERM then). The wrapper keeps vLLM's clean-up (the
    ZMQ context is destroyed as before) and raises the interrupt again after it.
    """
    import vllm.v1.engine.utils as engine_utils

    original = engine_utils.zmq_socket_ctx
    if getattr(original, "_mars_propagates", False):
        return

    @contextlib.contextmanager
    def zmq_socket_ctx(*args, **kwargs):
        interrupted: KeyboardInterrupt | None = None
        with original(*args, **kwargs) as sock:
            try:
                yield sock
            except KeyboardInterrupt as exc:
                interrupted = exc
        if interrupted is not None:
            raise interrupted

    zmq_socket_ctx._mars_propagates = True  # type: ignore[attr-defined]
    engine_utils.zmq_socket_ctx = zmq_socket_ctx


def sweep_stale_ipc(directory: str, pattern: str = "mars-engine-*.ipc",
                    min_age_s: float = 30.0) -> list[str]:
    """Remove socket files that nothing listens on any more; returns the removed paths.

    :func:`remove_ipc_at_exit` cannot run when a server is killed (SIGKILL, the OOM killer),
    so such runs leave their events socket behind. A socket file is stale when a connection
    to it is refused; a live server's (any port) accepts, and anything that is not a socket
    is left alone. A file younger than ``min_age_s`` is left too (a server starting beside
    us may be between its bind and its listen), and one replaced between the probe and the
    unlink (another inode) is not touched.
    """
    import glob
    import socket
    import stat
    import time

    removed = []
    for path in glob.glob(os.path.join(directory, pattern)):
        try:
            st = os.lstat(path)
            if not stat.S_ISSOCK(st.st_mode) or time.time() - st.st_mtime < min_age_s:
                continue
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
                probe.settimeout(1.0)
                probe.connect(path)
        except ConnectionRefusedError:
            with contextlib.suppress(OSError):
                if os.lstat(path).st_ino == st.st_ino:
                    os.unlink(path)
                    removed.append(path)
        except OSError:
            continue  # gone meanwhile, not ours to touch, or busy: leave it
    return removed


def remove_ipc_at_exit(endpoint: str) -> None:
    """Unlink an ``ipc://`` socket file when this process exits.

    The EngineCore binds the events socket, but vLLM ends that process without running its
    shutdown hooks, so the file would stay in the temp directory after every run; the
    serving process (which chose the name) removes it instead.
    """
    if not endpoint.startswith("ipc://"):
        return
    import atexit

    path = endpoint[len("ipc://"):]

    def _unlink() -> None:
        with contextlib.suppress(OSError):
            os.unlink(path)

    atexit.register(_unlink)
