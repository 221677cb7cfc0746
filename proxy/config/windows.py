"""The ``windows:`` blocks: a provider's per-minute token and request limits, each model pattern's and each
pool key's overrides, and the checks that read them (where they are written, which the provider's API has)."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any, Literal, Protocol

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    ValidationInfo,
    field_validator,
    model_serializer,
)
from pydantic.json_schema import SkipJsonSchema

from ..limiter.window import WINDOW_NAMES
from .types import Headroom, WindowLimit

__all__ = ["DIALECT_WINDOWS", "ProviderWindows", "WindowLimits", "foreign_window_warnings", "written_windows"]

DIALECT_WINDOWS: dict[str, tuple[str, ...]] = {
    "anthropic": ("input_tokens_per_minute", "output_tokens_per_minute", "requests_per_minute"),
    "openai": ("tokens_per_minute", "requests_per_minute"),
}
"""The windows each provider API announces in its headers and names in its 429s."""

def _without_default(schema: dict[str, Any]) -> None:
    schema.pop("default", None)


# A window left out holds nothing; written, it must be a number (null is refused, not read as "none": in a model's
# or a key's block it could be read as "no window here" as well as "the provider's"). So the schema names no
# default, and the effective config (``slotproxy check``) leaves out the windows not written: what it prints loads.
_NO_WINDOW: Any = Field(default=None, json_schema_extra=_without_default)


class _Windows(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    input_tokens_per_minute: WindowLimit = _NO_WINDOW
    """Anthropic ITPM: cache reads do not count, cache writes do."""
    output_tokens_per_minute: WindowLimit = _NO_WINDOW
    """Anthropic OTPM: the output actually produced."""
    tokens_per_minute: WindowLimit = _NO_WINDOW
    """OpenAI TPM: the larger of the maximum output asked and the input, charged when sent."""
    requests_per_minute: WindowLimit = _NO_WINDOW

    def limits(self) -> dict[str, int]:
        """The windows written, by name."""
        return {name: limit for name in WINDOW_NAMES if (limit := getattr(self, name)) is not None}

    @model_serializer(mode="wrap")
    def _written_only(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data: dict[str, Any] = handler(self)
        return {name: value for name, value in data.items() if value is not None or name not in WINDOW_NAMES}


class WindowLimits(_Windows):
    """A model pattern's or a pool key's windows: each one written overrides the provider's."""

    # learn and headroom are refused here, each as a field of its own (left out of the schema and of dumps),
    # so that check names them beside every other problem of the block.
    learn: SkipJsonSchema[Any] = Field(default=None, exclude=True)
    headroom: SkipJsonSchema[Any] = Field(default=None, exclude=True)

    @field_validator("learn", "headroom", mode="before")
    @classmethod
    def _provider_wide(cls, value: Any, info: ValidationInfo) -> Any:
        raise ValueError(f"{info.field_name} is provider-wide: set it in the provider's own windows: block, "
                         "where it applies to every key and model")


class ProviderWindows(_Windows):
    """The provider's windows. Written at all (even empty), requests are held by their token windows."""

    learn: bool = True
    """Also take limits from the answers' ``*-limit`` headers (the smaller of those and the config's holds)."""
    headroom: Headroom = 0.0
    """The fraction of each window left unused, for others sharing the key."""


class _WithWindows(Protocol):
    @property
    def windows(self) -> WindowLimits | None: ...


def written_windows(name: str, windows: ProviderWindows | None, models: Mapping[str, _WithWindows],
                    keys: Iterable[_WithWindows]) -> list[tuple[str, _Windows]]:
    """Every ``windows:`` block written in one provider, with its key path."""
    blocks: list[tuple[str, _Windows]] = [(f"providers.{name}.windows", windows)] if windows is not None else []
    blocks += [(f"providers.{name}.models[{json.dumps(pattern)}].windows", cap.windows)
               for pattern, cap in models.items() if cap.windows is not None]
    blocks += [(f"providers.{name}.keys[{index}].windows", key.windows) for index, key in enumerate(keys)
               if key.windows is not None]
    return blocks


def foreign_window_warnings(name: str, dialect: Literal["anthropic", "openai"],
                            blocks: list[tuple[str, _Windows]]) -> list[str]:
    """A window the provider's API does not have (an OpenAI-style TPM on an Anthropic provider, say): it is
    held as written, but the provider never announces it or names it in a 429."""
    own = DIALECT_WINDOWS[dialect]
    api = "Anthropic's (auth: x-api-key)" if dialect == "anthropic" else "OpenAI's (auth: bearer)"
    return [f"{path}.{window} is not a window of {api} API, whose windows are {', '.join(own)}: it is held as "
            "written, but never learned from answers or recognised in a 429"
            for path, block in blocks for window in block.limits() if window not in own]
