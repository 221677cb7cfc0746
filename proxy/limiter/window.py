"""Token windows: the per-minute token and request limits a provider enforces per key and model group."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

__all__ = ["WINDOW_NAMES", "WindowSettings"]

WINDOW_NAMES: tuple[str, ...] = (
    "input_tokens_per_minute",
    "output_tokens_per_minute",
    "tokens_per_minute",
    "requests_per_minute",
)


def _frozen(limits: Mapping[str, int]) -> Mapping[str, int]:
    return MappingProxyType(dict(limits))


def _pairs(limits: Mapping[str, int]) -> tuple[tuple[str, int], ...]:
    return tuple(sorted(limits.items()))


@dataclass(frozen=True, slots=True)
class WindowSettings:
    """A provider's configured windows: its own limits, each model pattern's and each pool key's overrides
    (window name -> limit per minute), whether limits are also learned from answers, and the headroom."""

    provider: Mapping[str, int] = field(default_factory=dict)
    models: Mapping[str, Mapping[str, int]] = field(default_factory=dict)
    keys: Mapping[str, Mapping[str, int]] = field(default_factory=dict)
    learn: bool = True
    headroom: float = 0.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "provider", _frozen(self.provider))
        object.__setattr__(self, "models", MappingProxyType({p: _frozen(m) for p, m in self.models.items()}))
        object.__setattr__(self, "keys", MappingProxyType({k: _frozen(m) for k, m in self.keys.items()}))

    def __hash__(self) -> int:
        return hash(self._identity())

    def _identity(self) -> tuple[object, ...]:
        return (_pairs(self.provider), tuple((p, _pairs(m)) for p, m in self.models.items()),
                tuple((k, _pairs(m)) for k, m in self.keys.items()), self.learn, self.headroom)
