"""The names spans and metrics carry: the GenAI semantic conventions as their last release (v1.41) writes
them, and what slotproxy adds under ``slotproxy.*``. Pure: no OpenTelemetry import.

With ``OTEL_SEMCONV_STABILITY_OPT_IN=gen_ai_latest_experimental`` the token metrics are the newer
experimental counters (``gen_ai.client.inference.*``) instead of ``gen_ai.client.token.usage``.
"""

from __future__ import annotations

from urllib.parse import urlsplit

__all__ = ["SCHEMA_URL", "operation_name", "provider_name"]

SCHEMA_URL = "https://opentelemetry.io/schemas/1.41.0"

OPERATION = "gen_ai.operation.name"
PROVIDER = "gen_ai.provider.name"
REQUEST_MODEL = "gen_ai.request.model"
RESPONSE_MODEL = "gen_ai.response.model"
INPUT_TOKENS = "gen_ai.usage.input_tokens"
OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
CACHE_READ = "gen_ai.usage.cache_read.input_tokens"
CACHE_CREATION = "gen_ai.usage.cache_creation.input_tokens"
REASONING = "gen_ai.usage.reasoning.output_tokens"
CONVERSATION = "gen_ai.conversation.id"
TIME_TO_FIRST_CHUNK = "gen_ai.response.time_to_first_chunk"
TOKEN_TYPE = "gen_ai.token.type"
TOKEN_CACHE = "gen_ai.token.cache"
TOKEN_PHASE = "gen_ai.token.phase"
SERVER_ADDRESS = "server.address"
SERVER_PORT = "server.port"
ERROR_TYPE = "error.type"
HTTP_METHOD = "http.request.method"
HTTP_STATUS = "http.response.status_code"
URL_PATH = "url.path"

SLOT_PROVIDER = "slotproxy.provider"
WORKSPACE = "slotproxy.workspace"
STARRED = "slotproxy.starred"
HELD_BY = "slotproxy.queue.held_by"
OUTCOME = "slotproxy.outcome"
RETRIES = "slotproxy.retries"
KEY = "slotproxy.key"
TRANSPORT = "slotproxy.transport"

QUEUE_SPAN = "slotproxy.queue"

OPERATION_DURATION = "gen_ai.client.operation.duration"
TOKEN_USAGE = "gen_ai.client.token.usage"
INFERENCE_TOKENS = "gen_ai.client.inference.tokens"
INPUT_BY_CACHE = "gen_ai.client.inference.input_tokens_by_cache"
OUTPUT_BY_PHASE = "gen_ai.client.inference.output_tokens_by_phase"
QUEUE_TIME = "slotproxy.queue.time"

DURATION_BUCKETS = (0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92)
"""``gen_ai.client.operation.duration``'s advised boundaries (seconds)."""
TOKEN_BUCKETS = (1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144, 1048576, 4194304, 16777216, 67108864)
"""``gen_ai.client.token.usage``'s advised boundaries."""
QUEUE_BUCKETS = (0.005, 0.025, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
"""As ``slotproxy_queue_wait_seconds`` on /metrics."""

_KNOWN_PROVIDERS = {
    "openai": "openai", "anthropic": "anthropic", "azure": "azure.ai.openai", "bedrock": "aws.bedrock",
    "gemini": "gcp.gemini", "google": "gcp.gen_ai", "vertex": "gcp.vertex_ai", "mistral": "mistral_ai",
    "groq": "groq", "deepseek": "deepseek", "xai": "x_ai", "grok": "x_ai", "perplexity": "perplexity",
    "cohere": "cohere", "watsonx": "ibm.watsonx.ai",
}
"""A provider id or upstream host word, and its well-known ``gen_ai.provider.name``."""
_HOSTS = (
    ("openai.azure.com", "azure.ai.openai"), ("api.openai.com", "openai"), ("api.anthropic.com", "anthropic"),
    ("generativelanguage.googleapis.com", "gcp.gemini"), ("aiplatform.googleapis.com", "gcp.vertex_ai"),
    ("bedrock", "aws.bedrock"), ("api.mistral.ai", "mistral_ai"), ("api.groq.com", "groq"),
    ("api.deepseek.com", "deepseek"), ("api.x.ai", "x_ai"), ("api.perplexity.ai", "perplexity"),
    ("api.cohere", "cohere"),
)


def provider_name(provider: str, upstream: str, dialect: str) -> str:
    """``gen_ai.provider.name``: the upstream's host when it is a known one, else the provider's id when it
    names one, else whose API it speaks (``openai`` or ``anthropic``)."""
    host = (urlsplit(upstream).hostname or "").lower()
    for suffix, name in _HOSTS:
        if suffix in host:
            return name
    for word, name in _KNOWN_PROVIDERS.items():
        if provider.lower().startswith(word):
            return name
    return dialect


def operation_name(path: str) -> str | None:
    """``gen_ai.operation.name`` for an API path (after the provider), None for one that is not a GenAI call
    (a model list, a token count, a stored response read back)."""
    path = path.rstrip("/")
    if path.endswith(("chat/completions", "messages", "responses")):
        return "chat"
    if path.endswith("completions"):
        return "text_completion"
    if path.endswith("embeddings"):
        return "embeddings"
    if path.endswith((":generateContent", ":streamGenerateContent")):
        return "generate_content"
    return None
