"""The running server: the aiohttp app assembled from the HTTP layer and the admin routes (``app``),
serving, config reloads and shutdown (``run``), and bind failures in words (``bind``)."""
