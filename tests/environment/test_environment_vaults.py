"""The vault store of the Environment service: encryption at rest with key
rotation (on SQLite and PostgreSQL), and the environment's own vault
selection for its environment-origin HTTP MCP brokers (in-memory compute)."""

from __future__ import annotations

import json
from pathlib import Path

import grpc
import pytest
from cryptography.fernet import Fernet, InvalidToken
from environment_fakes import FakeCompute
from environment_helpers import Cluster, EnvService, create_env, md, setup_config

from berth.environment.v1 import environment_service_pb2 as pb, vault_pb2, vault_service_pb2 as vpb, vault_service_pb2_grpc
from services.core.db import Database, open_database
from services.core.errors import NotFound
from services.core.settings import normalize_database_url
from services.core.key_ring import KeyRing
from services.environment.vaults import SecretInput, VaultStore, vault_key_ring

MIGRATIONS = Path(__file__).resolve().parents[2] / "services" / "environment" / "migrations" / "versions"
TOKEN = "env-vault-token-3f9a0c"
URL = "https://mcp.example.test/mcp"


def bearer(url: str = URL) -> vault_pb2.CredentialAuth:
    return vault_pb2.CredentialAuth(type="static_bearer", mcp_server_url=url)


async def store_with(db: Database, *keys: bytes) -> VaultStore:
    return VaultStore(db, KeyRing(list(keys)))


async def test_rotating_keys_re_encrypts_every_secret_with_the_new_key_and_the_old_key_can_go(database_url: str) -> None:
    old, new = Fernet.generate_key(), Fernet.generate_key()
    db = await open_database(normalize_database_url(database_url), "environment", MIGRATIONS)
    try:
        first = await store_with(db, old)
        vault = await first.create_vault("org_a", name=None, metadata={})
        row = await first.create_credential(
            "org_a", vault.id, name="c", metadata={}, auth=bearer(), secret=SecretInput(value=TOKEN)
        )
        assert TOKEN.encode() not in row.secret_ciphertext

        rotated = await store_with(db, new, old)
        assert await rotated.rotate() == 1
        assert await rotated.rotate() == 0
        only_new = await store_with(db, new)
        assert await only_new.resolve_mcp("org_a", [vault.id], credential_id="", server_url=URL) == (f"Bearer {TOKEN}", row.id)
        with pytest.raises(InvalidToken):
            await (await store_with(db, old)).resolve_mcp("org_a", [vault.id], credential_id=row.id, server_url=URL)
        # Another organization's vault resolves nothing of ours.
        with pytest.raises(NotFound):
            await only_new.resolve_mcp("org_b", [vault.id], credential_id=row.id, server_url=URL)
        assert await only_new.resolve_mcp("org_b", [vault.id], credential_id="", server_url=URL) == ("", "")
    finally:
        await db.dispose()


def test_the_embedded_key_file_is_created_once_private_to_its_owner(tmp_path: Path) -> None:
    from services.core.settings import Settings

    settings = Settings(data_dir=tmp_path)
    first = vault_key_ring(settings)
    assert (tmp_path / "vault.keys").stat().st_mode & 0o777 == 0o600
    assert vault_key_ring(settings).key_id == first.key_id
    configured = Settings(data_dir=tmp_path, vault_keys=f"{Fernet.generate_key().decode()},{Fernet.generate_key().decode()}")
    assert vault_key_ring(configured).key_id != first.key_id


async def vault_with_credential(service: EnvService, url: str = URL) -> tuple[str, str]:
    stub = vault_service_pb2_grpc.VaultServiceStub(service.channel)
    vault = (await stub.CreateVault(vpb.CreateVaultRequest(), metadata=md())).vault
    credential = (
        await stub.CreateCredential(
            vpb.CreateCredentialRequest(
                vault_id=vault.id, name="c", auth=bearer(url), secret=vault_pb2.CredentialSecret(value=TOKEN)
            ),
            metadata=md(),
        )
    ).credential
    return vault.id, credential.id


async def start_http(service: EnvService, environment_id: str, url: str, credential_id: str = "") -> None:
    await service.stub.StartMcpServer(
        pb.StartMcpServerRequest(
            environment_id=environment_id,
            label="remote",
            transport_json=json.dumps({"type": "http", "server_url": url, "headers": {"authorization": "from-config"}}),
            credential_id=credential_id,
        ),
        metadata=md(),
    )


async def test_an_environment_origin_http_broker_gets_the_environments_credential_in_its_headers(
    cluster: Cluster, sqlite_url: str, fake: FakeCompute
) -> None:
    service = await cluster.start(sqlite_url, compute=fake)
    vault_id, credential_id = await vault_with_credential(service)
    env = (await create_env(service.stub, config=setup_config(), vault_ids=[vault_id])).environment
    await start_http(service, env.id, URL)
    headers = dict(fake.mcp_transports[(env.sandbox_id, "remote")].http.headers)
    assert headers == {"Authorization": f"Bearer {TOKEN}"}

    # A credential of a vault the environment did not select is not found,
    # whatever the session's own vaults are.
    _, stranger = await vault_with_credential(service)
    other = (await create_env(service.stub, config=setup_config(), vault_ids=[vault_id])).environment
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await start_http(service, other.id, URL, credential_id=stranger)
    assert refused.value.code() == grpc.StatusCode.NOT_FOUND
    assert (other.sandbox_id, "remote") not in fake.mcp_transports


async def test_a_credential_is_never_sent_to_an_environment_origin_server_over_plain_http(
    cluster: Cluster, sqlite_url: str, fake: FakeCompute
) -> None:
    service = await cluster.start(sqlite_url, compute=fake)
    loopback = "http://127.0.0.1:9/mcp"
    vault_id, credential_id = await vault_with_credential(service, loopback)
    env = (await create_env(service.stub, config=setup_config(), vault_ids=[vault_id])).environment
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await start_http(service, env.id, loopback, credential_id=credential_id)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (env.sandbox_id, "remote") not in fake.mcp_transports
    # Without a vault selection nothing is injected: the configuration's own header stays.
    bare = (await create_env(service.stub, config=setup_config())).environment
    await start_http(service, bare.id, loopback)
    assert dict(fake.mcp_transports[(bare.sandbox_id, "remote")].http.headers) == {"authorization": "from-config"}
