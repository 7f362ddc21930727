"""An OAuth token endpoint on 127.0.0.1 over https, for the refresh tests
of vault credentials: a test CA (its file is what Berth's
``outbound_ca_bundle`` trusts), and a server that checks each
refresh-token grant the way an authorization server does (grant type,
client authentication, the one refresh token currently valid) and counts
the grants it answered."""

from __future__ import annotations

import base64
import contextlib
import datetime
import ipaddress
import json
import ssl
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote_plus

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

__all__ = ["LocalCA", "make_test_ca", "Grant", "TokenServer", "token_server"]


@dataclass(frozen=True)
class LocalCA:
    bundle: Path
    cert: Path
    key: Path


def make_test_ca(directory: Path) -> LocalCA:
    """A CA and a server certificate it signed for 127.0.0.1 and localhost."""
    directory.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "Berth test CA")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    leaf = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    ca_file, cert_file, key_file = directory / "ca.pem", directory / "server.pem", directory / "server.key"
    ca_file.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    cert_file.write_bytes(leaf.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return LocalCA(bundle=ca_file, cert=cert_file, key=key_file)


@dataclass(frozen=True)
class Grant:
    """What one answered grant returns: a new access token, and a rotated
    refresh token unless None."""

    access_token: str
    refresh_token: str | None
    expires_in: int | None = 3600


@dataclass
class TokenServer:
    url: str
    client_id: str
    client_secret: str | None
    auth_method: str
    refresh_token: str
    grants: list[Grant]
    # "ok", or how the endpoint fails: "invalid_grant", "http_500", "not_json", "hang".
    mode: str = "ok"
    expect_resource: str | None = None
    expect_scope: str | None = None
    # Refresh tokens presented, in order, by the grants that were answered
    # (a request refused for bad client auth or grant type is not counted).
    presented: list[str] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)
    # Holds each answer until a second request arrives or this long passes,
    # so concurrent callers that are not serialized both reach the server.
    hold_for_second_s: float = 0.0
    _lock: threading.Condition = field(default_factory=threading.Condition)
    _arrived: int = 0
    _release: threading.Event = field(default_factory=threading.Event)

    @property
    def calls(self) -> int:
        return len(self.presented)

    def _client_ok(self, headers: dict[str, str], form: dict[str, str]) -> bool:
        authorization = headers.get("authorization", "")
        if self.auth_method == "client_secret_basic":
            if not authorization.startswith("Basic ") or "client_secret" in form:
                return False
            user, _, password = base64.b64decode(authorization[6:]).decode().partition(":")
            return (unquote_plus(user), unquote_plus(password)) == (self.client_id, self.client_secret)
        if authorization:
            return False
        if self.auth_method == "client_secret_post":
            return form.get("client_id") == self.client_id and form.get("client_secret") == self.client_secret
        return form.get("client_id") == self.client_id and "client_secret" not in form

    def answer(self, headers: dict[str, str], body: bytes) -> tuple[int, bytes]:
        with self._lock:
            self._arrived += 1
            self._lock.notify_all()
            if self.hold_for_second_s:
                self._lock.wait_for(lambda: self._arrived >= 2, timeout=self.hold_for_second_s)
        if self.mode == "hang":
            self._release.wait(30)
            return 500, b""
        if self.mode == "http_500":
            return 500, b'{"error": "server_error"}'
        if self.mode == "not_json":
            return 200, b"<html>a login page</html>"
        if headers.get("content-type", "").split(";")[0] != "application/x-www-form-urlencoded":
            return 400, b'{"error": "invalid_request"}'
        form = {k: v[0] for k, v in parse_qs(body.decode(), keep_blank_values=True).items()}
        if form.get("grant_type") != "refresh_token":
            return 400, b'{"error": "unsupported_grant_type"}'
        if not self._client_ok(headers, form):
            return 401, b'{"error": "invalid_client"}'
        if form.get("resource") != self.expect_resource or form.get("scope") != self.expect_scope:
            return 400, b'{"error": "invalid_scope"}'
        with self._lock:
            token = form.get("refresh_token", "")
            if self.mode == "invalid_grant" or token != self.refresh_token or not self.grants:
                self.refused.append(token)
                return 400, json.dumps({"error": "invalid_grant", "error_description": f"bad token {token}"}).encode()
            self.presented.append(token)
            grant = self.grants.pop(0)
            if grant.refresh_token is not None:
                # Single use: the spent token is refused from now on.
                self.refresh_token = grant.refresh_token
        answer: dict[str, object] = {"access_token": grant.access_token, "token_type": "Bearer"}
        if grant.expires_in is not None:
            answer["expires_in"] = grant.expires_in
        if grant.refresh_token is not None:
            answer["refresh_token"] = grant.refresh_token
        return 200, json.dumps(answer).encode()


@contextlib.contextmanager
def token_server(
    ca: LocalCA,
    *,
    client_id: str,
    client_secret: str | None,
    auth_method: str,
    refresh_token: str,
    grants: Sequence[Grant],
    **options: object,
) -> Iterator[TokenServer]:
    """A token endpoint at ``https://127.0.0.1:<port>/token``, in threads."""
    holder: list[TokenServer] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - the stdlib's name
            length = int(self.headers.get("content-length") or 0)
            body = self.rfile.read(length)
            status, payload = holder[0].answer({k.lower(): v for k, v in self.headers.items()}, body)
            self.send_response(status)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the stdlib's name
            return

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    httpd.daemon_threads = True
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(ca.cert, ca.key)
    httpd.socket = context.wrap_socket(httpd.socket, server_side=True)
    server = TokenServer(
        url=f"https://127.0.0.1:{httpd.server_address[1]}/token",
        client_id=client_id,
        client_secret=client_secret,
        auth_method=auth_method,
        refresh_token=refresh_token,
        grants=list(grants),
        **options,  # type: ignore[arg-type]
    )
    holder.append(server)
    thread = threading.Thread(target=httpd.serve_forever, args=(0.05,), name="token-server", daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server._release.set()
        httpd.shutdown()
        httpd.server_close()
        thread.join(10)
