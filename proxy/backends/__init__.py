"""Where slots live: one interface, one implementation per backend kind."""

from .base import Backend
from .memory import MemoryBackend

__all__ = ["Backend", "MemoryBackend"]
