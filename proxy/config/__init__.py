"""The config: a frozen, validated model loaded from YAML, and each provider's resolved settings."""

from proxy.config.loader import (
    beside_config,
    load_config,
    missing_folders,
    parse_config,
)
from proxy.config.model import Config, ProviderSettings, config_json_schema
from proxy.errors import ConfigError

__all__ = [
    "Config",
    "ConfigError",
    "ProviderSettings",
    "beside_config",
    "config_json_schema",
    "load_config",
    "missing_folders",
    "parse_config",
]
