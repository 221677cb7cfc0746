"""Whether telemetry is on, and where it goes: the ``telemetry:`` section and the standard ``OTEL_*`` variables.

Pure and free of OpenTelemetry imports: with telemetry off, nothing of it is ever imported.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from dataclasses import dataclass

from ..config.model import Telemetry as TelemetrySection

__all__ = ["INSTALL_LINE", "TelemetryNotInstalled", "TelemetrySettings", "check_installed", "telemetry_settings"]

INSTALL_LINE = "pip install 'slotproxy[otel]'"
LATEST_EXPERIMENTAL = "gen_ai_latest_experimental"
"""The ``OTEL_SEMCONV_STABILITY_OPT_IN`` value that asks for the GenAI conventions newer than v1.41."""
_PACKAGES = ("opentelemetry.sdk", "opentelemetry.exporter.otlp.proto.http")


class TelemetryNotInstalled(Exception):
    """An endpoint is configured, and the OpenTelemetry packages are not installed."""


@dataclass(frozen=True, slots=True)
class TelemetrySettings:
    endpoint: str | None
    """The ``otlp_endpoint`` written in the config; None: the exporters read the ``OTEL_EXPORTER_OTLP_*``
    variables themselves."""
    shown_endpoint: str
    """Where spans go, for log lines."""
    service_name: str
    sample: float
    latest_experimental: bool
    """``OTEL_SEMCONV_STABILITY_OPT_IN`` names ``gen_ai_latest_experimental``."""
    metrics: bool = True
    """False with ``OTEL_METRICS_EXPORTER=none`` (a backend that takes traces only, such as Jaeger)."""

    def signal_endpoint(self, signal: str) -> str | None:
        return None if self.endpoint is None else f"{self.endpoint}/v1/{signal}"


def telemetry_settings(section: TelemetrySection, environ: Mapping[str, str]) -> TelemetrySettings | None:
    """None when telemetry is off: no endpoint in the config nor the variables, or ``OTEL_SDK_DISABLED=true``."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None
    from_env = (environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "").strip()
                or environ.get("OTEL_EXPORTER_OTLP_ENDPOINT", "").strip())
    if section.otlp_endpoint is None and not from_env:
        return None
    opt_in = {part.strip() for part in environ.get("OTEL_SEMCONV_STABILITY_OPT_IN", "").split(",")}
    return TelemetrySettings(
        endpoint=section.otlp_endpoint,
        shown_endpoint=section.otlp_endpoint or from_env,
        service_name=section.service_name or environ.get("OTEL_SERVICE_NAME", "").strip() or "slotproxy",
        sample=section.sample,
        latest_experimental=LATEST_EXPERIMENTAL in opt_in,
        metrics=environ.get("OTEL_METRICS_EXPORTER", "").strip().lower() != "none",
    )


def check_installed(settings: TelemetrySettings) -> None:
    """Raise ``TelemetryNotInstalled`` naming the install command when the ``otel`` extra is missing."""
    for name in _PACKAGES:
        try:
            found = importlib.util.find_spec(name) is not None
        except ModuleNotFoundError:
            found = False
        if not found:
            raise TelemetryNotInstalled(
                f"telemetry is on (OTLP endpoint {settings.shown_endpoint}) but the OpenTelemetry packages are not "
                f"installed in this Python: {INSTALL_LINE} (or remove telemetry.otlp_endpoint and the "
                "OTEL_EXPORTER_OTLP_ENDPOINT variable, or set OTEL_SDK_DISABLED=true)")
