"""Settings read from ``BERTH_*`` variables: the sandbox node list and the
docker warm pool's networks."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from services.core.settings import Settings


def test_without_a_node_list_the_one_sandbox_address_is_the_unnamed_default_node(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BERTH_SANDBOX_ADDR", "sandbox:50053")
    monkeypatch.setenv("BERTH_SANDBOX_ADDRS", "")
    assert Settings().sandbox_nodes() == {"": "sandbox:50053"}


def test_sandbox_nodes_are_named_by_their_address_unless_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BERTH_SANDBOX_ADDRS", "a=h1:50053, h2:50053")
    assert Settings().sandbox_nodes() == {"a": "h1:50053", "h2:50053": "h2:50053"}
    monkeypatch.setenv("BERTH_SANDBOX_ADDRS", '["b=h2:50053", "a=h1:50053"]')
    assert list(Settings().sandbox_nodes().items()) == [("b", "h2:50053"), ("a", "h1:50053")]


@pytest.mark.parametrize("value", ["a=h1:1,a=h2:2", "a=", "=h:1", "a b=h:1", "[1"])
def test_a_sandbox_node_list_with_a_duplicate_name_or_a_bad_entry_is_refused(
    monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    monkeypatch.setenv("BERTH_SANDBOX_ADDRS", value)
    with pytest.raises(ValidationError):
        Settings()


def test_the_docker_pool_pre_fills_the_default_size_unless_told_otherwise(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("BERTH_DOCKER_POOL_SIZES", raising=False)
    assert Settings().docker_pool_sizes == ["medium"]
    monkeypatch.setenv("BERTH_DOCKER_POOL_SIZES", " small,large ")
    assert Settings().docker_pool_sizes == ["small", "large"]
    monkeypatch.setenv("BERTH_DOCKER_POOL_SIZES", "")
    assert Settings().docker_pool_sizes == []


def test_an_unknown_size_in_the_docker_pool_list_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BERTH_DOCKER_POOL_SIZES", "medium,huge")
    with pytest.raises(ValidationError):
        Settings()
