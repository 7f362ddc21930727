"""The notifiers of services/core/notify.py without a server: which waiters
a wake-up reaches, what an announcement's payload holds, and which database
URL the PostgreSQL listener connects with."""

from __future__ import annotations

import asyncio
from pathlib import Path

from services.core.db import Database, create_engine
from services.core.notify import Notifier, PostgresNotifier, SoleWriterNotifier, open_notifier


async def test_a_wake_up_sets_the_events_subscribed_to_its_key_and_no_others() -> None:
    notifier = Notifier()
    mine, other = notifier.subscribe("events:a"), notifier.subscribe("events:b")
    given = asyncio.Event()
    notifier.add_waiter("events:a", given)
    notifier.wake("events:a")
    assert mine.is_set() and given.is_set() and not other.is_set()
    notifier.unsubscribe("events:b", other)
    notifier.wake("events:b")
    assert not other.is_set()


async def test_an_in_process_notifier_keeps_the_waiters_own_poll_interval() -> None:
    assert not Notifier().listening
    assert Notifier().poll_s(0.2) == 0.2


async def test_announcements_carry_the_replica_tag_and_every_key_within_the_payload_limit() -> None:
    notifier = PostgresNotifier("postgresql://127.0.0.1/x", "berth_session", safety_poll_s=5.0)
    keys = [f"events:sess_{i:030d}" for i in range(600)]
    payloads = notifier._payloads(keys)
    assert len(payloads) > 1
    assert all(len(p.encode()) < 8000 and p.split(" ")[0] == notifier.origin for p in payloads)
    assert [k for p in payloads for k in p.split(" ")[1:]] == keys
    assert notifier._payloads([]) == []


async def test_a_heard_notification_wakes_its_keys_unless_this_replica_sent_it() -> None:
    notifier = PostgresNotifier("postgresql://127.0.0.1/x", "berth_session", safety_poll_s=5.0)
    wake = notifier.subscribe("turn:t1")
    notifier._heard(None, 0, "berth_session", f"{notifier.origin} turn:t1")
    assert not wake.is_set()
    notifier._heard(None, 0, "berth_session", "0123456789ab events:s1 turn:t1")
    assert wake.is_set()


async def test_a_listener_not_up_leaves_waiters_at_their_own_poll_interval() -> None:
    notifier = PostgresNotifier("postgresql://127.0.0.1/x", "berth_session", safety_poll_s=5.0)
    assert not notifier.listening
    assert notifier.poll_s(0.2) == 0.2


async def test_the_listener_connects_with_the_database_url_without_sqlalchemy_options() -> None:
    db = Database(create_engine("postgresql+asyncpg://u:secret@127.0.0.1:5433/berth?sslmode=require&prepared_statement_cache_size=0"))
    try:
        notifier = open_notifier(db, channel="berth_session", safety_poll_s=5.0)
        assert isinstance(notifier, PostgresNotifier)
        assert notifier._dsn == "postgresql://u:secret@127.0.0.1:5433/berth?sslmode=require"
        assert type(open_notifier(db, channel="berth_session", safety_poll_s=5.0, listen=False)) is Notifier
    finally:
        await db.dispose()


async def test_sqlite_gets_the_in_process_notifier(tmp_path: Path) -> None:
    db = Database(create_engine(f"sqlite+berth:///{tmp_path / 'x.db'}"))
    try:
        assert type(open_notifier(db, channel="berth_session", safety_poll_s=5.0)) is Notifier
    finally:
        await db.dispose()


async def test_a_sole_writer_of_sqlite_hears_its_own_commits_and_polls_only_as_a_safety_net(tmp_path: Path) -> None:
    db = Database(create_engine(f"sqlite+berth:///{tmp_path / 'x.db'}"))
    try:
        notifier = open_notifier(db, channel="berth_session", safety_poll_s=5.0, sole_writer=True)
        assert isinstance(notifier, SoleWriterNotifier)
        assert notifier.listening
        assert notifier.poll_s(0.2) == 5.0
        woken = notifier.subscribe("session:a")
        notifier.wake("session:a")
        assert woken.is_set()
    finally:
        await db.dispose()
