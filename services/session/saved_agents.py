"""Saved agents: create, read, list, update and delete, scoped by the
caller's organization (``current_org()``); another organization's agent is
``NotFound``. Sessions created from an agent keep their own snapshot."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

from berth.session.v1 import session_service_pb2 as svc_pb
from services.core.ids import new_id
from services.session import repository as repo
from services.session.agents import AgentConfig, apply_config, new_config
from services.session.models import AgentRow
from services.session.repository import Page
from services.session.store import Store, Unit

__all__ = ["SavedAgents", "AgentView", "config_paths"]


@dataclass
class AgentView:
    row: AgentRow
    config: AgentConfig



def _agent_view(row: AgentRow) -> AgentView:
    return AgentView(row, json.loads(row.config_json))



def config_paths(paths: Any, prefix: str) -> set[str]:
    """The AgentConfig paths of an update mask, without their prefix."""
    return {p[len(prefix) :] for p in paths if p.startswith(prefix)}



class SavedAgents:
    def __init__(self, store: Store) -> None:
        self.store = store

    async def create_agent(self, org: str, request: svc_pb.CreateAgentRequest) -> AgentView:
        name = request.name if request.HasField("name") else None
        metadata = dict(request.metadata)
        config = new_config(request.config, persisted=True)
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

    async def get_agent(self, org: str, agent_id: str) -> AgentView:
        row = await self.store.query(lambda s: repo.get_agent(s, org, agent_id))
        return _agent_view(row)

    async def list_agents(self, org: str, page: Page) -> tuple[list[AgentView], bool]:
        scope = [AgentRow.org_id == org]
        rows, more = await self.store.query(lambda s: repo.paginate(s, AgentRow, scope, page))
        return [_agent_view(r) for r in rows], more

    async def update_agent(self, org: str, request: svc_pb.UpdateAgentRequest) -> AgentView:
        """Changes the fields named in the update mask; a named field left
        unset is reset."""
        agent_id = request.agent_id
        paths = set(request.update_mask.paths)

        async def update(u: Unit) -> AgentView:
            row = await repo.get_agent(u.session, org, agent_id)
            config = apply_config(
                json.loads(row.config_json), request.config, config_paths(paths, "config."), persisted=True
            )
            if "name" in paths:
                row.name = request.name if request.HasField("name") else None
            if "metadata" in paths:
                row.metadata_json = json.dumps(dict(request.metadata))
            row.config_json = json.dumps(config)
            row.version += 1
            row.updated_at = time.time()
            return _agent_view(row)

        return await self.store.transact(update)

    async def delete_agent(self, org: str, agent_id: str) -> str:
        """Sessions created from the agent keep their snapshot."""

        async def delete_row(u: Unit) -> None:
            await u.session.delete(await repo.get_agent(u.session, org, agent_id))

        await self.store.transact(delete_row)
        return agent_id
