"""Request bodies, validated with models that mirror the SDK's params.

Top-level bodies and environment configurations reject unknown fields, so a
typo fails loudly; nested agent configuration (tools, text formats...)
accepts unknown keys and ignores them (the contract has no place for them). A failure is a 400
``validation_error`` whose ``param`` is the dotted path of the first problem
(``environment.files.0.path``); union tags never appear in it.

These models, with the rules between fields below them (``check_*``), are
the only check of a body's shape: ``gateway.convert`` maps a validated body
to its contract message once, and an explicit ``null`` (clear) stays
distinguishable from an absent key (keep) through the fields a model
records as set. Fields checked by ``_not_null`` may be absent but
not ``null``.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import re
from collections.abc import Iterable, Mapping
from posixpath import normpath
from typing import Annotated, Any, Literal, TypeVar

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, RootModel, ValidationError, field_validator

from berth.session.v1 import session_service_pb2
from gateway.errors import ApiError
from services.core.wire_json import to_message
from services.core.workspace_limits import path_limit_problem

__all__ = [
    "parse_json_body",
    "WebhookEndpointCreateBody",
    "WebhookEndpointUpdateBody",
    "WebhookRotateSecretBody",
    "check_text",
    "MAX_JSON_DEPTH",
    "validate_body",
    "canonical_json",
    "workspace_path",
    "workspace_dir",
    "decode_base64",
    "AgentCreateBody",
    "AgentUpdateBody",
    "EnvironmentCreateBody",
    "HostedConfigFields",
    "HostedEnvironmentConfig",
    "TemplateBody",
    "SessionCreateBody",
    "SessionUpdateBody",
    "EventsCreateBody",
    "input_events",
    "check_hosted_config",
    "metadata_query",
    "check_session_create",
    "check_agent_config",
    "check_session_update",
    "EnvironmentFileCreateBody",
    "InlineFile",
    "FileIdFile",
]

M = TypeVar("M", bound=BaseModel)

_MAX_METADATA_PAIRS = 16
_MAX_TOOLS_BYTES = 8 * 1024 * 1024
_FUNCTION_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


# --- scalar checks -------------------------------------------------------------------


def workspace_path(value: str) -> str:
    """An absolute, normalized POSIX path strictly under /workspace, short
    and shallow enough for any sandbox."""
    problem = path_limit_problem(value)
    if problem is not None:
        raise ValueError(f"path {problem}")
    if "\x00" in value or "\\" in value:
        raise ValueError("path must not contain NUL or backslash characters")
    if not value.startswith("/workspace/"):
        raise ValueError("path must be an absolute path under /workspace")
    parts = value.split("/")[2:]
    if any(p in ("", ".", "..") for p in parts) or normpath(value) != value:
        raise ValueError("path must not contain empty, '.' or '..' components")
    return value


def workspace_dir(value: str) -> str:
    """Like workspace_path, but /workspace itself is allowed."""
    if value.rstrip("/") == "/workspace":
        return "/workspace"
    return workspace_path(value.rstrip("/"))


def decode_base64(value: str) -> bytes:
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ValueError("must be standard base64") from exc


def _base64(value: str) -> str:
    decode_base64(value)
    return value


def _metadata(value: dict[str, str] | None) -> dict[str, str] | None:
    if value is None:
        return None
    if len(value) > _MAX_METADATA_PAIRS:
        raise ValueError(f"at most {_MAX_METADATA_PAIRS} metadata pairs are allowed")
    for k, v in value.items():
        if not 1 <= len(k) <= 64:
            raise ValueError("metadata keys must be 1 to 64 characters")
        if len(v) > 512:
            raise ValueError("metadata values must be at most 512 characters")
    return value


_METADATA_QUERY = re.compile(r"^metadata\[(.*)\]$", re.DOTALL)


def metadata_query(params: Iterable[tuple[str, str]]) -> dict[str, str]:
    """The ``metadata[key]=value`` pairs of a list's query (the SDK's
    deepObject form), under the same limits as stored metadata."""
    pairs: dict[str, str] = {}
    for name, value in params:
        match = _METADATA_QUERY.match(name)
        if match is None:
            if name == "metadata" or name.startswith("metadata["):
                raise ApiError(400, "validation_error", "Use metadata[key]=value pairs.", param="metadata")
            continue
        if match.group(1) in pairs:
            raise ApiError(400, "validation_error", "A metadata key is given twice.", param=f"metadata[{match.group(1)}]")
        pairs[match.group(1)] = value
    try:
        _metadata(pairs)
    except ValueError as exc:
        raise ApiError(400, "validation_error", str(exc), param="metadata") from None
    return pairs


def _non_blank(value: str) -> str:
    if not value.strip():
        raise ValueError("must be a non-empty string")
    return value


def _function_name(value: str) -> str:
    if not _FUNCTION_NAME.match(value):
        raise ValueError("function names use 1 to 64 letters, digits, _ or -")
    return value


NonBlank = Annotated[str, AfterValidator(_non_blank)]
FunctionName = Annotated[str, AfterValidator(_function_name)]
WorkspacePath = Annotated[str, AfterValidator(workspace_path)]
Base64Str = Annotated[str, AfterValidator(_base64)]
Metadata = Annotated[dict[str, str] | None, AfterValidator(_metadata)]
ServiceTier = Literal["auto", "default", "flex", "priority", "fast", "ultrafast"]


# Scalars are typed strictly: the SDK sends JSON types, so ``"stream": "yes"``
# or ``"enabled": 1`` is a mistake to report, not a value to coerce.
class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True, strict=True)


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow", populate_by_name=True, strict=True)


def _reject_null(value: Any) -> Any:
    if value is None:
        raise ValueError("must not be null")
    return value


def _not_null(*fields: str) -> Any:
    """A validator for fields that may be absent but not null."""
    return field_validator(*fields, mode="before")(_reject_null)


# --- environments --------------------------------------------------------------------


class InlineFile(_Strict):
    type: Literal["inline"]
    path: WorkspacePath
    data: Base64Str


class FileIdFile(_Strict):
    type: Literal["file_id"]
    path: WorkspacePath
    file_id: str = Field(min_length=1)


HostedFile = Annotated[InlineFile | FileIdFile, Field(discriminator="type")]


class Network(_Strict):
    access: Literal["enabled", "disabled", "restricted"]
    allowed_domains: list[str] | None = None
    blocked_domains: list[str] | None = None


class Packages(_Strict):
    npm: list[str] | None = None
    python: list[str] | None = None
    system: list[str] | None = None


class SetupCommand(_Strict):
    command: NonBlank
    cwd: str | None = None


class InlineSource(_Strict):
    type: Literal["base64"]
    media_type: Literal["application/zip"]
    data: Base64Str


class SkillReference(_Strict):
    type: Literal["skill_reference"]
    skill_id: str = Field(min_length=1)
    version: str | None = None


class InlineCapability(_Strict):
    type: Literal["inline"]
    name: str = Field(min_length=1)
    description: str
    source: InlineSource


HostedSkill = Annotated[SkillReference | InlineCapability, Field(discriminator="type")]


class Desktop(_Strict):
    enabled: bool


class HostedConfigFields(_Strict):
    """The hosted configuration an environment and a template share."""

    capability_directories: list[str] | None = None
    desktop: Desktop | None = None
    env: dict[str, str] | None = None
    files: list[HostedFile] | None = None
    network: Network | None = None
    packages: Packages | None = None
    plugins: list[InlineCapability] | None = None
    setup_commands: list[SetupCommand] | None = None
    skills: list[HostedSkill] | None = None


class HostedEnvironmentConfig(HostedConfigFields):
    """``{"type": "openai_hosted", ...}`` as configuration (no environment_id)."""

    type: Literal["openai_hosted"]
    container_size: Literal["small", "medium", "large"] | None = None
    environment_template_id: str | None = Field(default=None, min_length=1)


class TemplateBody(HostedConfigFields):
    """``environments.templates.create`` and ``.update``: every field optional;
    on update an omitted field is kept and a null one reset to its default."""

    name: str | None = None


class EnvironmentCreateBody(_Strict):
    environment: HostedEnvironmentConfig
    vault_ids: list[str] | None = Field(default=None, max_length=10)


class SessionHostedEnvironment(HostedEnvironmentConfig):
    """In a session, openai_hosted may instead name an existing environment."""

    environment_id: str | None = None


class NoEnvironment(_Strict):
    type: Literal["none"]


class ReferenceEnvironment(_Strict):
    """Rebyte extension: share an existing environment. Only these two keys."""

    type: Literal["reference"]
    environment_id: str = Field(min_length=1)


class SelfHostedEnvironment(_Strict):
    type: Literal["self_hosted"]
    workspace_directory: str
    capability_directories: list[str] | None = None


SessionEnvironment = Annotated[
    NoEnvironment | SessionHostedEnvironment | ReferenceEnvironment | SelfHostedEnvironment,
    Field(discriminator="type"),
]


# --- agents ----------------------------------------------------------------------------


class FunctionTool(_Open):
    _check_nulls = _not_null("defer_loading")
    type: Literal["function"]
    name: FunctionName
    description: str
    parameters: dict[str, Any]
    defer_loading: bool | None = None
    async_: bool | None = Field(default=None, alias="async")


class McpHttpTransport(_Open):
    type: Literal["http"]
    server_url: NonBlank
    headers: dict[str, str] | None = None
    authorization: str | None = None


class McpStdioTransport(_Open):
    type: Literal["stdio"]
    command: NonBlank
    cwd: NonBlank
    args: list[str] | None = None
    env: dict[str, str] | None = None
    env_vars: list[str] | None = None


class McpTool(_Open):
    _check_nulls = _not_null("required")
    type: Literal["mcp"]
    server_label: NonBlank
    transport: Annotated[McpHttpTransport | McpStdioTransport, Field(discriminator="type")]
    allowed_tools: list[str] | None = None
    connection_origin: Literal["service", "environment"] | None = None
    credential_id: str | None = None
    request_metadata: dict[str, Any] | None = None
    required: bool | None = None


class WebSearchTool(_Open):
    type: Literal["web_search"]
    allowed_domains: list[str] | None = None
    context_size: Literal["low", "medium", "high"] | None = None
    location: Any = None
    mode: Literal["disabled", "cached", "live"] | None = None


class ComputerUseTool(_Open):
    _check_nulls = _not_null("include_screenshots")
    type: Literal["computer_use"]
    include_screenshots: bool | None = None


class ProgrammaticToolCallingTool(_Open):
    _check_nulls = _not_null("enabled")
    type: Literal["programmatic_tool_calling"]
    enabled: bool | None = None


class ToolSearchTool(_Open):
    type: Literal["tool_search"]


class AutomationsTool(_Open):
    type: Literal["automations"]


Tool = Annotated[
    FunctionTool
    | McpTool
    | WebSearchTool
    | ComputerUseTool
    | ProgrammaticToolCallingTool
    | ToolSearchTool
    | AutomationsTool,
    Field(discriminator="type"),
]


class MultiAgent(_Open):
    enabled: bool
    max_concurrent_subagents: int | None = Field(default=None, ge=1, le=2**31 - 1)  # int32 in the contract


class Reasoning(_Open):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    summary: Literal["concise", "detailed", "auto"] | None = None


class TextFormatText(_Open):
    type: Literal["text"]


class TextFormatJsonSchema(_Open):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class Text(_Open):
    format: Annotated[TextFormatText | TextFormatJsonSchema, Field(discriminator="type")] | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class Compaction(_Open):
    async_: bool | None = Field(default=None, alias="async")


class Experimental(_Open):
    _check_nulls = _not_null("time_awareness")
    time_awareness: bool | None = None


def _tools_size(value: Any) -> Any:
    if isinstance(value, list) and len(json.dumps(value, separators=(",", ":")).encode()) > _MAX_TOOLS_BYTES:
        raise ValueError("the tool list must fit within 8 MiB of compact JSON")
    return value


class _AgentConfig(_Strict):
    _check_tools_size = field_validator("tools", mode="before")(_tools_size)

    instructions: str | None = None
    multi_agent: MultiAgent | None = None
    reasoning: Reasoning | None = None
    service_tier: ServiceTier | None = None
    text: Text | None = None
    tools: list[Tool] | None = None
    compaction: Compaction | None = None
    experimental: Experimental | None = None


class AgentCreateBody(_AgentConfig):
    model: NonBlank
    name: str | None = None
    metadata: Metadata = None


class AgentUpdateBody(_AgentConfig):
    _check_model = _not_null("model")

    model: NonBlank | None = None
    name: str | None = None
    metadata: Metadata = None


class InlineAgent(_AgentConfig):
    _check_model = _not_null("model")

    model: NonBlank | None = None


# --- sessions and input ------------------------------------------------------------------


class InputText(_Strict):
    type: Literal["input_text"]
    text: str


class InputImage(_Strict):
    type: Literal["input_image"]
    image_url: str = Field(min_length=1)


InputContent = Annotated[InputText | InputImage, Field(discriminator="type")]


class InputMessage(_Strict):
    role: Literal["user"]
    content: list[InputContent] = Field(min_length=1)
    type: Literal["message"] | None = None


class PromptCacheOptions(_Strict):
    ttl: Literal["30m", "12h"] | None = None


class StreamOptions(_Strict):
    include_obfuscation: bool | None = None


class SpendControl(_Strict):
    """``spend_control``: a per-session budget in USD cents; a null limit is
    an unlimited session (and on update removes the limit, spend kept)."""

    limit: int | None = Field(ge=1, le=10**12)


class SessionCreateBody(_Strict):
    environment: SessionEnvironment
    agent: InlineAgent | None = None
    agent_id: str | None = None
    input: str | list[InputMessage] | None = None
    metadata: Metadata = None
    prompt_cache_options: PromptCacheOptions | None = None
    review: Literal["none", "auto_review"] | None = None
    spend_control: SpendControl | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    vault_ids: list[str] | None = None


class ReasoningEffort(_Strict):
    """A session's snapshot changes only its reasoning effort."""

    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None


