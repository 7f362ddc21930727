"""Model providers, chosen by configuration and model name."""

from __future__ import annotations

from services.core.settings import ModelRoute, Settings
from services.session.harness.models.base import ModelProvider
from services.session.harness.models.openai_provider import OpenAIProvider, RetryPolicy
from services.session.harness.models.scripted import ScriptedProvider

__all__ = ["ProviderRegistry", "route_for"]


def route_for(routes: list[ModelRoute], model: str) -> ModelRoute | None:
    """The route of ``model``: an exact ``model`` match, else the longest matching ``prefix``."""
    for route in routes:
        if route.model == model:
            return route
    prefixed = [r for r in routes if r.prefix is not None and model.startswith(r.prefix)]
    return max(prefixed, key=lambda r: len(r.prefix or "")) if prefixed else None


class ProviderRegistry:
    """Picks a provider per model name: a ``model_routes`` entry matching the
    model sends it to that endpoint; otherwise ``settings.model_provider``
    forces one; otherwise models named ``scripted`` (or ``scripted-*``) and
    every model when no ``model_base_url`` is configured use the offline
    scripted model, and the rest go to the OpenAI-compatible server."""

    def __init__(self, settings: Settings) -> None:
        self._settings = settings
        self._scripted = ScriptedProvider()
        # One client per endpoint (base URL, key, API), made on first use.
        self._openai: dict[tuple[str, str, str], OpenAIProvider] = {}
        self.tool_concurrency = settings.tool_call_concurrency

    def _endpoint(self, base_url: str, api_key: str, api: str) -> OpenAIProvider:
        key = (base_url, api_key, api)
        provider = self._openai.get(key)
        if provider is None:
            s = self._settings
            provider = self._openai[key] = OpenAIProvider(
                base_url=base_url,
                api_key=api_key,
                api="responses" if api == "responses" else "chat",
                timeout_s=s.model_timeout_s,
                retry=RetryPolicy(
                    max_retries=s.model_max_retries,
                    base_delay_s=s.model_retry_base_delay_s,
                    max_delay_s=s.model_retry_max_delay_s,
                ),
            )
        return provider

    def for_model(self, model: str) -> ModelProvider:
        route = route_for(self._settings.model_routes, model)
        if route is not None:
            return self._endpoint(route.base_url, route.api_key, route.api)
        forced = self._settings.model_provider.strip().lower()
        if forced == "scripted" or (not forced and (model == "scripted" or model.startswith("scripted-"))):
            return self._scripted
        if forced == "openai" or self._settings.model_base_url:
            return self._endpoint(self._settings.model_base_url, self._settings.model_api_key, self._settings.model_api)
        return self._scripted

    async def close(self) -> None:
        for provider in self._openai.values():
            await provider.close()
