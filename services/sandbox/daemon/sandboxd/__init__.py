"""sandboxd: the in-sandbox daemon of Berth.

Standard library only and compatible with Python 3.9, because it runs inside
arbitrary images: it is shipped as one zipapp (``services/sandbox/daemon/bundle.py``
builds it from this package), bind-mounted read-only and started as the
sandbox's first process, e.g.

    python3 /opt/berth/sandboxd.pyz --socket /run/berth/sandboxd.sock \
        --workspace /workspace --state-dir /run/berth/state

Wire protocol (version 1)
-------------------------
Every frame is a 4-byte big-endian unsigned length followed by that many bytes
of UTF-8 JSON (an object). Frames larger than ``MAX_FRAME_BYTES`` (96 MiB) are
a protocol error and close the connection; file writes carry at most
``MAX_WRITE_BYTES`` (64 MiB) of data, which base64 inflates to about 86 MiB.
Binary payloads travel base64-encoded in ``data_b64`` (``stdin_b64`` for exec).

The client opens with ``{"op": "hello", "v": 1}``. The daemon answers
``{"ok": true, "v": 1, "pid", "workspace", "root", "isolation"}`` or, for an
unsupported version, ``{"ok": false, "error": {...}}`` and closes.

Requests are ``{"id": <int>, "op": ..., ...}``. Every response frame carries
the request's ``id``; the last one has ``"final": true``. Requests run
concurrently, so a slow one never holds up another on the same connection.
``{"op": "cancel", "target": <id>}`` (``id`` optional) cancels a request; for
``exec`` that SIGKILLs the command's whole process tree, as does the client
connection closing. Failures are final frames
``{"id", "final": true, "error": {"code", "message"}}`` with ``code`` one of
``not_found``, ``invalid_argument``, ``permission_denied``,
``failed_precondition``, ``internal``; an error may add ``reason`` (a finer
cause callers act on, e.g. ``mcp_server_dead``) and ``param`` (the field).

Output is streamed as ``{"type": "chunk", "stream": "stdout"|"stderr",
"seq": n, "data_b64"}``; seq numbers are shared by both streams of one command
and count up from 0. Commands end with ``{"type": "exit", "exit_code",
"timed_out", "duration_ms"}``. ``exit_code`` is negative (``-signal``) for a
command killed by a signal, and 124 for an exec killed by its ``timeout_s``.

An exec's leftover background children keep running after it returns (their
later output is dropped); use ``process.start`` for work that should outlive a
request. Background processes start in their own session, outlive the
connection that started them, and keep their exit code after exiting;
``keepalive`` is recorded for the service (it keeps the sandbox from idle
pause) and never makes the daemon restart a process. ``process.kill``
signals the whole tree.

Operations: ``exec``, ``process.start``, ``process.attach``, ``process.list``,
``process.wait``, ``process.kill``, ``file.write``, ``file.read``,
``file.list``, ``file.stat``, ``file.mkdir``, ``file.remove``, ``mcp.start``,
``mcp.request``, ``mcp.notify``, ``mcp.subscribe``, ``mcp.list``,
``mcp.stop``, ``mcp.close_upstream``, ``mcp.upstream``, ``env.reload``,
``egress.relay``, ``net.connect`` (a connection's first request; the
connection then carries a TCP stream opened from inside the sandbox),
``ping``, ``shutdown``. See the ``_op_*`` methods for their fields.

``env.reload`` re-reads the sandbox's environment (``--env-file``, then
``--env``) for commands started from then on; running commands and MCP
servers keep theirs. A container started before its sandbox was known (the
docker backend's warm pool) learns the sandbox's variables this way. A
malformed file fails the request and keeps the old environment. An optional
``dormant_after_s`` sets the daemon's idle period from then on (a local warm
pool's daemon runs without one until it is claimed).

Dormancy (``--dormant-after``): after that long idle, with nothing running in
the sandbox, the daemon replaces itself (same PID) with a bare interpreter
holding its socket and connections, and becomes the daemon again when a
frame or a connection arrives (see ``dormant``). Clients see no protocol
change: a connection stays open and past its ``hello``.

Modules: ``protocol`` (frames, errors, request fields, shared with the
host-side client), ``workspace`` (paths and environment), ``processes``
(``exec``, ``process.*``), ``files`` (``file.*``), ``mcp`` (``mcp.*``),
``relay`` (``egress.relay``, ``net.connect``), ``server`` (connections, ``ping``,
``shutdown``, ``env.reload``), ``dormant`` (the idle form), ``cli`` (the
command line) and ``__main__`` (which picks one of the two).
"""
