"""The HTTP server's parts: client connections, the guard, the relay (HTTP and WebSocket), answers,
the running proxy's shared state (``runtime``), the state file, the metrics the relay keeps.

Below the admin routes and the app that assembles them (``proxy.server``); above providers, ledger,
backends, config and the limiter, which it uses.
"""
