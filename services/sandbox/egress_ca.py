"""The egress CA: the certificate authority with which the egress proxy of
a ``restricted`` sandbox terminates TLS to the hosts where it substitutes
``environment_variable`` vault secrets (``egress_substitution.py``).

One CA per Sandbox service data dir (that is, per sandbox node), made on
first start: ``<data_dir>/egress-ca/ca.key`` (0600, in a 0700 directory
that no sandbox mounts) and ``ca.crt``. Sandboxes trust it through their CA
bundle (``bundle_with``): the local backend's generated ``/etc`` and the
Docker backend's mounted bundle both hold the configured bundle plus this
certificate. Per node rather than per sandbox because a sandbox's trust
store is shared (the local ``/etc`` is one directory for every sandbox, and
pooled sandboxes are made before anyone knows whom they will serve), and a
per-sandbox CA would protect nothing more: its key would sit in the same
service, and only that service's proxy ever issues a certificate with it,
only for a host it substitutes for.

Leaf certificates (EC P-256, one day) are issued in memory per host and
cached.
"""

from __future__ import annotations

import datetime
import hashlib
import ipaddress
import os
import ssl
import tempfile
import threading
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from services.core.logging import get_logger

__all__ = ["EgressCA"]

log = get_logger(__name__)

_CA_DAYS = 3650
_LEAF_LIFETIME = datetime.timedelta(days=1)
_BACKDATE = datetime.timedelta(hours=1)
_MAX_CACHED = 512


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


class EgressCA:
    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.cert_path = directory / "ca.crt"
        self._key, self._cert = self._load_or_create()
        self.cert_pem = self._cert.public_bytes(serialization.Encoding.PEM)
        self._leaves: dict[str, tuple[datetime.datetime, ssl.SSLContext]] = {}
        self._lock = threading.Lock()

    def _load_or_create(self) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
        key_path = self.directory / "ca.key"
        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(self.directory, 0o700)
        if key_path.exists() and self.cert_path.exists():
            key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
            if not isinstance(key, ec.EllipticCurvePrivateKey):
                raise ValueError(f"{key_path} is not an EC private key")
            return key, x509.load_pem_x509_certificate(self.cert_path.read_bytes())
        key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "Berth sandbox egress CA")])
        now = _now()
        cert = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - _BACKDATE)
            .not_valid_after(now + datetime.timedelta(days=_CA_DAYS))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=False, content_commitment=False, key_encipherment=False, data_encipherment=False,
                    key_agreement=False, key_cert_sign=True, crl_sign=True, encipher_only=False, decipher_only=False,
                ),  # fmt: skip
                critical=True,
            )
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA256())
        )
        pem_key = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
        fd = os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(pem_key)
        self.cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        log.info("egress_ca_created", path=str(self.cert_path))
        return key, cert

    def bundle_with(self, base: Path | None) -> Path:
        """A CA bundle holding ``base`` (if it is a file) and this CA, written
        next to the CA and named by its content."""
        data = base.read_bytes() if base is not None and base.is_file() else b""
        if data and not data.endswith(b"\n"):
            data += b"\n"
        data += self.cert_pem
        target = self.directory / f"bundle-{hashlib.sha256(data).hexdigest()[:16]}.crt"
        if not target.exists():
            fd, staged = tempfile.mkstemp(dir=self.directory, prefix=".bundle-")
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.chmod(staged, 0o644)
            os.replace(staged, target)
        return target

    def server_context(self, host: str) -> ssl.SSLContext:
        """A TLS server context presenting a certificate for ``host`` (a
        DNS name or an IP address) issued by this CA; HTTP/1.1 only."""
        with self._lock:
            cached = self._leaves.get(host)
            if cached is not None and cached[0] > _now() + datetime.timedelta(hours=1):
                return cached[1]
            expires, context = self._issue(host)
            if len(self._leaves) >= _MAX_CACHED:
                self._leaves.clear()
            self._leaves[host] = (expires, context)
            return context

    def _issue(self, host: str) -> tuple[datetime.datetime, ssl.SSLContext]:
        key = ec.generate_private_key(ec.SECP256R1())
        try:
            san: x509.GeneralName = x509.IPAddress(ipaddress.ip_address(host))
        except ValueError:
            san = x509.DNSName(host)
        now = _now()
        expires = now + _LEAF_LIFETIME
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, host[:64])]))
            .issuer_name(self._cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - _BACKDATE)
            .not_valid_after(expires)
            .add_extension(x509.SubjectAlternativeName([san]), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(self._key.public_key()), critical=False
            )
            .sign(self._key, hashes.SHA256())
        )
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        # Only HTTP/1.1 is parsed; a client offering only h2 gets no ALPN answer.
        context.set_alpn_protocols(["http/1.1"])
        # load_cert_chain reads files only: a private, short-lived pair.
        with tempfile.TemporaryDirectory(prefix="berth-leaf-") as scratch:
            chain = Path(scratch) / "leaf.pem"
            fd = os.open(chain, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
                f.write(cert.public_bytes(serialization.Encoding.PEM))
                f.write(self.cert_pem)
            context.load_cert_chain(chain)
        return expires, context
