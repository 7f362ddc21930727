"""The OAuth refresh-token grant (RFC 6749 section 6) against a vault
credential's token endpoint.

The endpoint is user-supplied and called from the control plane, so unless
``BERTH_OAUTH_ALLOW_PRIVATE_ENDPOINTS`` is set its host must be, and
resolve only to, global addresses; the request connects to the address that
was checked (the name goes in ``Host`` and TLS SNI) and follows no
redirect. Failures become ``OAuthRefreshFailed`` with a message that names
the cause and never quotes a secret, nor the endpoint's own error text.
"""

from __future__ import annotations

import asyncio
import math
import re
import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote_plus, urlsplit

import httpx

from services.core.addresses import AddressRefused, vetted_addresses
from services.core.errors import OAuthRefreshFailed
from services.core.settings import Settings

__all__ = ["TokenRequest", "TokenGrant", "TokenEndpointClient", "AUTH_METHODS"]

AUTH_METHODS = ("none", "client_secret_basic", "client_secret_post")
_HOST_CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")
# An OAuth error code is ASCII without quotes or backslashes (RFC 6749
# section 5.2); anything else from the endpoint is not repeated.
_ERROR_CODE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
_HEADER_UNSAFE = re.compile(r"[\r\n\x00]")
_MAX_RESPONSE_BYTES = 64 * 1024


@dataclass(frozen=True)
class TokenRequest:
    token_endpoint: str
    client_id: str
    auth_method: str
    refresh_token: str
    client_secret: str | None = None
    resource: str | None = None
    scope: str | None = None

    def __repr__(self) -> str:
        # Never print the refresh token or client secret (tracebacks, logs).
        return f"TokenRequest(token_endpoint={self.token_endpoint!r}, client_id={self.client_id!r})"


@dataclass(frozen=True)
class TokenGrant:
    access_token: str
    # Seconds the new access token lives; None when the endpoint did not say.
    expires_in: float | None
    # The rotated refresh token; None keeps the one that was spent.
    refresh_token: str | None

    def __repr__(self) -> str:
        return f"TokenGrant(expires_in={self.expires_in!r}, rotated={self.refresh_token is not None})"


def outbound_ssl_context(settings: Settings) -> ssl.SSLContext:
    """What TLS to user-supplied endpoints trusts: ``outbound_ca_bundle``,
    else the host's bundle, else the system default."""
    configured = settings.outbound_ca_bundle.strip()
    if configured:
        return ssl.create_default_context(cafile=configured)
    if _HOST_CA_BUNDLE.is_file():
        return ssl.create_default_context(cafile=str(_HOST_CA_BUNDLE))
    return ssl.create_default_context()


def _grant(response: httpx.Response) -> TokenGrant:
    try:
        body: Any = response.json()
    except ValueError:
        raise OAuthRefreshFailed(f"the token endpoint answered HTTP {response.status_code} without JSON") from None
    if not response.is_success:
        code = body.get("error") if isinstance(body, dict) else None
        detail = f" ({code})" if isinstance(code, str) and _ERROR_CODE.match(code) else ""
        raise OAuthRefreshFailed(f"the token endpoint refused the refresh: HTTP {response.status_code}{detail}")
    if not isinstance(body, dict):
        raise OAuthRefreshFailed("the token endpoint's answer is not a JSON object")
    access_token = body.get("access_token")
    if not isinstance(access_token, str) or not access_token or _HEADER_UNSAFE.search(access_token):
        raise OAuthRefreshFailed("the token endpoint's answer has no usable access_token")
    token_type = body.get("token_type")
    if token_type is not None and (not isinstance(token_type, str) or token_type.lower() != "bearer"):
        raise OAuthRefreshFailed("the token endpoint issued a token that is not a bearer token")
    expires_in = body.get("expires_in")
    if expires_in is not None:
        if isinstance(expires_in, str) and expires_in.isdigit():
            expires_in = int(expires_in)
        if isinstance(expires_in, bool) or not isinstance(expires_in, int | float) or not math.isfinite(expires_in):
            raise OAuthRefreshFailed("the token endpoint's expires_in is not a number of seconds")
        if expires_in < 0:
            raise OAuthRefreshFailed("the token endpoint's expires_in is negative")
    rotated = body.get("refresh_token")
    if rotated is not None and (not isinstance(rotated, str) or not rotated):
        raise OAuthRefreshFailed("the token endpoint's refresh_token is not a string")
    return TokenGrant(
        access_token=access_token,
        expires_in=None if expires_in is None else float(expires_in),
        refresh_token=rotated,
    )


