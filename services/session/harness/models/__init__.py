"""Model providers, chosen by configuration and model name."""

from __future__ import annotations

from services.core.settings import Settings
from services.session.harness.models.base import ModelProvider
from services.session.harness.models.openai_provider import OpenAIProvider
from services.session.harness.models.scripted import ScriptedProvider

__all__ = ["ProviderRegistry"]


class ProviderRegistry:
    """Picks a provider per model name: ``settings.model_provider`` forces one;
    otherwise models named ``scripted`` (or ``scripted-*``) and every model
    when no ``model_base_url`` is configured use the offline scripted model,
    and the rest go to the OpenAI-compatible server."""

    def __init__(self, settings: Settings) -> None:
        self._settings = settings
        self._scripted = ScriptedProvider()
        self._openai: OpenAIProvider | None = None

    def for_model(self, model: str) -> ModelProvider:
        forced = self._settings.model_provider.strip().lower()
        if forced == "scripted" or (not forced and (model == "scripted" or model.startswith("scripted-"))):
            return self._scripted
        if forced == "openai" or self._settings.model_base_url:
            if self._openai is None:
                self._openai = OpenAIProvider(
                    base_url=self._settings.model_base_url,
                    api_key=self._settings.model_api_key,
                    api=self._settings.model_api,
                )
            return self._openai
        return self._scripted

    async def close(self) -> None:
        if self._openai is not None:
            await self._openai.close()
