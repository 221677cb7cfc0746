"""A mock LLM provider with a hard concurrency cap, for the demo, the tests and the benchmarks.

It speaks enough of the OpenAI (``/v1/chat/completions``, ``/v1/completions``,
``/v1/responses``) and Anthropic (``/v1/messages``) APIs for the official SDKs
to parse its answers, streamed or not. Every API path (``/v1/models`` and
``/v1/usage`` too) is also served without its ``/v1``, so a provider's upstream
may be ``http://127.0.0.1:P/v1`` (OpenAI's shape) or ``http://127.0.0.1:P``
(Anthropic's). Any other path gets a 404 in the OpenAI error shape (code
``unknown_url``) that names the path and the routes served. Over its cap it
answers 429 with Retry-After, like a real provider, and it keeps the statistics
a test needs to prove that a proxy in front of it never went over: the highest
concurrency it ever admitted, the 429s it sent, and the tags of the requests in
arrival order.

The package's parts, each documenting what it serves: ``knobs`` (the ``x-fake-*`` request headers
that inject faults, and their table), ``dialects`` (each API's answers: errors, bodies, stream
events, the usage they state and the rate-limit headers of a window), ``admission`` (what is
counted and capped: the cap, per-key limits and windows, the statistics), ``windows`` (the
providers' per-minute token and request windows, and Anthropic's prompt cache), ``server`` (the HTTP
routes), ``websocket`` (the Responses API over WebSocket, with its own knobs) and ``cli`` (the
``fake-upstream`` command).
"""

from .cli import add_arguments, run
from .server import FakeUpstream, start_fake_upstream

__all__ = ["FakeUpstream", "add_arguments", "run", "start_fake_upstream"]
