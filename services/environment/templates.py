"""Environment templates: reusable hosted configurations, and the rules by
which an environment created from one combines it with its own fields.

Override rules (also in the README):

- every configuration field the request sets replaces the template's, except
  ``env``, whose variables are merged key by key (the request's win);
- a field the request omits (or sets to null) is the template's;
- the network policy can only narrow the template's: ``disabled`` stays
  ``disabled``; under ``restricted`` the request may be ``disabled`` or
  ``restricted``, every allowed domain must be covered by one of the
  template's (when the template lists any), and the template's blocked
  domains stay blocked; ``enabled`` (or no policy) allows any override.

The resolved configuration is stored on the environment: later template
updates or deletion never change an environment made from it.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Iterable, Sequence

import structlog
from sqlalchemy.ext.asyncio import AsyncSession

from berth.common.v1 import common_pb2
from berth.environment.v1 import environment_pb2
from berth.environment.v1.environment_pb2 import EnvironmentConfig as _Config
from services.core.db import Database
from services.core.errors import BerthError, InvalidArgument, NotFound
from services.core.ids import has_prefix, new_id
from services.core.logging import get_logger
from services.environment import paging
from services.environment import repository as repo
from services.environment.models import TemplateRow

__all__ = ["EnvironmentTemplates", "ConfigValidator", "apply_overrides", "narrower_network"]

log = get_logger(__name__)

ConfigValidator = Callable[[str, environment_pb2.EnvironmentConfig], Awaitable[environment_pb2.EnvironmentConfig]]

_FIELDS = _Config.DESCRIPTOR.fields_by_name
# The fields a template holds; the request-only ones are not among them.
_TEMPLATE_FIELDS = frozenset(_FIELDS) - {"environment_template_id", "template_overrides"}
_RANK = {
    common_pb2.NETWORK_ACCESS_DISABLED: 0,
    common_pb2.NETWORK_ACCESS_RESTRICTED: 1,
    common_pb2.NETWORK_ACCESS_ENABLED: 2,
    common_pb2.NETWORK_ACCESS_UNSPECIFIED: 2,  # the default policy is enabled
}
_TEMPLATE_PARAM = "environment.environment_template_id"


def _not_found(template_id: str, *, param: str | None = None) -> NotFound:
    return NotFound(f"environment template {template_id} not found", param=param)


def _copy_field(target: _Config, source: _Config, name: str) -> None:
    field = _FIELDS[name]
    target.ClearField(name)
    value = getattr(source, name)
    if field.message_type is not None and field.message_type.GetOptions().map_entry:
        getattr(target, name).update(value)
    elif field.is_repeated:
        getattr(target, name).extend(value)
    elif field.message_type is not None:
        getattr(target, name).CopyFrom(value)
    else:
        setattr(target, name, value)


def _checked_fields(names: Iterable[str]) -> list[str]:
    fields = list(dict.fromkeys(names))
    for name in fields:
        if name not in _TEMPLATE_FIELDS:
            raise InvalidArgument(f"unknown configuration field {name!r}", param=name)
    return fields


def apply_overrides(
    base: _Config, override: _Config, fields: Iterable[str], *, merge_env: bool
) -> _Config:
    """``base`` with the named fields taken from ``override``."""
    merged = _Config()
    merged.CopyFrom(base)
    for name in _checked_fields(fields):
        if name == "env" and merge_env:
            merged.env.update(override.env)
        else:
            _copy_field(merged, override, name)
    return merged


def _domain_base(entry: str) -> tuple[str, bool]:
    """An entry's domain, lower-cased, and whether it names subdomains only."""
    entry = entry.strip().lower().rstrip(".")
    if entry.startswith("*."):
        return entry[2:], True
    return entry.lstrip("."), False


def _covers(entry: str, domain: str) -> bool:
    """Whether the egress rule ``entry`` matches every host ``domain`` does
    (see docs/sandbox-network.md for the matching)."""
    if entry.strip() == "*":
        return True
    if domain.strip() == "*":
        return False
    base, subdomains_only = _domain_base(entry)
    name, name_subdomains_only = _domain_base(domain)
    if name == base:
        return name_subdomains_only or not subdomains_only
    return name.endswith("." + base)


def narrower_network(
    template: common_pb2.NetworkPolicy, override: common_pb2.NetworkPolicy, *, param: str
) -> common_pb2.NetworkPolicy:
    """The override as it applies under the template's policy; a policy that
    would reach more than the template's is refused."""
    if _RANK[override.access] > _RANK[template.access]:
        raise InvalidArgument("the network override cannot broaden the template's policy", param=f"{param}.access")
    if not (
        template.access == common_pb2.NETWORK_ACCESS_RESTRICTED
        and override.access == common_pb2.NETWORK_ACCESS_RESTRICTED
    ):
        return override
    if template.allowed_domains:
        if not override.allowed_domains:
            raise InvalidArgument(
                "the template allows only listed domains: the override must list allowed_domains",
                param=f"{param}.allowed_domains",
            )
        for domain in override.allowed_domains:
            if not any(_covers(entry, domain) for entry in template.allowed_domains):
                raise InvalidArgument(
                    f"{domain!r} is not allowed by the template", param=f"{param}.allowed_domains"
                )
    merged = common_pb2.NetworkPolicy()
    merged.CopyFrom(override)
    for domain in template.blocked_domains:
        if domain not in merged.blocked_domains:
            merged.blocked_domains.append(domain)
    return merged


