"""The one mapping between contract messages and Agents API wire JSON.

Contract messages name their fields like the public JSON, so one descriptor
walk converts both ways; the options in ``berth/common/v1/wire.proto`` cover
the rest:

* A message with a ``type`` field and a oneof is a discriminated union: the
  oneof member whose wire type (``wire_type``, else the field name) equals
  ``type`` holds the remaining keys, flattened into the one JSON object.
* ``wire_omit`` fields are contract-only; ``wire_object`` is the constant
  ``object`` key.
* Fields with presence (``optional`` scalars, messages) that are unset are
  ``null``; repeated fields are lists; enums are their value names without
  the enum prefix, lower-cased (``TURN_STATUS_QUEUED`` -> ``"queued"``);
  ``google.protobuf.Value``/``Struct``/``ListValue`` carry opaque JSON.

``to_message`` rejects keys the contract does not know, so no field is
dropped silently.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache
from typing import Any, TypeVar

from google.protobuf import json_format
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

from berth.common.v1 import wire_pb2

__all__ = ["to_message", "to_wire"]

M = TypeVar("M", bound=Message)

# Descriptors come from the C extension (upb), whose stubs differ from the
# pure-Python classes; they are handled untyped here.
Descriptor = Any
EnumDescriptor = Any
OneofDescriptor = Any
Field = Any

_OPAQUE = frozenset({"google.protobuf.Value", "google.protobuf.Struct", "google.protobuf.ListValue"})


def _is_message(field: Field) -> bool:
    return bool(field.type == FieldDescriptor.TYPE_MESSAGE)


def _is_repeated(field: Field) -> bool:
    return bool(field.is_repeated)


def _is_map(field: Field) -> bool:
    return _is_message(field) and bool(field.message_type.GetOptions().map_entry)


def _omit(field: Field) -> bool:
    return bool(field.GetOptions().Extensions[wire_pb2.wire_omit])


@cache
def _union(descriptor: Descriptor) -> OneofDescriptor | None:
    """The discriminated oneof of a message, if it is a union."""
    if "type" not in descriptor.fields_by_name:
        return None
    for oneof in descriptor.oneofs:
        synthetic = len(oneof.fields) == 1 and oneof.name == "_" + oneof.fields[0].name
        if not synthetic:
            return oneof
    return None


@cache
def _members(oneof: OneofDescriptor) -> dict[str, Field]:
    """Wire type -> oneof member."""
    return {(f.GetOptions().Extensions[wire_pb2.wire_type] or f.name): f for f in oneof.fields}


@cache
def _wire_types(oneof: OneofDescriptor) -> dict[str, str]:
    """Oneof member name -> wire type."""
    return {f.name: t for t, f in _members(oneof).items()}


def _object(descriptor: Descriptor) -> str:
    return str(descriptor.GetOptions().Extensions[wire_pb2.wire_object])


@cache
def _enum_prefix(enum: EnumDescriptor) -> str:
    first = enum.values[0].name
    return first[: -len("UNSPECIFIED")] if first.endswith("UNSPECIFIED") else ""


def _ints(value: Any) -> Any:
    """Opaque JSON from Struct/Value: whole numbers back to ints (Struct keeps
    every number as a double)."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, list):
        return [_ints(v) for v in value]
    if isinstance(value, dict):
        return {k: _ints(v) for k, v in value.items()}
    return value


# ----- proto -> JSON -----------------------------------------------------------------------


_UNSET = object()


@dataclass(frozen=True)
class _Out:
    """How one field is rendered; computed once per message type."""

    name: str
    map: bool
    repeated: bool
    presence: bool
    message: bool
    enum: Mapping[int, str] | None
    enum_in: Mapping[str, int] | None


@dataclass(frozen=True)
class _Plan:
    object: str
    fields: tuple[_Out, ...]
    union: str | None
    wire_types: Mapping[str, str]


@cache
def _enum_names(enum: EnumDescriptor) -> dict[int, str]:
    prefix = _enum_prefix(enum)
    return {v.number: (v.name[len(prefix) :] if v.name.startswith(prefix) else v.name).lower() for v in enum.values}


def _out(field: Field) -> _Out:
    is_map = _is_map(field)
    value_field = field.message_type.fields_by_name["value"] if is_map else field
    enum = value_field.enum_type if value_field.type == FieldDescriptor.TYPE_ENUM else None
    names = _enum_names(enum) if enum is not None else None
    return _Out(
        name=field.name,
        map=is_map,
        repeated=_is_repeated(field),
        presence=bool(field.has_presence),
        message=_is_message(value_field),
        enum=names,
        enum_in={name: number for number, name in names.items()} if names is not None else None,
    )


