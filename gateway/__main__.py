"""``python -m gateway``: the public REST gateway on settings.gateway_host:gateway_port."""

from __future__ import annotations

import asyncio

from gateway.app import start_gateway
from services.core.grpc_server import wait_for_termination_signal
from services.core.logging import configure_logging, get_logger
from services.core.service import settle_heap
from services.core.settings import Settings

log = get_logger("berth.gateway")


def main() -> None:
    settings = Settings()
    configure_logging(settings.log_level, json=settings.log_json)

    async def run() -> None:
        handle = await start_gateway(settings)
        settle_heap()
        log.info("service_ready", service="gateway", port=handle.port)
        await wait_for_termination_signal(settings.serve_lifeline_fd)
        log.info("service_stopping", service="gateway")
        await handle.stop()

    asyncio.run(run())


if __name__ == "__main__":
    main()
