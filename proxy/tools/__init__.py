"""Tools beside the proxy: the one-command demo and the fake upstream (a capped mock provider)."""
