"""The Session service: saved agents, sessions, turns, items, the per-session
event log, artifacts and the harness that runs turns.

Events (every one persisted with a gapless per-session ``sequence`` and a
unique ``event_id``; shapes are the SDK's ``AgentSessionEvent`` union):

- CreateSession: ``agent.session.created`` (session snapshot, status idle).
- input.message: ``agent.session.turn.created`` (turn ``queued``).
- a turn starts (FIFO, one per session): ``agent.session.turn.in_progress``,
  ``agent.session.in_progress``, then ``agent.session.turn.item.added`` for
  each user message of the turn.
- assistant text: ``turn.item.added`` (message, in_progress, phase
  ``commentary`` when tool calls follow, ``final_answer`` otherwise),
  ``turn.content_part.added``, ``turn.output_text.delta``,
  ``turn.output_text.done``, ``turn.content_part.done``, ``turn.item.done``.
- first environment tool of a turn while the environment is not ready:
  ``agent.session.environment.pending`` then ``.ready`` or ``.failed``.
- exec_command / read_file / write_file: ``turn.item.added``
  (command_execution, in_progress), ``agent.output.command_execution_output.delta``
  per output chunk (exec only), ``turn.item.done``.
- application function call: ``turn.item.added`` (function_call, complete
  arguments; the pending call is registered in the same transaction), then
  ``agent.session.requires_action`` (turn ``waiting``) unless the result is
  already there; on the result ``turn.item.done`` (function_call),
  ``turn.item.added`` (function_call_output), ``agent.session.in_progress``.
- MCP call: ``turn.item.added`` + ``turn.item.done`` of a failed mcp_call
  (MCP is not wired yet).
- turn end: [``error`` when failed], ``agent.session.turn.completed`` |
  ``.failed`` | ``.cancelled`` (with ``usage``), then ``agent.session.idle``,
  ``agent.session.budget_reached`` when the turn reached its root session's
  spend limit, or ``agent.session.failed`` when the session's environment
  setup failed.
  Items still open on a cancel or failure get ``turn.item.done`` with status
  ``incomplete`` (or ``failed``) first.
"""