class SessionAgentUpdate(_Strict):
    _check_model = _not_null("model", "reasoning")
    _check_tools_size = field_validator("tools", mode="before")(_tools_size)

    model: NonBlank | None = None
    reasoning: ReasoningEffort | None = None
    service_tier: ServiceTier | None = None
    tools: list[Tool] | None = None


class SessionUpdateBody(_Strict):
    agent: SessionAgentUpdate | None = None
    metadata: Metadata = None
    prompt_cache_options: PromptCacheOptions | None = None
    review: Literal["none", "auto_review"] | None = None
    spend_control: SpendControl | None = None
    # Replaces the session's vaults; null or [] clears them.
    vault_ids: list[str] | None = None


class InputMessageEvent(_Strict):
    type: Literal["agent.session.input.message"]
    input: list[InputMessage] = Field(min_length=1)


class InputCancelEvent(_Strict):
    type: Literal["agent.session.input.cancel"]


class InputToolResultEvent(_Strict):
    type: Literal["agent.session.input.tool_result"]
    turn_id: str = Field(min_length=1)
    call_id: str = Field(min_length=1)
    success: bool
    output: str | list[InputContent] | None = None
    error: str | None = None


InputEvent = Annotated[InputMessageEvent | InputCancelEvent | InputToolResultEvent, Field(discriminator="type")]


