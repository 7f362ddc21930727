from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from berth.common.v1 import common_pb2  # noqa: F401  (the contract package imports)
from services.core import errors
from services.core.ids import has_prefix, new_id
from services.core.settings import Settings, normalize_database_url


def test_ids_carry_their_prefix_and_sort_by_creation() -> None:
    ids = [new_id("env") for _ in range(5000)]
    assert all(has_prefix(i, "env") for i in ids)
    assert ids == sorted(ids)
    assert len(set(ids)) == len(ids)
    assert new_id("file").startswith("file-")
    assert not has_prefix("env_../../etc", "env")


@pytest.mark.parametrize(
    ("cls", "code", "reason"),
    [
        (errors.NotFound, grpc.StatusCode.NOT_FOUND, "NOT_FOUND"),
        (errors.EnvironmentInUse, grpc.StatusCode.FAILED_PRECONDITION, "ENVIRONMENT_IN_USE"),
        (errors.InitializationRunning, grpc.StatusCode.FAILED_PRECONDITION, "INITIALIZATION_RUNNING"),
        (errors.SessionActive, grpc.StatusCode.FAILED_PRECONDITION, "SESSION_ACTIVE"),
        (errors.SandboxUnavailable, grpc.StatusCode.UNAVAILABLE, "SANDBOX_UNAVAILABLE"),
        (errors.InvalidArgument, grpc.StatusCode.INVALID_ARGUMENT, "VALIDATION_ERROR"),
    ],
)
def test_domain_errors_carry_grpc_code_and_error_info_reason(cls: type[errors.BerthError], code: grpc.StatusCode, reason: str) -> None:
    status = errors.to_rpc_status(cls("boom", param="x"))
    assert status.code == code.value[0]
    assert len(status.details) == 1
    from google.rpc import error_details_pb2

    info = error_details_pb2.ErrorInfo()
    status.details[0].Unpack(info)
    assert info.reason == reason
    assert info.metadata["param"] == "x"


def test_database_urls_select_async_drivers(tmp_path: Path) -> None:
    assert normalize_database_url("postgresql://u@h/db").startswith("postgresql+asyncpg://")
    assert normalize_database_url("postgres://u@h/db").startswith("postgresql+asyncpg://")
    assert normalize_database_url("sqlite:///x.db") == "sqlite+berth:///x.db"
    s = Settings(data_dir=tmp_path)
    assert s.database_url("session").endswith("session.db")
    assert s.database_url("session") != s.database_url("environment")
