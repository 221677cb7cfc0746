"""What slotproxy knows of provider APIs: rate-limit signals, budgets, model names, compressed bodies,
token usage in answers, and the poller of the concurrency gate (the config's ``usage:`` block)."""