class EventsCreateBody(_Strict):
    events: list[InputEvent] = Field(min_length=1)


def input_events(body: EventsCreateBody) -> list[session_service_pb2.InputEvent]:
    """The validated input events as contract messages: converted once, here."""
    return [to_message(e.model_dump(exclude_unset=True), session_service_pb2.InputEvent()) for e in body.events]


class EnvironmentFileCreateBody(RootModel[HostedFile]):
    """The files API body is the file object itself: ``{type, path, data | file_id}``."""

    model_config = ConfigDict(strict=True)


# --- rules between fields --------------------------------------------------------------

_INLINE_CONFIG_FIELDS = (
    "capability_directories",
    "desktop",
    "env",
    "environment_template_id",
    "files",
    "network",
    "packages",
    "plugins",
    "setup_commands",
    "skills",
)


def check_hosted_config(config: HostedConfigFields, param_prefix: str) -> None:
    """Rules between fields of an inline configuration or a template. SDK
    fields Berth does not implement are rejected, not silently ignored."""
    param_prefix = f"{param_prefix}." if param_prefix else ""
    if config.desktop is not None and config.desktop.enabled:
        raise ApiError(400, "validation_error", "Desktop environments are not supported.", param=f"{param_prefix}desktop")
    network = config.network
    if network is None:
        return
    if network.access != "restricted" and (network.allowed_domains or network.blocked_domains):
        raise ApiError(
            400, "validation_error", "Domain lists require access 'restricted'.", param=f"{param_prefix}network.access"
        )
    if network.allowed_domains and network.blocked_domains:
        raise ApiError(
            400,
            "validation_error",
            "blocked_domains cannot be combined with allowed_domains.",
            param=f"{param_prefix}network.blocked_domains",
        )
    for field_name in ("allowed_domains", "blocked_domains"):
        for domain in getattr(network, field_name) or []:
            if not domain or any(c in domain for c in " /\x00") or (field_name == "blocked_domains" and "*" in domain):
                raise ApiError(
                    400, "validation_error", f"Invalid domain {domain!r}.", param=f"{param_prefix}network.{field_name}"
                )


