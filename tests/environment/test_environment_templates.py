"""The override rules of environments created from a template, as pure
functions: set fields replace, env merges by key, and a network override
never reaches more than the template's policy."""

from __future__ import annotations

import pytest

from berth.common.v1 import common_pb2
from berth.environment.v1 import environment_pb2
from services.core.errors import InvalidArgument
from services.environment.templates import apply_overrides, narrower_network

ENABLED, DISABLED, RESTRICTED = (
    common_pb2.NETWORK_ACCESS_ENABLED,
    common_pb2.NETWORK_ACCESS_DISABLED,
    common_pb2.NETWORK_ACCESS_RESTRICTED,
)


def policy(access: int, allowed: tuple[str, ...] = (), blocked: tuple[str, ...] = ()) -> common_pb2.NetworkPolicy:
    return common_pb2.NetworkPolicy(access=access, allowed_domains=allowed, blocked_domains=blocked)


def test_set_fields_replace_the_templates_and_env_merges_key_by_key() -> None:
    base = environment_pb2.EnvironmentConfig(
        env={"A": "1", "B": "2"},
        files=[environment_pb2.InitialFile(path="/workspace/a", data=b"a")],
        packages=environment_pb2.Packages(python=["x"]),
    )
    override = environment_pb2.EnvironmentConfig(env={"B": "3"}, packages=environment_pb2.Packages(npm=["y"]))
    merged = apply_overrides(base, override, ["env", "packages"], merge_env=True)
    assert dict(merged.env) == {"A": "1", "B": "3"}
    assert (list(merged.packages.python), list(merged.packages.npm)) == ([], ["y"])
    assert [f.path for f in merged.files] == ["/workspace/a"]
    assert dict(apply_overrides(base, override, ["env"], merge_env=False).env) == {"B": "3"}
    with pytest.raises(InvalidArgument):
        apply_overrides(base, override, ["environment_template_id"], merge_env=True)


@pytest.mark.parametrize(
    ("template", "override"),
    [
        (policy(DISABLED), policy(RESTRICTED, ("example.com",))),
        (policy(RESTRICTED), policy(ENABLED)),
        (policy(RESTRICTED), policy(common_pb2.NETWORK_ACCESS_UNSPECIFIED)),
        (policy(RESTRICTED, ("example.com",)), policy(RESTRICTED)),
        (policy(RESTRICTED, ("example.com",)), policy(RESTRICTED, ("badexample.com",))),
        (policy(RESTRICTED, ("*.example.com",)), policy(RESTRICTED, ("example.com",))),
        (policy(RESTRICTED, ("api.example.com",)), policy(RESTRICTED, ("*",))),
    ],
)
def test_a_broader_network_override_is_refused(template: common_pb2.NetworkPolicy, override: common_pb2.NetworkPolicy) -> None:
    with pytest.raises(InvalidArgument):
        narrower_network(template, override, param="environment.network")


def test_a_narrower_override_keeps_the_templates_blocked_domains() -> None:
    template = policy(RESTRICTED, blocked=("evil.test",))
    merged = narrower_network(template, policy(RESTRICTED, ("example.com",)), param="environment.network")
    assert (list(merged.allowed_domains), list(merged.blocked_domains)) == (["example.com"], ["evil.test"])
    covered = narrower_network(
        policy(RESTRICTED, ("example.com", "*.cdn.test")),
        policy(RESTRICTED, ("API.example.com.", "*.a.cdn.test", "x.cdn.test")),
        param="p",
    )
    assert covered.access == RESTRICTED
    assert narrower_network(policy(ENABLED), policy(DISABLED), param="p").access == DISABLED
    assert narrower_network(policy(common_pb2.NETWORK_ACCESS_UNSPECIFIED), policy(ENABLED), param="p").access == ENABLED
