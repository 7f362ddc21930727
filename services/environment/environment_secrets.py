"""Which environments may use ``environment_variable`` vault credentials.

Their secrets are substituted by the egress proxy of a ``restricted``
sandbox (``services/sandbox/egress.py``); no other network mode has one,
so an environment with another mode is refused when it selects such a
credential (creation), and its setup fails closed when one was added to
its vaults later (the sandbox is never created with it).
"""

from __future__ import annotations

from collections.abc import Sequence

from berth.common.v1 import common_pb2
from berth.environment.v1 import vault_pb2
from berth.sandbox.v1 import sandbox_pb2
from services.environment.vaults import EnvironmentSecret

__all__ = ["environment_secrets_problem", "secret_substitutions"]


def environment_secrets_problem(
    network: common_pb2.NetworkPolicy, credentials: Sequence[vault_pb2.CredentialAuth]
) -> str:
    """Why an environment with ``network`` cannot use these
    environment_variable credentials; empty when it can."""
    if not credentials:
        return ""
    if network.access != common_pb2.NETWORK_ACCESS_RESTRICTED:
        return (
            "environment_variable vault credentials need network.access restricted "
            "(only the egress proxy of a restricted network substitutes their secrets)"
        )
    if not network.allowed_domains and any(c.networking.type == "unrestricted" for c in credentials):
        return "an environment_variable credential with unrestricted networking needs network.allowed_domains"
    return ""


def secret_substitutions(secrets: Sequence[EnvironmentSecret]) -> list[sandbox_pb2.SecretSubstitution]:
    """What the Sandbox service is given of an environment's secrets (at
    sandbox creation and when a credential changes)."""
    return [
        sandbox_pb2.SecretSubstitution(
            env_name=s.secret_name,
            value=s.value,
            any_allowed_host=s.any_allowed_host,
            allowed_hosts=list(s.allowed_hosts),
            credential_id=s.credential_id,
        )
        for s in secrets
    ]
