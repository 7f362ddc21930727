"""Where webhooks may be delivered. The Session service sits on the control
plane, so a receiver URL must not reach it or its neighbours: loopback,
private, link-local (cloud metadata), shared and reserved addresses are
refused unless listed in ``BERTH_WEBHOOK_ALLOW_DESTINATIONS`` (CIDRs or host
names). A URL naming such an address is a 400 at registration; a name is
resolved at every attempt, every address it resolves to must be allowed,
and the request connects to the address that was checked (the name goes in
``Host`` and TLS SNI), so DNS rebinding cannot swap it. Redirects are never
followed. Plain ``http`` is accepted only for listed destinations. Host
parsing and the global-address test are ``services/core/addresses.py``'s,
the same rules the sandboxes' egress and the OAuth token calls apply.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from dataclasses import dataclass
from urllib.parse import urlsplit

from services.core.addresses import IPAddress, is_public_address, parse_host
from services.core.errors import InvalidArgument

__all__ = ["DestinationPolicy", "DestinationRefused", "Target"]

_MAX_URL = 2048


class DestinationRefused(Exception):
    """A delivery's destination resolves to an address that is not allowed."""


@dataclass(frozen=True)
class Target:
    """A checked URL: its host name, and the address to connect to."""

    url: str
    host: str
    address: str


def _unmapped(address: IPAddress) -> IPAddress:
    """An IPv4-mapped IPv6 address as the IPv4 address it is (for listing)."""
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def _address(host: str) -> IPAddress | None:
    """The address a URL's host names (every numeric IPv4 spelling the
    resolver accepts, such as ``127.1``, included); None for a name."""
    parsed = parse_host(host)
    return _unmapped(parsed) if isinstance(parsed, (ipaddress.IPv4Address, ipaddress.IPv6Address)) else None


def _resolved(text: str) -> IPAddress | None:
    try:
        return _unmapped(ipaddress.ip_address(text.split("%", 1)[0]))
    except ValueError:
        return None


class DestinationPolicy:
    def __init__(self, allow: list[str]) -> None:
        self._networks: list[ipaddress.IPv4Network | ipaddress.IPv6Network] = []
        self._hosts: set[str] = set()
        for entry in allow:
            try:
                self._networks.append(ipaddress.ip_network(entry, strict=False))
            except ValueError:
                self._hosts.add(entry.strip().lower().rstrip("."))

    def _listed(self, host: str, address: IPAddress | None) -> bool:
        if host in self._hosts:
            return True
        return address is not None and any(address in network for network in self._networks)

    def address_allowed(self, host: str, address: IPAddress) -> bool:
        return self._listed(host, address) or is_public_address(address)

    def check_url(self, url: str, *, param: str = "url") -> str:
        """The URL, or InvalidArgument naming ``param``."""
        if len(url) > _MAX_URL:
            raise InvalidArgument(f"the URL is longer than {_MAX_URL} characters", param=param)
        try:
            parts = urlsplit(url)
            port = parts.port
        except ValueError:
            raise InvalidArgument("the URL is not valid", param=param) from None
        host = (parts.hostname or "").lower().rstrip(".")
        if parts.scheme not in ("https", "http") or not host:
            raise InvalidArgument("the URL must be an absolute https URL", param=param)
        if parts.username is not None or parts.password is not None:
            raise InvalidArgument("the URL must not carry credentials", param=param)
        if port == 0:
            raise InvalidArgument("the URL's port is not valid", param=param)
        address = _address(host)
        listed = self._listed(host, address)
        if parts.scheme == "http" and not listed:
            raise InvalidArgument("the URL must use https", param=param)
        if not listed and (host == "localhost" or host.endswith(".localhost")):
            raise InvalidArgument("the URL names a loopback destination", param=param)
        if address is not None and not self.address_allowed(host, address):
            raise InvalidArgument("the URL names a private, loopback or link-local address", param=param)
        return url

    async def resolve(self, url: str) -> Target:
        """The address a delivery connects to; DestinationRefused when any
        address the host resolves to is not allowed."""
        parts = urlsplit(url)
        host = (parts.hostname or "").lower().rstrip(".")
        literal = _address(host)
        if literal is not None:
            addresses = [literal]
        else:
            port = parts.port or (443 if parts.scheme == "https" else 80)
            loop = asyncio.get_running_loop()
            try:
                infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
            except OSError as exc:
                raise DestinationRefused(f"cannot resolve {host}: {exc.strerror or exc}") from None
            addresses = [a for a in (_resolved(str(info[4][0])) for info in infos) if a is not None]
        if not addresses:
            raise DestinationRefused(f"{host} has no address")
        refused = [str(a) for a in addresses if not self.address_allowed(host, a)]
        if refused:
            raise DestinationRefused(f"{host} resolves to a refused address")
        return Target(url=url, host=host, address=str(addresses[0]))
