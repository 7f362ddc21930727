"""Which network addresses the control plane and the sandboxes' egress may
reach: canonical host parsing and the globally-routable test, shared by the
egress proxy (``services/sandbox/egress.py``) and every outbound call a
service makes to a user-supplied URL (OAuth token endpoints)."""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import re
import socket

__all__ = ["IPAddress", "AddressRefused", "parse_host", "is_public_address", "vetted_addresses"]

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

_LABEL = re.compile(r"^[a-z0-9_-]{1,63}$")
_NAT64 = (ipaddress.IPv6Network("64:ff9b::/96"), ipaddress.IPv6Network("64:ff9b:1::/48"))


class AddressRefused(Exception):
    """A host that does not parse, does not resolve, or resolves to an
    address that may not be reached. The message names the host only."""


def parse_host(raw: str) -> str | IPAddress | None:
    """The canonical form of a target host: an IP address, or a lower-case
    ASCII domain name without a trailing dot. None when it is neither. Every
    numeric IPv4 spelling the resolver would accept (``127.1``,
    ``0x7f000001``) is an address here too, so no name slips past the
    address rules."""
    host = raw.strip()
    if host.startswith("[") and host.endswith("]"):
        try:
            return ipaddress.IPv6Address(host[1:-1])
        except ValueError:
            return None
    if "%" not in host:
        with contextlib.suppress(ValueError):
            return ipaddress.ip_address(host)
    host = host.lower().removesuffix(".")
    try:
        host = host.encode("idna").decode("ascii")
    except UnicodeError:
        return None
    if not host or len(host) > 253 or not all(_LABEL.match(label) for label in host.split(".")):
        return None
    with contextlib.suppress(OSError):
        return ipaddress.IPv4Address(socket.inet_aton(host))
    return host


def is_public_address(address: IPAddress) -> bool:
    """Whether ``address`` is a globally routable unicast address, looking
    through IPv6 forms that embed an IPv4 address."""
    if isinstance(address, ipaddress.IPv6Address):
        embedded = address.ipv4_mapped or address.sixtofour
        if embedded is None and any(address in net for net in _NAT64):
            embedded = ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
        if embedded is not None and not is_public_address(embedded):
            return False
    return address.is_global and not address.is_multicast


async def vetted_addresses(host: str, port: int, *, allow_private: bool) -> list[IPAddress]:
    """The addresses to connect to for ``host``: every address it resolves
    to, all of them global unless ``allow_private``. Connect to one of these
    rather than resolving the name again, so a rebinding DNS answer cannot
    swap in a private address after the check."""
    parsed = parse_host(host)
    if parsed is None:
        raise AddressRefused(f"{host!r} is not a valid host name")
    if isinstance(parsed, str):
        try:
            infos = await asyncio.get_running_loop().getaddrinfo(parsed, port, type=socket.SOCK_STREAM)
        except OSError:
            raise AddressRefused(f"{parsed} does not resolve") from None
        addresses: list[IPAddress] = []
        for info in infos:
            with contextlib.suppress(ValueError):
                address = ipaddress.ip_address(str(info[4][0]).split("%", 1)[0])
                if address not in addresses:
                    addresses.append(address)
    else:
        addresses = [parsed]
    if not addresses:
        raise AddressRefused(f"{host} has no address")
    if not allow_private and not all(is_public_address(a) for a in addresses):
        raise AddressRefused(f"{host} is, or resolves to, a loopback, private, link-local or other non-global address")
    return addresses
