"""The Session service's logic: saved agents, sessions, input events, turns,
items and artifacts. Plain async methods, testable without gRPC; every method
scopes by the caller's organization (``current_org()``), and another
organization's resource is ``NotFound``.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, cast

from sqlalchemy import Table, delete, exists, insert, select, update
from sqlalchemy.ext.asyncio import AsyncSession

from berth.common.v1 import common_pb2
from berth.environment.v1 import environment_pb2
from services.core.context import current_org
from services.core.errors import BerthError, Conflict, FailedPrecondition, InvalidArgument, NotFound, SessionActive
from services.core.ids import new_id
from services.core.logging import get_logger
from services.session import repository as repo
from services.session import views, wire
from services.session.agents import (
    apply_agent_update,
    apply_session_agent_update,
    normalize_agent_create,
    render_saved_agent,
    resolve_session_agent,
    validate_metadata,
)
from services.session.artifacts import BlobStore
from services.session.environment_client import EnvironmentClient
from services.session.mcp_connections import McpConnections
from services.session.models import AgentRow, ArtifactRow, EventRow, FunctionCallRow, ItemRow, SessionRow, TurnRow
from services.session.repository import ACTIVE_TURN_STATUSES, Page
from services.session.runner import ClaimedTurn, TurnRunner
from services.session.store import Store, Unit

__all__ = ["SessionDomain", "AgentView", "CreatedSession", "SubmitResult", "UnknownToolCall", "parse_body"]

log = get_logger(__name__)

# Built once (see services/session/repository.py on prepared statements).
_INSERT_TURN = insert(cast(Table, TurnRow.__table__))

_NETWORK = {
    "enabled": common_pb2.NETWORK_ACCESS_ENABLED,
    "disabled": common_pb2.NETWORK_ACCESS_DISABLED,
    "restricted": common_pb2.NETWORK_ACCESS_RESTRICTED,
}
# Keys of an inline openai_hosted environment that configure setup.
_HOSTED_CONFIG_KEYS = {
    "capability_directories",
    "container_size",
    "desktop",
    "env",
    "environment_template_id",
    "files",
    "network",
    "packages",
    "plugins",
    "setup_commands",
    "skills",
}


class UnknownToolCall(InvalidArgument):
    """A tool result for a call that is not (yet) registered. The gateway
    renders it with code ``invalid_request_error``: the SDK's tool dispatcher
    retries on exactly that code plus the message ``Unknown pending tool call:
    <call_id>`` (openai/lib/streaming/agents/_tools.py)."""

    reason = "UNKNOWN_TOOL_CALL"


def parse_body(text: str, param: str = "body") -> dict[str, Any]:
    try:
        value = json.loads(text or "{}")
    except ValueError as exc:
        raise InvalidArgument(f"{param} is not valid JSON", param=param) from exc
    if not isinstance(value, dict):
        raise InvalidArgument(f"{param} must be a JSON object", param=param)
    return value


@dataclass
class AgentView:
    row: AgentRow
    wire: dict[str, Any]


@dataclass
class CreatedSession:
    view: views.SessionView
    turn_id: str
    created_sequence: int


@dataclass
class SubmitResult:
    turn_ids: list[str]
    sequence: int


def _agent_view(row: AgentRow) -> AgentView:
    config = json.loads(row.config_json)
    return AgentView(
        row, render_saved_agent(row.id, row.name, json.loads(row.metadata_json), config, row.created_at, row.updated_at)
    )


def _user_messages(value: Any, param: str) -> list[list[dict[str, Any]]]:
    """Input messages as lists of content parts. A string is one message."""
    if isinstance(value, str):
        if not value:
            raise InvalidArgument(f"{param} must not be empty", param=param)
        return [[{"type": "input_text", "text": value}]]
    if not isinstance(value, list) or not value:
        raise InvalidArgument(f"{param} must be a non-empty list of messages", param=param)
    messages: list[list[dict[str, Any]]] = []
    for i, message in enumerate(value):
        p = f"{param}[{i}]"
        if not isinstance(message, dict):
            raise InvalidArgument(f"{p} must be an object", param=p)
        if message.get("role") != "user":
            raise InvalidArgument(f"{p}.role must be 'user'", param=f"{p}.role")
        if message.get("type", "message") != "message":
            raise InvalidArgument(f"{p}.type must be 'message'", param=f"{p}.type")
        content = message.get("content")
        if isinstance(content, str):
            content = [{"type": "input_text", "text": content}]
        messages.append(_parts(content, f"{p}.content"))
    return messages


def _parts(content: Any, param: str) -> list[dict[str, Any]]:
    if not isinstance(content, list) or not content:
        raise InvalidArgument(f"{param} must be a non-empty list", param=param)
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        pp = f"{param}[{j}]"
        if isinstance(part, dict) and part.get("type") == "input_text" and isinstance(part.get("text"), str):
            parts.append({"type": "input_text", "text": part["text"]})
        elif isinstance(part, dict) and part.get("type") == "input_image" and isinstance(part.get("image_url"), str):
            parts.append({"type": "input_image", "image_url": part["image_url"]})
        else:
            raise InvalidArgument(f"{pp} must be an input_text or input_image part", param=pp)
    return parts


def _str_list(value: Any, param: str) -> list[str]:
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise InvalidArgument(f"{param} must be a list of strings", param=param)
    return list(value)


def environment_config(env: dict[str, Any]) -> environment_pb2.EnvironmentConfig:
    """An inline openai_hosted environment as the Environment service's config."""
    config = environment_pb2.EnvironmentConfig()
    if env.get("environment_template_id"):
        raise InvalidArgument(
            "environment templates are not supported for sessions yet", param="environment.environment_template_id"
        )
    desktop = env.get("desktop")
    if isinstance(desktop, dict) and desktop.get("enabled"):
        raise InvalidArgument("desktop environments are not supported", param="environment.desktop.enabled")
    for i, f in enumerate(env.get("files") or []):
        p = f"environment.files[{i}]"
        if not isinstance(f, dict) or not isinstance(f.get("path"), str):
            raise InvalidArgument(f"{p}.path is required", param=f"{p}.path")
        if f.get("type") == "inline":
            try:
                data = base64.b64decode(str(f.get("data", "")), validate=True)
            except (binascii.Error, ValueError) as exc:
                raise InvalidArgument(f"{p}.data must be base64", param=f"{p}.data") from exc
            config.files.append(environment_pb2.InitialFile(path=f["path"], data=data))
        elif f.get("type") == "file_id" and isinstance(f.get("file_id"), str):
            config.files.append(environment_pb2.InitialFile(path=f["path"], file_id=f["file_id"]))
        else:
            raise InvalidArgument(f"{p}.type must be 'inline' or 'file_id'", param=f"{p}.type")
    variables = env.get("env") or {}
    if not isinstance(variables, dict) or not all(isinstance(v, str) for v in variables.values()):
        raise InvalidArgument("environment.env must map strings to strings", param="environment.env")
    config.env.update({str(k): v for k, v in variables.items()})
    packages = env.get("packages") or {}
    config.packages.CopyFrom(
        environment_pb2.Packages(
            python=_str_list(packages.get("python"), "environment.packages.python"),
            npm=_str_list(packages.get("npm"), "environment.packages.npm"),
            system=_str_list(packages.get("system"), "environment.packages.system"),
        )
    )
    for i, command in enumerate(env.get("setup_commands") or []):
        if not isinstance(command, dict) or not isinstance(command.get("command"), str) or not command["command"]:
            raise InvalidArgument("setup commands need a command", param=f"environment.setup_commands[{i}].command")
        config.setup_commands.append(environment_pb2.SetupCommand(command=command["command"], cwd=command.get("cwd") or ""))
    network = env.get("network")
    if network is not None:
        access = network.get("access") if isinstance(network, dict) else None
        if access not in _NETWORK:
            raise InvalidArgument("network.access must be enabled, disabled or restricted", param="environment.network.access")
        allowed = _str_list(network.get("allowed_domains"), "environment.network.allowed_domains")
        blocked = _str_list(network.get("blocked_domains"), "environment.network.blocked_domains")
        if (allowed or blocked) and access != "restricted":
            raise InvalidArgument("domain lists require access 'restricted'", param="environment.network.access")
        if allowed and blocked:
            raise InvalidArgument("allowed_domains and blocked_domains cannot both be set", param="environment.network")
        config.network.CopyFrom(common_pb2.NetworkPolicy(access=_NETWORK[access], allowed_domains=allowed, blocked_domains=blocked))
    if env.get("skills"):
        config.skills_json = json.dumps(env["skills"])
    if env.get("plugins"):
        config.plugins_json = json.dumps(env["plugins"])
    config.capability_directories.extend(_str_list(env.get("capability_directories"), "environment.capability_directories"))
    size = env.get("container_size")
    if size is not None:
        if size not in ("small", "medium", "large"):
            raise InvalidArgument("container_size must be small, medium or large", param="environment.container_size")
        config.container_size = size
    return config


