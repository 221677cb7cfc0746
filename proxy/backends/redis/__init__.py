"""The Redis backend: several replicas share each provider's limit, queue order, pause and auto-reduction."""

from .backend import RedisBackend
from .link import RedisTarget

__all__ = ["RedisBackend", "RedisTarget"]
