"""Traces and GenAI metrics over OpenTelemetry (OTLP/HTTP), with the queue wait as a span of its own.

Off unless an endpoint is given (``telemetry.otlp_endpoint`` or the ``OTEL_EXPORTER_OTLP_ENDPOINT``
variable); ``OTEL_SDK_DISABLED=true`` turns it off. Off, nothing of OpenTelemetry is imported: this module
and ``settings`` are free of it, and ``sdk`` and ``spans`` are imported only by ``start``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from ..config.model import Telemetry as TelemetrySection
from .settings import (
    INSTALL_LINE,
    TelemetryNotInstalled,
    TelemetrySettings,
    check_installed,
    telemetry_settings,
)

if TYPE_CHECKING:
    from .sdk import Telemetry

__all__ = ["INSTALL_LINE", "TelemetryNotInstalled", "TelemetrySettings", "check_installed", "start",
           "telemetry_settings"]


def start(section: TelemetrySection, environ: Mapping[str, str],
          on_dropped: Callable[[int], None] | None = None) -> Telemetry | None:
    """The running telemetry, or None when it is off; ``TelemetryNotInstalled`` without the ``otel`` extra."""
    settings = telemetry_settings(section, environ)
    if settings is None:
        return None
    check_installed(settings)
    from .sdk import Telemetry

    telemetry = Telemetry(settings, on_dropped)
    from ..providers.tokens import UsageReader

    UsageReader.with_model = True
    return telemetry