class SessionDomain:
    def __init__(
        self,
        store: Store,
        env_client: EnvironmentClient | None,
        runner: TurnRunner,
        blobs: BlobStore,
        *,
        mcp: McpConnections | None = None,
        poll_s: float = 0.2,
    ) -> None:
        self.store = store
        self.env = env_client
        self.runner = runner
        self.blobs = blobs
        self.mcp = mcp
        self.poll_s = poll_s

    # ===== agents =====================================================================
    async def create_agent(self, body: dict[str, Any]) -> AgentView:
        org = current_org()
        name, metadata, config = normalize_agent_create(body)
        now = time.time()
        row = AgentRow(
            id=new_id("agent"),
            org_id=org,
            name=name,
            config_json=json.dumps(config),
            metadata_json=json.dumps(metadata),
            version=1,
            created_at=now,
            updated_at=now,
        )
        async def insert(u: Unit) -> None:
            u.session.add(row)

        await self.store.transact(insert)
        return _agent_view(row)

    async def get_agent(self, agent_id: str) -> AgentView:
        org = current_org()
        row = await self.store.query(lambda s: repo.get_agent(s, org, agent_id))
        return _agent_view(row)

    async def list_agents(self, page: Page) -> tuple[list[AgentView], bool]:
        scope = [AgentRow.org_id == current_org()]
        rows, more = await self.store.query(lambda s: repo.paginate(s, AgentRow, scope, page))
        return [_agent_view(r) for r in rows], more

    async def update_agent(self, agent_id: str, body: dict[str, Any]) -> AgentView:
        org = current_org()

        async def update(u: Unit) -> AgentView:
            row = await repo.get_agent(u.session, org, agent_id)
            name, metadata, config = apply_agent_update(
                row.name, json.loads(row.metadata_json), json.loads(row.config_json), body
            )
            row.name = name
            row.metadata_json = json.dumps(metadata)
            row.config_json = json.dumps(config)
            row.version += 1
            row.updated_at = time.time()
            return _agent_view(row)

        return await self.store.transact(update)

    async def delete_agent(self, agent_id: str) -> str:
        """Sessions created from the agent keep their snapshot."""
        org = current_org()

        async def delete_row(u: Unit) -> None:
            await u.session.delete(await repo.get_agent(u.session, org, agent_id))

        await self.store.transact(delete_row)
        return agent_id

    # ===== sessions ===================================================================
    async def _environment(self, row: SessionRow) -> environment_pb2.Environment | None:
        if row.environment_kind != "hosted" or self.env is None:
            return None
        try:
            return await self.env.get_environment(row.environment_id)
        except BerthError as exc:
            log.warning("environment_lookup_failed", environment_id=row.environment_id, reason=exc.reason)
            return None

    async def _bind_environment(
        self, env_param: Any, session_id: str, vault_ids: list[str]
    ) -> tuple[str, str, environment_pb2.Environment | None]:
        """Returns (kind, environment_id, environment) after creating or attaching."""
        if env_param is None:
            return "none", "", None
        if not isinstance(env_param, dict):
            raise InvalidArgument("environment must be an object", param="environment")
        kind = env_param.get("type")
        if kind == "none":
            return "none", "", None
        if kind not in ("openai_hosted", "reference"):
            raise InvalidArgument(f"environment type {kind!r} is not supported", param="environment.type")
        if self.env is None:
            raise FailedPrecondition("no environment service is configured", param="environment")
        environment_id = env_param.get("environment_id")
        if kind == "reference" or environment_id is not None:
            if not isinstance(environment_id, str) or not environment_id:
                raise InvalidArgument("environment.environment_id is required", param="environment.environment_id")
            extra = sorted(k for k in env_param if k not in ("type", "environment_id") and env_param[k] is not None)
            if extra:
                raise InvalidArgument(
                    f"an environment reference cannot be combined with {extra[0]}", param=f"environment.{extra[0]}"
                )
            environment = await self.env.attach_session(environment_id, session_id)
            return "hosted", environment.id or environment_id, environment
        config = environment_config(env_param)
        environment = await self.env.create_environment(config, vault_ids=vault_ids, owner_session_id=session_id)
        return "hosted", environment.id, environment

    async def _enqueue_turn(self, u: Unit, row: SessionRow, messages: list[list[dict[str, Any]]]) -> str:
        """Queues a turn; it runs after the active one (FIFO). Its user messages
        become items when it starts, so history stays in conversation order."""
        now = time.time()
        values: dict[str, Any] = {
            "id": new_id("turn"),
            "session_id": row.id,
            "org_id": row.org_id,
            "agent_id": row.agent_id,
            "status": "queued",
            "created_at": now,
            "started_at": None,
            "completed_at": None,
            "error_code": "",
            "error_message": "",
            "usage_json": "",
            "cancel_requested": False,
            "worker_id": "",
            "lease_expires_at": 0.0,
            "input_json": json.dumps(messages),
            "next_output_index": 0,
        }
        # A Core insert: the ORM's unit of work costs more than the statement.
        await u.session.execute(_INSERT_TURN, values)
        turn = TurnRow(**values)
        await u.emit(row.id, wire.turn_event("agent.session.turn.created", views.turn_json(turn)), touch={"last_active_at": now})
        return turn.id

    async def create_session(self, body: dict[str, Any]) -> CreatedSession:
        org = current_org()
        agent_param = body.get("agent")
        agent_id = body.get("agent_id")
        if isinstance(agent_param, str):
            agent_id, agent_param = agent_param, None
        if agent_param is not None and not isinstance(agent_param, dict):
            raise InvalidArgument("agent must be an object", param="agent")
        name: str | None = None
        if agent_id:
            if not isinstance(agent_id, str):
                raise InvalidArgument("agent_id must be a string", param="agent_id")
            saved_id = agent_id
            saved = await self.store.query(lambda s: repo.get_agent(s, org, saved_id))
            name = saved.name
            config = resolve_session_agent(json.loads(saved.config_json), agent_param)
        else:
            if agent_param is None:
                raise InvalidArgument("agent or agent_id is required", param="agent")
            agent_id = new_id("agent")
            config = resolve_session_agent(None, agent_param)
        metadata = validate_metadata(body.get("metadata"))
        vault_ids = _str_list(body.get("vault_ids"), "vault_ids")
        raw_input = body.get("input")
        messages = _user_messages(raw_input, "input") if raw_input is not None else []

        session_id = new_id("sess")
        kind, environment_id, environment = await self._bind_environment(body.get("environment"), session_id, vault_ids)
        now = time.time()
        row = SessionRow(
            id=session_id,
            org_id=org,
            agent_id=agent_id,
            agent_config_json=json.dumps({"id": agent_id, "name": name, "config": config}),
            environment_kind=kind,
            environment_id=environment_id,
            status="idle",
            error="",
            metadata_json=json.dumps(metadata),
            vault_ids_json=json.dumps(vault_ids),
            usage_json="",
            created_at=now,
            last_active_at=now,
            event_seq=0,
            active_turn_id=None,
        )

        async def insert(u: Unit) -> tuple[views.SessionView, int, str]:
            u.session.add(row)
            await u.session.flush()
            # An environment whose setup already failed shows on the new session at once.
            view = await views.session_view(u.session, row, environment)
            (created,) = await u.emit(session_id, wire.session_event("agent.session.created", view.wire))
            turn_id = await self._enqueue_turn(u, row, messages) if messages else ""
            return view, created.sequence, turn_id

        try:
            view, created_sequence, turn_id = await self.store.transact(insert)
        except BaseException:
            if kind == "hosted" and self.env is not None:
                await self._detach_quietly(environment_id, session_id)
            raise
        if turn_id:
            self.runner.kick(session_id, org)
        log.info("session_created", session_id=session_id, environment_id=environment_id or None)
        return CreatedSession(view, turn_id, created_sequence)

    async def _detach_quietly(self, environment_id: str, session_id: str) -> None:
        assert self.env is not None
        try:
            await asyncio.shield(self.env.detach_session(environment_id, session_id))
        except Exception:
            log.warning("environment_detach_failed", environment_id=environment_id, session_id=session_id, exc_info=True)

    async def get_session(self, session_id: str) -> views.SessionView:
        org = current_org()
        row = await self.store.query(lambda s: repo.get_session(s, org, session_id))
        environment = await self._environment(row)
        return await self.store.query(lambda s: views.session_view(s, row, environment))

    async def list_sessions(self, page: Page, agent_id: str = "") -> tuple[list[views.SessionView], bool]:
        scope = [SessionRow.org_id == current_org(), SessionRow.status != "deleting"]
        if agent_id:
            scope.append(SessionRow.agent_id == agent_id)
        rows, more = await self.store.query(lambda s: repo.paginate(s, SessionRow, scope, page))
        environments = await asyncio.gather(*(self._environment(r) for r in rows))

        async def render(s: AsyncSession) -> list[views.SessionView]:
            return [await views.session_view(s, r, e) for r, e in zip(rows, environments, strict=True)]

        return await self.store.query(render), more

    async def update_session(self, session_id: str, body: dict[str, Any]) -> views.SessionView:
        org = current_org()

        async def update_row(u: Unit) -> None:
            row = await repo.get_session(u.session, org, session_id)
            if "metadata" in body:
                row.metadata_json = json.dumps(validate_metadata(body["metadata"]))
            if body.get("agent") is not None:
                snap = views.snapshot(row)
                snap["config"] = apply_session_agent_update(snap["config"], body["agent"])
                row.agent_config_json = json.dumps(snap)

        await self.store.transact(update_row)
        return await self.get_session(session_id)

    async def delete_session(self, session_id: str) -> str:
        """Refuses while a turn is queued or running. Detaches the environment
        (a never-shared private one is deleted with its sandbox by the
        Environment service; a shared one closes the upstream of every HTTP
        MCP label the session used, even though peers share it), closes the
        session's own MCP connections, then deletes turns, items, events and
        artifacts. Stdio MCP servers keep running."""
        org = current_org()

        async def mark(u: Unit) -> tuple[SessionRow, str]:
            row = await repo.get_session(u.session, org, session_id)
            busy = (
                await u.session.execute(
                    select(exists().where(TurnRow.session_id == session_id, TurnRow.status.in_(ACTIVE_TURN_STATUSES)))
                )
            ).scalar()
            if busy or row.active_turn_id is not None:
                raise SessionActive(f"session {session_id} has a turn in progress; cancel it first", param="session_id")
            previous = row.status
            # New input is refused from here on (the session reads as absent).
            row.status = "deleting"
            return row, previous

        row, previous_status = await self.store.transact(mark)
        if row.environment_kind == "hosted" and self.env is not None:
            try:
                await self.env.detach_session(row.environment_id, session_id)
            except BerthError as exc:
                if not isinstance(exc, NotFound):

                    async def restore(u: Unit) -> None:
                        await u.session.execute(
                            update(SessionRow).where(SessionRow.id == session_id).values(status=previous_status)
                        )

                    await self.store.transact(restore)
                    raise
        if self.mcp is not None:
            await self.mcp.close_session(session_id)
        self.runner.forget(session_id)

        async def remove(u: Unit) -> list[str]:
            shas = await repo.delete_session_rows(u.session, session_id)
            u.wake_key(f"events:{session_id}")
            return await repo.unreferenced_blobs(u.session, shas)

        self.blobs.delete(await self.store.transact(remove))
        log.info("session_deleted", session_id=session_id)
        return session_id

    # ===== input ======================================================================
    async def submit_events(self, session_id: str, events: Any) -> SubmitResult:
        if not isinstance(events, list) or not events:
            raise InvalidArgument("events must be a non-empty list", param="events")
        org = current_org()
        turn_ids: list[str] = []
        kick = False
        cancel: list[str] = []

        started: ClaimedTurn | None = None

        async def apply(u: Unit) -> int:
            nonlocal kick, started
            row = await repo.get_session(u.session, org, session_id)
            for i, event in enumerate(events):
                p = f"events[{i}]"
                if not isinstance(event, dict):
                    raise InvalidArgument(f"{p} must be an object", param=p)
                kind = event.get("type")
                if kind == "agent.session.input.message":
                    turn_ids.append(await self._enqueue_turn(u, row, _user_messages(event.get("input"), f"{p}.input")))
                    kick = True
                elif kind == "agent.session.input.cancel":
                    turn_id = await self._request_cancel(u, row)
                    if turn_id:
                        turn_ids.append(turn_id)
                        cancel.append(turn_id)
                elif kind == "agent.session.input.tool_result":
                    turn_ids.append(await self._answer_call(u, row, event, p))
                elif kind in (
                    "agent.session.input.mcp_approval_request_result",
                    "agent.session.input.computer_use_approval_request_result",
                ):
                    raise InvalidArgument(
                        f"there is no pending approval request {event.get('request_id')!r}", param=f"{p}.request_id"
                    )
                else:
                    raise InvalidArgument(f"unsupported input event type {kind!r}", param=f"{p}.type")
            # The loaded row follows the counter updates of this transaction.
            sequence = row.event_seq
            if kick and row.active_turn_id is None:
                # An idle session starts its turn in this same transaction.
                started = await self.runner.start_in(u, org, session_id)
            return sequence

        sequence = await self.store.transact(apply)
        for turn_id in cancel:
            self.runner.cancel_local(turn_id)
        if started is not None:
            self.runner.run_started(started)
        elif kick:
            self.runner.kick(session_id, org)
        return SubmitResult(list(dict.fromkeys(turn_ids)), sequence)

    async def _request_cancel(self, u: Unit, row: SessionRow) -> str:
        """Cancels the session's active turn; queued turns stay queued and run
        next (the SDK documents input.cancel as cancelling the active turn).
        Without an active turn this is a no-op."""
        turn_id = row.active_turn_id
        if turn_id is None:
            return ""
        await u.session.execute(
            update(TurnRow)
            .where(TurnRow.id == turn_id, TurnRow.status.in_(("in_progress", "waiting")))
            .values(cancel_requested=True)
        )
        return turn_id

    async def _answer_call(self, u: Unit, row: SessionRow, event: dict[str, Any], p: str) -> str:
        call_id = event.get("call_id")
        turn_id = event.get("turn_id")
        if not isinstance(call_id, str) or not call_id:
            raise InvalidArgument("call_id is required", param=f"{p}.call_id")
        if not isinstance(turn_id, str) or not turn_id:
            raise InvalidArgument("turn_id is required", param=f"{p}.turn_id")
        success = event.get("success")
        if not isinstance(success, bool):
            raise InvalidArgument("success must be a boolean", param=f"{p}.success")
        call = (
            await u.session.execute(
                select(FunctionCallRow).where(FunctionCallRow.call_id == call_id, FunctionCallRow.session_id == row.id)
            )
        ).scalar_one_or_none()
        if call is None:
            # The SDK's helpers match this exact message for their retry.
            raise UnknownToolCall(f"Unknown pending tool call: {call_id}", param=f"{p}.call_id")
        if call.turn_id != turn_id:
            raise InvalidArgument(f"call {call_id} does not belong to turn {turn_id}", param=f"{p}.turn_id")
        if call.state == "cancelled":
            raise FailedPrecondition(f"turn {turn_id} is no longer waiting for call {call_id}", param=f"{p}.call_id")
        if call.state != "pending":
            raise Conflict(f"call {call_id} was already answered", param=f"{p}.call_id")
        output = event.get("output")
        error = event.get("error")
        if success:
            if isinstance(output, list):
                output = _parts(output, f"{p}.output") if output else []
            elif output is not None and not isinstance(output, str):
                raise InvalidArgument("output must be a string or a list of content parts", param=f"{p}.output")
        elif error is not None and not isinstance(error, str):
            raise InvalidArgument("error must be a string", param=f"{p}.error")
        result = await u.session.execute(
            update(FunctionCallRow)
            .where(FunctionCallRow.call_id == call_id, FunctionCallRow.state == "pending")
            .values(
                state="answered",
                success=success,
                output_json=json.dumps(output if success else None),
                error=None if success else (error or "the function call failed"),
            )
        )
        if not result.rowcount:  # type: ignore[attr-defined]
            raise Conflict(f"call {call_id} was already answered", param=f"{p}.call_id")
        u.wake_key(f"calls:{turn_id}")
        return turn_id

    # ===== turns and items ============================================================
    async def list_turns(self, session_id: str, page: Page) -> tuple[list[TurnRow], bool]:
        org = current_org()

        async def run(s: AsyncSession) -> tuple[list[TurnRow], bool]:
            await repo.get_session(s, org, session_id)
            return await repo.paginate(s, TurnRow, [TurnRow.session_id == session_id], page)

        return await self.store.query(run)

    async def get_turn(self, session_id: str, turn_id: str) -> TurnRow:
        org = current_org()

        async def run(s: AsyncSession) -> TurnRow:
            await repo.get_session(s, org, session_id)
            return await repo.get_turn(s, session_id, turn_id)

        return await self.store.query(run)

    async def list_items(self, session_id: str, turn_id: str, page: Page) -> tuple[list[ItemRow], bool]:
        org = current_org()

        async def run(s: AsyncSession) -> tuple[list[ItemRow], bool]:
            await repo.get_session(s, org, session_id)
            scope = [ItemRow.session_id == session_id, ItemRow.visible.is_(True)]
            if turn_id:
                await repo.get_turn(s, session_id, turn_id)
                scope.append(ItemRow.turn_id == turn_id)
            return await repo.paginate(s, ItemRow, scope, page)

        return await self.store.query(run)

    # ===== artifacts ==================================================================
    async def list_artifacts(self, session_id: str, turn_id: str, page: Page) -> tuple[list[ArtifactRow], bool]:
        org = current_org()

        async def run(s: AsyncSession) -> tuple[list[ArtifactRow], bool]:
            await repo.get_session(s, org, session_id)
            scope = [ArtifactRow.session_id == session_id]
            if turn_id:
                scope.append(ArtifactRow.turn_id == turn_id)
            return await repo.paginate(s, ArtifactRow, scope, page)

        return await self.store.query(run)

    async def get_artifact(self, session_id: str, artifact_id: str) -> ArtifactRow:
        org = current_org()

        async def run(s: AsyncSession) -> ArtifactRow:
            await repo.get_session(s, org, session_id)
            return await repo.get_artifact(s, session_id, artifact_id)

        return await self.store.query(run)

    async def artifact_content(self, session_id: str, artifact_id: str) -> AsyncIterator[bytes]:
        row = await self.get_artifact(session_id, artifact_id)
        if not self.blobs.path(row.sha256).exists():
            raise NotFound(f"the content of artifact {artifact_id} is missing", param="artifact_id")
        return self.blobs.read(row.sha256)

    async def delete_artifact(self, session_id: str, artifact_id: str) -> str:
        org = current_org()

        async def remove(u: Unit) -> list[str]:
            await repo.get_session(u.session, org, session_id)
            row = await repo.get_artifact(u.session, session_id, artifact_id)
            await u.session.execute(delete(ArtifactRow).where(ArtifactRow.id == artifact_id))
            return await repo.unreferenced_blobs(u.session, [row.sha256])

        self.blobs.delete(await self.store.transact(remove))
        return artifact_id

    # ===== events =====================================================================
    async def stream_events(
        self, session_id: str, after_sequence: int, *, follow: bool, keepalive_ms: int
    ) -> AsyncIterator[list[tuple[int, str, str]] | int]:
        """Yields batches of (sequence, type, event_json) for persisted events
        after the sequence, then live ones when following, and the current
        Unix time in milliseconds as a keep-alive when idle. A batch is what
        was available at once (one read of the log, or one commit's events),
        so a consumer pays per batch rather than per event. Ends when the
        session is deleted."""
        if after_sequence < 0:
            raise InvalidArgument("after_sequence must not be negative", param="after_sequence")
        if keepalive_ms < 0:
            raise InvalidArgument("keepalive_ms must not be negative", param="keepalive_ms")
        org = current_org()
        await self.store.query(lambda s: repo.get_session(s, org, session_id))
        return self._follow(session_id, org, after_sequence, follow, keepalive_ms)

    async def _follow(
        self, session_id: str, org: str, last: int, follow: bool, keepalive_ms: int
    ) -> AsyncIterator[list[tuple[int, str, str]] | int]:
        feed = self.store.notifier.subscribe_feed(session_id)
        wake = feed.wake
        keepalive_s = keepalive_ms / 1000.0
        idle_since = time.monotonic()

        async def fetch(s: AsyncSession) -> tuple[list[EventRow], bool]:
            rows = await repo.events_after(s, session_id, last)
            if rows:
                return rows, True
            alive = (
                await s.execute(
                    select(SessionRow.id).where(
                        SessionRow.id == session_id, SessionRow.org_id == org, SessionRow.status != "deleting"
                    )
                )
            ).scalar_one_or_none()
            return rows, alive is not None

        try:
            fresh = True
            while True:
                wake.clear()
                # Events committed in this process arrive through the feed;
                # the log is read first, on gaps, and when nothing was fed
                # (commits on other replicas, polls, deletion).
                fed = [] if fresh else feed.take_after(last)
                fresh = False
                if fed:
                    last = fed[-1].sequence
                    yield [(e.sequence, e.type, e.event_json) for e in fed]
                    idle_since = time.monotonic()
                    if not follow:
                        continue
                else:
                    rows, alive = await self.store.query(fetch)
                    if rows:
                        last = rows[-1].seq
                        yield [(r.seq, r.type, r.event_json) for r in rows]
                        idle_since = time.monotonic()
                        if not follow or len(rows) >= repo.EVENTS_BATCH:
                            continue
                        # A short batch is all there was when it was read: wait
                        # for the next wake-up (already set if something
                        # committed meanwhile) instead of reading an empty batch.
                    elif not follow or not alive:
                        return
                timeout = self.poll_s
                if keepalive_s > 0:
                    timeout = max(0.0, min(timeout, idle_since + keepalive_s - time.monotonic()))
                try:
                    await asyncio.wait_for(wake.wait(), timeout)
                except TimeoutError:
                    pass
                if keepalive_s > 0 and time.monotonic() - idle_since >= keepalive_s:
                    idle_since = time.monotonic()
                    yield int(time.time() * 1000)
        finally:
            self.store.notifier.unsubscribe_feed(session_id, feed)