@cache
def _plan(descriptor: Descriptor) -> _Plan:
    union = _union(descriptor)
    fields = tuple(
        _out(f) for f in descriptor.fields if not _omit(f) and not (union is not None and f.containing_oneof is union)
    )
    return _Plan(_object(descriptor), fields, union.name if union is not None else None, _wire_types(union) if union else {})


def _message_out(message: Message, nulls: bool) -> Any:
    if message.DESCRIPTOR.full_name in _OPAQUE:
        return _ints(json_format.MessageToDict(message))
    return to_wire(message, nulls=nulls)


def _scalar_out(out: _Out, value: Any) -> Any:
    return out.enum.get(value, "") if out.enum is not None else value


def _field_out(message: Message, out: _Out, nulls: bool) -> Any:
    value = getattr(message, out.name)
    if out.map:
        if out.message:
            return {k: _message_out(v, nulls) for k, v in value.items()}
        return {k: _scalar_out(out, v) for k, v in value.items()}
    if out.repeated:
        if out.message:
            return [_message_out(v, nulls) for v in value]
        return [_scalar_out(out, v) for v in value]
    if out.presence and not message.HasField(out.name):
        return None if nulls else _UNSET
    if out.message:
        return _message_out(value, nulls)
    return _scalar_out(out, value)


def to_wire(message: Message, *, nulls: bool = True) -> dict[str, Any]:
    """The public JSON object of a contract message. Unset fields with
    presence are ``null``, or left out with ``nulls=False`` (the form a
    client sent, where absent and null mean the same)."""
    plan = _plan(message.DESCRIPTOR)
    out: dict[str, Any] = {"object": plan.object} if plan.object else {}
    for field in plan.fields:
        value = _field_out(message, field, nulls)
        if value is not _UNSET:
            out[field.name] = value
    if plan.union is not None:
        member = message.WhichOneof(plan.union)
        if member is not None:
            out["type"] = plan.wire_types[member]
            out.update(to_wire(getattr(message, member), nulls=nulls))
    return out


# ----- JSON -> proto -----------------------------------------------------------------------


@dataclass(frozen=True)
class _InPlan:
    object: str
    fields: Mapping[str, _Out]
    union: Mapping[str, str] | None  # wire type -> oneof member


@cache
def _in_plan(descriptor: Descriptor) -> _InPlan:
    union = _union(descriptor)
    fields = {
        f.name: _out(f) for f in descriptor.fields if not (union is not None and f.containing_oneof is union)
    }
    members = {t: f.name for t, f in _members(union).items()} if union is not None else None
    return _InPlan(_object(descriptor), fields, members)


def _scalar_in(out: _Out, value: Any) -> Any:
    if out.enum_in is None:
        return value
    number = out.enum_in.get(value)
    if number is None:
        raise ValueError(f"unknown value {value!r}")
    return number


def _message_in(value: Any, target: Message) -> None:
    if target.DESCRIPTOR.full_name in _OPAQUE:
        json_format.ParseDict(value, target)
    elif isinstance(value, Mapping):
        to_message(value, target)
    else:
        raise ValueError("expected an object")


def _field_in(message: Message, out: _Out, value: Any) -> None:
    target = getattr(message, out.name)
    if out.map:
        for k, v in dict(value).items():
            if out.message:
                _message_in(v, target[k])
            else:
                target[k] = _scalar_in(out, v)
    elif out.repeated:
        for v in value:
            if out.message:
                _message_in(v, target.add())
            else:
                target.append(_scalar_in(out, v))
    elif out.message:
        target.SetInParent()
        _message_in(value, target)
    else:
        setattr(message, out.name, _scalar_in(out, value))


def to_message(data: Mapping[str, Any], message: M) -> M:
    """Fills ``message`` from a public JSON object and returns it. Raises
    ValueError, naming the path, for keys, union types or values the
    contract does not know."""
    plan = _in_plan(message.DESCRIPTOR)
    rest: dict[str, Any] = {}
    for key, value in data.items():
        out = plan.fields.get(key)
        if out is None:
            if not (key == "object" and plan.object):
                rest[key] = value
            continue
        if value is None:
            continue  # unset: null on the way out
        try:
            _field_in(message, out, value)
        except (ValueError, TypeError, json_format.ParseError) as exc:
            raise ValueError(f"{key}: {exc}") from exc
    if plan.union is not None:
        member = plan.union.get(str(data.get("type")))
        if member is None:
            raise ValueError(f"type: unknown type {data.get('type')!r}")
        payload = getattr(message, member)
        payload.SetInParent()
        to_message(rest, payload)
    elif rest:
        raise ValueError(f"unknown keys {sorted(rest)}")
    return message
