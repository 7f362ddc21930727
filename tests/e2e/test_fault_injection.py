"""A restart is a non-event: the four services run as separate processes on
PostgreSQL under a bounded load (sessions, turns of ``$ echo N >> log``, a
live SSE consumer per session), and each service is killed with SIGKILL in
turn and restarted. No turn fails or sticks, every consumer sees every
event once and in order, and every file holds exactly its turns' lines."""

from __future__ import annotations

from pathlib import Path

import pytest
from e2e_support import workspace_file
from fault_stack import FaultLoad, replay, running_processes

pytestmark = [pytest.mark.postgres, pytest.mark.slow]

SESSIONS = 6
TURNS = 5


async def test_killing_each_service_in_turn_fails_no_turn_and_loses_no_event_or_line(
    tmp_path: Path, fresh_postgres_database: str, bwrap_available: None
) -> None:
    async with running_processes(tmp_path / "berth", fresh_postgres_database, turn_lease_s="3") as stack:
        load = FaultLoad(
            stack, sessions=SESSIONS, turns=TURNS, kill_order=("environment", "sandbox", "session", "gateway")
        )
        report = await load.run()
        for kill in report.kills:
            print(f"{kill.service}: {kill.errors}/{kill.requests} client errors, the last {kill.recovery_s:.1f}s after the kill")

        assert report.stuck == []
        assert report.failed == []
        assert [k.service for k in report.kills] == ["environment", "sandbox", "session", "gateway"]
        assert all(len(turns) == TURNS for turns in report.turns.values())
        for follower in report.followers:
            assert (follower.session_id, follower.gaps, follower.duplicates) == (follower.session_id, [], [])
            # The whole persisted log, read again, is the same gapless sequence.
            log = await replay(stack, follower.session_id, upto=follower.last_seq)
            assert [seq for seq, _ in log] == list(range(1, follower.last_seq + 1))
            assert len({event["event_id"] for _, event in log}) == len(log)
            # Each item is done once.
            done = [event["item"]["id"] for _, event in log if event["type"] == "agent.session.turn.item.done"]
            assert len(done) == len(set(done))
        for session_id, environment_id in report.environments.items():
            lines = workspace_file(stack.data_dir, environment_id, "/workspace/log").read_text()
            if lines != "".join(f"{n}\n" for n in range(1, TURNS + 1)):
                async with stack.http() as http:
                    items = (await http.get(f"/agents/sessions/{session_id}/items", params={"limit": 100})).json()["data"]
                log = await replay(stack, session_id, upto=next(f.last_seq for f in report.followers if f.session_id == session_id))
                kinds = [(e["type"], e.get("item", {}).get("status"), e.get("delta")) for _, e in log]
                raise AssertionError((session_id, lines, [(i["type"], i.get("command"), i.get("status"), i.get("output")) for i in items], kinds))
