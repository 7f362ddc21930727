"""Automation request bodies: their shapes (pydantic, as the SDK sends them)
and their contract messages. A ``new_session`` target is a session create
body without streaming, checked by the session rules and converted by the
session converter, so a target accepts exactly what a session create does."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, RootModel

from berth.session.v1 import automation_pb2 as pb
from gateway.convert import create_session_request
from gateway.errors import ApiError
from gateway.validation import (
    InlineAgent,
    InputMessage,
    Metadata,
    NonBlank,
    SessionCreateBody,
    SessionEnvironment,
    check_session_create,
    validate_body,
)

__all__ = ["automation_create", "automation_update", "AutomationCreateBody", "AutomationUpdateBody"]

_MAX_NAME = 256


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True, strict=True)


class NewSessionTargetBody(_Body):
    type: Literal["new_session"]
    environment: SessionEnvironment
    input: list[InputMessage] = Field(min_length=1)
    agent: InlineAgent | None = None
    agent_id: str | None = None
    metadata: Metadata = None
    vault_ids: list[str] | None = None


class ExistingSessionTargetBody(_Body):
    type: Literal["existing_session"]
    session_id: NonBlank
    instructions: NonBlank


TargetBody = Annotated[NewSessionTargetBody | ExistingSessionTargetBody, Field(discriminator="type")]
Name = Annotated[NonBlank, Field(max_length=_MAX_NAME)]


class PeriodicCreateBody(_Body):
    type: Literal["periodic"]
    name: Name
    expression: NonBlank
    timezone: NonBlank
    target: TargetBody
    metadata: Metadata = None


# Unix seconds up to the end of year 9999: what the int64 contract and every
# clock of the scheduler can hold.
UnixSeconds = Annotated[int, Field(ge=1, le=253_402_300_799)]


class OnceCreateBody(_Body):
    type: Literal["once"]
    name: Name
    run_at: UnixSeconds
    target: TargetBody
    metadata: Metadata = None


class AutomationCreateBody(RootModel[Annotated[PeriodicCreateBody | OnceCreateBody, Field(discriminator="type")]]):
    """The create body's schema (the OpenAPI document's); requests are
    validated by their ``type``'s model, so errors name the field."""


class AutomationUpdateBody(_Body):
    expression: NonBlank | None = None
    metadata: Metadata = None
    name: Name | None = None
    run_at: UnixSeconds | None = None
    target: TargetBody | None = None
    timezone: NonBlank | None = None


def _target(body: NewSessionTargetBody | ExistingSessionTargetBody) -> pb.AutomationTarget:
    if isinstance(body, ExistingSessionTargetBody):
        return pb.AutomationTarget(
            existing_session=pb.ExistingSessionTarget(session_id=body.session_id, instructions=body.instructions)
        )
    session = SessionCreateBody.model_validate(
        body.model_dump(mode="json", by_alias=True, exclude_unset=True, exclude={"type"})
    )
    try:
        check_session_create(session)
    except ApiError as exc:
        exc.param = f"target.{exc.param}" if exc.param else "target"
        raise
    return pb.AutomationTarget(new_session=pb.NewSessionTarget(session=create_session_request(session)))


def automation_create(data: Any) -> pb.Automation:
    kind = data.get("type") if isinstance(data, dict) else None
    if kind == "periodic":
        periodic = validate_body(PeriodicCreateBody, data)
        return pb.Automation(
            kind=pb.AUTOMATION_KIND_PERIODIC,
            name=periodic.name,
            expression=periodic.expression,
            timezone=periodic.timezone,
            target=_target(periodic.target),
            metadata=periodic.metadata or {},
        )
    if kind == "once":
        once = validate_body(OnceCreateBody, data)
        return pb.Automation(
            kind=pb.AUTOMATION_KIND_ONCE,
            name=once.name,
            run_at=once.run_at,
            target=_target(once.target),
            metadata=once.metadata or {},
        )
    if not isinstance(data, dict):
        raise ApiError(400, "validation_error", "The request body must be a JSON object.")
    raise ApiError(400, "validation_error", "type must be 'periodic' or 'once'.", param="type")


def automation_update(automation_id: str, data: Any) -> tuple[pb.Automation, list[str]]:
    """The automation with the given fields, and their names (the mask)."""
    body = validate_body(AutomationUpdateBody, data)
    given = sorted(body.model_fields_set)
    for name in given:
        if getattr(body, name) is None:
            raise ApiError(400, "validation_error", f"{name} must not be null.", param=name)
    out = pb.Automation(id=automation_id, metadata=body.metadata or {})
    for name in ("expression", "name", "run_at", "timezone"):
        if name in given:
            setattr(out, name, getattr(body, name))
    if body.target is not None:
        out.target.CopyFrom(_target(body.target))
    return out, given