# Tool types of the SDK that Berth does not implement, and why.
_UNSUPPORTED_TOOLS: dict[type[BaseModel], str] = {
    WebSearchTool: "web_search tools are not supported: no search backend is configured.",
    ComputerUseTool: "computer_use tools are not supported.",
    ProgrammaticToolCallingTool: "programmatic_tool_calling tools are not supported yet.",
    ToolSearchTool: "tool_search tools are not supported.",
}


def _refuse(message: str, param: str) -> ApiError:
    return ApiError(400, "validation_error", message, param=param)


def _extra(model: BaseModel | None, param: str) -> None:
    """An open model (the SDK may grow fields) still refuses keys Berth would ignore."""
    if model is not None and model.model_extra:
        key = sorted(model.model_extra)[0]
        raise _refuse(f"Unknown parameter: {key!r}.", f"{param}.{key}")


def check_agent_config(body: _AgentConfig | SessionAgentUpdate, prefix: str = "") -> None:
    """Settings and tool types the SDK offers but Berth does not implement
    are refused with a 400 naming them, never accepted and ignored."""
    for index, tool in enumerate(body.tools or []):
        param = f"{prefix}tools.{index}"
        reason = _UNSUPPORTED_TOOLS.get(type(tool))
        if reason is not None:
            raise _refuse(reason, f"{param}.type")
        _extra(tool, param)
        if isinstance(tool, FunctionTool):
            if tool.defer_loading:
                raise _refuse("defer_loading is not supported (there is no tool_search).", f"{param}.defer_loading")
            if tool.async_:
                raise _refuse("Asynchronous function tools are not supported.", f"{param}.async")
        if isinstance(tool, McpTool):
            _extra(tool.transport, f"{param}.transport")
    if isinstance(body, SessionAgentUpdate):
        return
    if body.multi_agent is not None:
        _extra(body.multi_agent, f"{prefix}multi_agent")
    _extra(body.compaction, f"{prefix}compaction")
    _extra(body.reasoning, f"{prefix}reasoning")
    _extra(body.text, f"{prefix}text")
    if body.text is not None:
        _extra(body.text.format, f"{prefix}text.format")
    _extra(body.experimental, f"{prefix}experimental")