def template_param(exc: BerthError) -> BerthError:
    """A configuration error of a template names the template's field, not
    the environment's (the validator is the environments')."""
    if exc.param and exc.param.startswith("environment."):
        exc.param = exc.param.removeprefix("environment.")
        exc.metadata["param"] = exc.param
    return exc


class EnvironmentTemplates:
    """Template CRUD and resolution, for one Environment service."""

    def __init__(self, db: Database, validate: ConfigValidator) -> None:
        self._db = db
        # The environments' invariants (paths, referenced files, archives).
        self._validate = validate

    async def _validated(self, org_id: str, config: _Config) -> _Config:
        try:
            checked = await self._validate(org_id, config)
        except BerthError as exc:
            raise template_param(exc) from None
        checked.ClearField("environment_template_id")
        checked.ClearField("template_overrides")
        return checked

    async def create(self, org_id: str, config: _Config, name: str | None) -> TemplateRow:
        checked = await self._validated(org_id, config)
        now = time.time()
        row = TemplateRow(
            id=new_id("envtpl"),
            org_id=org_id,
            name=name,
            config=checked.SerializeToString(),
            create_time=now,
            update_time=now,
        )

        async def insert(s: AsyncSession) -> None:
            s.add(row)

        await self._db.run(insert)
        log.info("environment_template_created", environment_template_id=row.id)
        return row

    async def get(self, org_id: str, template_id: str, *, param: str | None = None) -> TemplateRow:
        if not has_prefix(template_id, "envtpl"):
            raise _not_found(template_id, param=param)
        async with self._db.transaction(read_only=True) as s:
            row = await repo.get_template(s, template_id, org_id)
        if row is None:
            raise _not_found(template_id, param=param)
        return row

    async def list(
        self, org_id: str, *, page_size: int, after: str, order: str
    ) -> tuple[Sequence[TemplateRow], bool]:
        limit = paging.page_size(page_size)
        ascending = paging.page_order(order) == "asc"
        async with self._db.transaction(read_only=True) as s:
            rows = await repo.list_templates(s, org_id, after=after, ascending=ascending, limit=limit + 1)
        return rows[:limit], len(rows) > limit

    async def update(
        self,
        org_id: str,
        template_id: str,
        config: _Config,
        fields: Sequence[str],
        *,
        update_name: bool,
        name: str | None,
    ) -> TemplateRow:
        """Replaces the named fields (a named field left empty resets to its
        default) and, with ``update_name``, the name."""
        await self.get(org_id, template_id)
        # Only the replacement is validated: the stored part passed already.
        replacement = await self._validated(org_id, apply_overrides(_Config(), config, fields, merge_env=False))
        now = time.time()

        async def write(s: AsyncSession) -> TemplateRow | None:
            row = await repo.get_template(s, template_id, org_id, for_update=True)
            if row is None:
                return None
            stored = apply_overrides(_Config.FromString(row.config), replacement, fields, merge_env=False)
            new_name = name if update_name else row.name
            await repo.update_template(
                s, template_id, org_id, config=stored.SerializeToString(), name=new_name, update_time=now
            )
            row.config, row.name, row.update_time = stored.SerializeToString(), new_name, now
            return row

        row = await self._db.run(write)
        if row is None:
            raise _not_found(template_id)
        log.info("environment_template_updated", environment_template_id=template_id, fields=list(fields))
        return row

    async def delete(self, org_id: str, template_id: str) -> None:
        if not has_prefix(template_id, "envtpl"):
            raise _not_found(template_id)
        deleted = await self._db.run(lambda s: repo.delete_template(s, template_id, org_id))
        if not deleted:
            raise _not_found(template_id)
        log.info("environment_template_deleted", environment_template_id=template_id)

    async def resolve(self, org_id: str, config: _Config) -> _Config:
        """A create request's configuration with its template applied; one
        without a template as it is."""
        if not config.environment_template_id:
            return config
        template_id = config.environment_template_id
        row = await self.get(org_id, template_id, param=_TEMPLATE_PARAM)
        base = _Config.FromString(row.config)
        fields = _checked_fields(config.template_overrides)
        override = _Config()
        override.CopyFrom(config)
        if "network" in fields:
            override.network.CopyFrom(narrower_network(base.network, config.network, param="environment.network"))
        merged = apply_overrides(base, override, fields, merge_env=True)
        for f in merged.files:
            f.id = ""  # each environment registers its own file IDs
        merged.environment_template_id = template_id
        structlog.contextvars.bind_contextvars(environment_template_id=template_id)
        return merged
