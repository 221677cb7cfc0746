"""slotproxy: a concurrency-slot proxy for fleets of coding agents in front of LLM providers."""

__version__ = "0.1.0"