def check_session_create(body: SessionCreateBody) -> None:
    """Rules between fields of a session create body."""
    env = body.environment
    if isinstance(env, SelfHostedEnvironment):
        raise ApiError(400, "validation_error", "Self-hosted environments are not supported.", param="environment.type")
    if isinstance(env, SessionHostedEnvironment):
        if env.environment_id is not None:
            extra = [f for f in _INLINE_CONFIG_FIELDS if f in env.model_fields_set]
            if extra:
                raise ApiError(
                    400,
                    "validation_error",
                    "environment_id cannot be combined with inline configuration.",
                    param=f"environment.{extra[0]}",
                )
        else:
            check_hosted_config(env, "environment")
    if body.agent is not None:
        check_agent_config(body.agent, "agent.")
    if body.agent_id is None and (body.agent is None or body.agent.model is None):
        raise ApiError(400, "validation_error", "agent.model is required without agent_id.", param="agent.model")
    if body.stream_options is not None and not body.stream:
        raise ApiError(400, "validation_error", "stream_options requires stream: true.", param="stream_options")
    if body.input is not None and not body.input:
        raise ApiError(400, "validation_error", "input must not be empty.", param="input")
    has_input = bool(body.input)
    if not has_input and (isinstance(env, NoEnvironment) or body.stream):
        raise ApiError(
            400,
            "validation_error",
            "input is required for environment type 'none' and for streaming creation.",
            param="input",
        )


