"""The list parameters every Environment service list takes: a page size
(0 means the default, 20; otherwise 1 to 100) and an order ("asc" or
"desc", empty meaning "desc")."""

from __future__ import annotations

from services.core.errors import InvalidArgument

__all__ = ["page_size", "page_order"]


def page_size(size: int, *, param: str = "limit") -> int:
    if size == 0:
        return 20
    if not 1 <= size <= 100:
        raise InvalidArgument("limit must be between 1 and 100", param=param)
    return size


def page_order(order: str) -> str:
    if order not in ("", "asc", "desc"):
        raise InvalidArgument("order must be asc or desc", param="order")
    return order or "desc"
