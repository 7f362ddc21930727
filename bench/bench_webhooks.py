"""Webhook delivery latency from the event's commit: an event enqueued in a
unit of work on the Session service's store (SQLite, as in ``berth
serve``), until the receiver on 127.0.0.1 has the signed POST. The delivery
worker is woken by the commit, not by polling. Baseline: the same POST sent
directly with httpx."""

from __future__ import annotations

import asyncio
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
from cryptography.fernet import Fernet

from bench.runner import Result, summarize
from services.core.db import open_database
from services.core.ids import new_id
from services.core.notify import Notifier
from services.session.store import Store, Unit
from services.session.webhooks import capture, enqueue
from services.session.webhooks.delivery import DeliveryConfig, WebhookDeliverer
from services.session.webhooks.destinations import DestinationPolicy
from services.session.webhooks.endpoints import WebhookEndpoints
from services.session.webhooks.signing import SecretBox

__all__ = ["run"]

_MIGRATIONS = Path(__file__).parents[1] / "services" / "session" / "migrations" / "versions"
_RUNS = 200
_ORG = "org_bench"
_CONFIG = DeliveryConfig(timeout_s=5, retry_base_s=0.1, retry_max_s=1, disable_after=1000, concurrency=16, claim_s=30)


class _Receiver:
    """Records when each webhook-id arrived (perf_counter) and resolves its waiter."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.waiters: dict[str, asyncio.Future[float]] = {}
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:  # noqa: N802 - the stdlib's naming
                arrived = time.perf_counter()
                self.rfile.read(int(self.headers.get("content-length", "0")))
                self.send_response(200)
                self.send_header("content-length", "0")
                self.end_headers()
                waiter = receiver.waiters.get(self.headers.get("webhook-id", ""))
                if waiter is not None:
                    receiver.loop.call_soon_threadsafe(lambda: waiter.done() or waiter.set_result(arrived))

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/hooks"

    def expect(self, message_id: str) -> asyncio.Future[float]:
        future: asyncio.Future[float] = self.loop.create_future()
        self.waiters[message_id] = future
        return future

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


async def run(tmp: Path) -> list[Result]:
    receiver = _Receiver(asyncio.get_running_loop())
    db = await open_database(f"sqlite+berth:///{tmp / 'session.db'}", "session", _MIGRATIONS)
    notifier = Notifier()
    store = Store(db, notifier, before_commit=capture)
    box = SecretBox(Fernet.generate_key())
    policy = DestinationPolicy(["127.0.0.1/32"])
    deliverer = WebhookDeliverer(db, notifier, box, policy, _CONFIG)
    await WebhookEndpoints(store, box, policy).create(
        _ORG, name="bench", url=receiver.url, event_types=["agent.automation.invocation.completed"]
    )
    await deliverer.start()
    try:
        delivered: list[float] = []
        for n in range(_RUNS + 5):
            event_id = new_id("evt")
            arrived = receiver.expect(event_id)

            async def write(u: Unit, event_id: str = event_id) -> None:
                await enqueue(u, _ORG, "agent.automation.invocation.completed", {"id": f"inv_{n}"}, event_id=event_id)

            await store.transact(write)
            committed = time.perf_counter()
            sample = (await asyncio.wait_for(arrived, 10) - committed) * 1000
            if n >= 5:
                delivered.append(sample)
        direct: list[float] = []
        async with httpx.AsyncClient() as http:
            for n in range(_RUNS + 5):
                event_id = new_id("evt")
                arrived = receiver.expect(event_id)
                sent = time.perf_counter()
                await http.post(receiver.url, content=b"{}", headers={"webhook-id": event_id})
                sample = (await asyncio.wait_for(arrived, 10) - sent) * 1000
                if n >= 5:
                    direct.append(sample)
    finally:
        await deliverer.close()
        await db.dispose()
        receiver.close()
    return [
        summarize(
            "webhook delivery from the event's commit",
            delivered,
            "httpx POST to the receiver",
            direct,
            target="p50 < 200 ms",
        )
    ]