class TokenEndpointClient:
    """Makes refresh-token grants; one per Environment service process."""

    def __init__(self, settings: Settings) -> None:
        self._allow_private = settings.oauth_allow_private_endpoints
        self._timeout_s = settings.oauth_refresh_timeout_s
        self._http = httpx.AsyncClient(
            verify=outbound_ssl_context(settings),
            trust_env=False,
            follow_redirects=False,
            timeout=httpx.Timeout(self._timeout_s),
        )

    @property
    def allow_private(self) -> bool:
        return self._allow_private

    async def close(self) -> None:
        await self._http.aclose()

    async def refresh(self, request: TokenRequest) -> TokenGrant:
        """The grant, or OAuthRefreshFailed. httpx bounds each phase of the
        request; this bounds the whole exchange, name resolution included
        (a slow drip of bytes would otherwise hold the credential's lock)."""
        try:
            async with asyncio.timeout(self._timeout_s):
                return await self._exchange(request)
        except TimeoutError:
            raise OAuthRefreshFailed(f"the token endpoint did not answer within {self._timeout_s:g}s") from None

    async def _exchange(self, request: TokenRequest) -> TokenGrant:
        url = httpx.URL(request.token_endpoint)
        parts = urlsplit(request.token_endpoint)
        host = parts.hostname or ""
        try:
            addresses = await vetted_addresses(host, parts.port or 443, allow_private=self._allow_private)
        except AddressRefused as exc:
            raise OAuthRefreshFailed(f"the token endpoint is not reachable from Berth: {exc}") from None
        form = {"grant_type": "refresh_token", "refresh_token": request.refresh_token}
        auth: httpx.BasicAuth | None = None
        if request.auth_method == "client_secret_basic":
            # RFC 6749 section 2.3.1: both parts form-urlencoded before Basic encoding.
            auth = httpx.BasicAuth(quote_plus(request.client_id), quote_plus(request.client_secret or ""))
        else:
            form["client_id"] = request.client_id
            if request.auth_method == "client_secret_post":
                form["client_secret"] = request.client_secret or ""
        if request.resource is not None:
            form["resource"] = request.resource
        if request.scope is not None:
            form["scope"] = request.scope
        headers = {"host": url.netloc.decode("ascii"), "accept": "application/json", "user-agent": "Berth-OAuth/1"}
        # Connect to the vetted address, not whatever the name resolves to next.
        pinned = url.copy_with(host=str(addresses[0]))
        try:
            async with self._http.stream(
                "POST", pinned, data=form, auth=auth, headers=headers, extensions={"sni_hostname": host}
            ) as response:
                body = b""
                async for chunk in response.aiter_bytes():
                    body += chunk
                    if len(body) > _MAX_RESPONSE_BYTES:
                        raise OAuthRefreshFailed("the token endpoint's answer is too large")
        except httpx.TimeoutException:
            raise OAuthRefreshFailed(f"the token endpoint did not answer within {self._timeout_s:g}s") from None
        except httpx.HTTPError as exc:
            # The exception's text can quote the request; name its kind only.
            raise OAuthRefreshFailed(f"the token endpoint could not be reached ({type(exc).__name__})") from None
        if response.is_redirect:
            raise OAuthRefreshFailed("the token endpoint answered with a redirect, which is not followed")
        return _grant(httpx.Response(response.status_code, headers=response.headers, content=body))