def check_session_update(body: SessionUpdateBody) -> None:
    if body.agent is not None:
        check_agent_config(body.agent, "agent.")


# --- parsing ----------------------------------------------------------------------------


# JSON that Berth can store and hand on unchanged. RFC 8259 has no NaN or
# Infinity; PostgreSQL text and jsonb cannot hold NUL; a lone surrogate
# cannot be encoded as UTF-8. Nesting is bounded by what the contract can
# carry: a JSON object inside a ``google.protobuf.Struct`` costs three of
# protobuf's 100 levels of message recursion, so a tool's ``parameters`` or a
# ``text.format.schema`` (three levels below the body) nested past ~30 levels
# would be accepted here and fail to decode in a service. 32 levels from the
# body root leaves room for the messages that wrap a Struct (request, agent,
# tool, session, event). Integer literals are bounded too (the widest
# contract field is int64; a schema's bounds fit comfortably), so Python's
# 4,300-digit conversion limit is never reached.
MAX_JSON_DEPTH = 32
MAX_INT_DIGITS = 32


class _Unrepresentable(ValueError):
    pass


def _parse_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise _Unrepresentable(f"integer literals are limited to {MAX_INT_DIGITS} digits")
    return int(text)


def _parse_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _Unrepresentable("numbers must be finite")
    return value


def _parse_constant(name: str) -> Any:
    raise _Unrepresentable(f"{name} is not valid JSON")


def check_text(value: str, param: str | None) -> None:
    """A string the stores can hold: no NUL, no lone surrogate. Bodies,
    query parameters and headers all pass through here."""
    if "\x00" in value:
        raise ApiError(400, "validation_error", "Strings must not contain NUL characters.", param=param)
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ApiError(400, "invalid_json", "Strings must not contain lone surrogates.", param=param) from exc


def _check_string(value: str, path: list[str | int]) -> None:
    if "\x00" in value or not value.isascii():
        check_text(value, ".".join(str(p) for p in path) or None)


