"""The database going away under running services: the four services as
separate processes on PostgreSQL, and every connection they hold is
terminated by the server (a restart, a failover). A request that meets a
dead connection is a 503 in the error envelope, which the SDKs retry,
never a 500; a read is tried again inside the service and succeeds; and
the services serve again at once, on new connections, with nothing
restarted."""

from __future__ import annotations

from pathlib import Path

import pytest
from db_support import terminate_backends
from fault_stack import running_processes

pytestmark = [pytest.mark.postgres, pytest.mark.slow]


async def test_connections_the_database_dropped_are_retried_for_reads_503_for_writes_never_500_and_recover_at_once(
    tmp_path: Path, fresh_postgres_database: str, bwrap_available: None
) -> None:
    # No ping for a minute: the services use their pooled connections as they are.
    async with running_processes(tmp_path / "berth", fresh_postgres_database, database_ping_idle_s="60") as stack:
        async with stack.http() as http:
            created = await http.post("/agents", json={"model": "scripted", "name": "before"})
            assert created.status_code == 200
            assert (await http.get("/agents")).status_code == 200

            assert await terminate_backends(fresh_postgres_database) > 0
            # A read is tried again on a new connection, in the gateway (its
            # key lookup) and in the Session service: the caller sees nothing.
            listed = await http.get("/agents")
            assert listed.status_code == 200, listed.text

            assert await terminate_backends(fresh_postgres_database) > 0
            statuses: list[int] = []
            for attempt in range(6):
                response = await http.post("/agents", json={"model": "scripted", "name": f"after-{attempt}"})
                statuses.append(response.status_code)
                if response.status_code == 200:
                    break
                assert response.status_code == 503, response.text
                error = response.json()["error"]
                assert (error["type"], error["code"]) == ("server_error", "service_unavailable")
            # A write is never run twice, so one that met a dead connection is a 503
            # (the Session service's background work, woken by its LISTEN connection
            # coming back, often meets the dead connection first); one is served soon.
            assert statuses[-1] == 200, statuses

            names = {agent["name"] for agent in (await http.get("/agents", params={"limit": 100})).json()["data"]}
            # Only the request that succeeded wrote an agent.
            assert names == {"before", f"after-{len(statuses) - 1}"}