def _check_tree(data: Any) -> None:
    """Walks the parsed body without recursion: depth, strings and keys."""
    stack: list[tuple[Any, list[str | int]]] = [(data, [])]
    while stack:
        value, path = stack.pop()
        if isinstance(value, str):
            _check_string(value, path)
            continue
        if not isinstance(value, (dict, list)):
            continue
        if len(path) >= MAX_JSON_DEPTH:
            raise ApiError(400, "invalid_json", f"JSON nesting is limited to {MAX_JSON_DEPTH} levels.")
        if isinstance(value, dict):
            for key, item in value.items():
                _check_string(key, path)
                stack.append((item, [*path, key]))
        else:
            stack.extend((item, [*path, i]) for i, item in enumerate(value))


def parse_json_body(raw: bytes) -> Any:
    """The body as JSON; an empty body is ``{}``. Malformed JSON, and JSON
    outside the limits above, is a 400."""
    if not raw.strip():
        return {}
    try:
        data = json.loads(
            raw, parse_int=_parse_int, parse_float=_parse_float, parse_constant=_parse_constant
        )
    except RecursionError as exc:
        raise ApiError(400, "invalid_json", f"JSON nesting is limited to {MAX_JSON_DEPTH} levels.") from exc
    except _Unrepresentable as exc:
        raise ApiError(400, "invalid_json", f"We could not parse the JSON body of your request: {exc}") from exc
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ApiError(
            400, "invalid_json", f"We could not parse the JSON body of your request: {exc}", param=None
        ) from exc
    _check_tree(data)
    return data


def canonical_json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def _param(error: Mapping[str, Any], data: Any) -> str | None:
    """The dotted path of an error, walking the input so union tags and
    type names that pydantic puts in ``loc`` are skipped."""
    loc = list(error.get("loc", ()))
    parts: list[str] = []
    cur: Any = data
    for i, seg in enumerate(loc):
        last = i == len(loc) - 1
        if isinstance(cur, list) and isinstance(seg, int):
            parts.append(str(seg))
            cur = cur[seg] if 0 <= seg < len(cur) else None
        elif isinstance(cur, dict) and isinstance(seg, str) and (seg in cur or last and error.get("type") == "missing"):
            parts.append(seg)
            cur = cur.get(seg)
        elif isinstance(cur, dict) and isinstance(seg, str) and last and error.get("type") == "extra_forbidden":
            parts.append(seg)
        # Otherwise the segment names a union member, not input: skip it.
    if error.get("type") in ("union_tag_invalid", "union_tag_not_found"):
        parts.append("type")
    return ".".join(parts) or None


def validate_body(model: type[M], data: Any) -> M:
    """Validates parsed JSON against ``model``; the first error becomes the 400."""
    if not isinstance(data, dict):
        raise ApiError(400, "validation_error", "The request body must be a JSON object.")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        # With unions pydantic reports every member's failure; the deepest
        # location is the one that names what the caller got wrong.
        first = max(exc.errors(include_url=False), key=lambda e: len(e.get("loc", ())))
        param = _param(first, data)
        message = first.get("msg", "invalid value")
        if first.get("type") == "extra_forbidden":
            message = "Unknown parameter."
        raise ApiError(
            400,
            "validation_error",
            f"Invalid '{param}': {message}" if param else str(message),
            param=param,
        ) from exc


class WebhookEndpointCreateBody(_Strict):
    """``POST /v1/webhook_endpoints`` (``client.webhooks.create``). The
    Session service checks the event types against its catalog and the URL
    against the destination policy."""

    name: NonBlank
    url: NonBlank
    event_types: list[NonBlank] = Field(min_length=1, max_length=64)


class WebhookEndpointUpdateBody(_Strict):
    name: NonBlank | None = None
    url: NonBlank | None = None
    event_types: list[NonBlank] | None = Field(default=None, min_length=1, max_length=64)


class WebhookRotateSecretBody(_Strict):
    # Keeping the old secret valid for a while is not implemented: ``true`` is a 400.
    keep_old_secret_active_for_24_hours: Literal[False] = False
