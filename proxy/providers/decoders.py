"""Decoding a copy of a compressed event stream, piece by piece, so its errors can be read.

The client always gets the bytes as they came; only the in-stream error scan
reads the decoded copy. Each decoder hands out at most ``PIECE`` bytes at a
time, so memory stays bounded whatever the compression ratio, and a stream
that cannot be decoded just stops being scanned.

gzip and deflate use zlib; br the ``brotli`` package; zstd the standard
library's ``compression.zstd`` (Python 3.14) or its backport ``backports.zstd``,
which is what aiohttp uses too.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator
from typing import Any, Protocol

__all__ = ["StreamDecoder", "decoder_for", "zstd_module"]

PIECE = 64 * 1024


class StreamDecoder(Protocol):
    def decode(self, chunk: bytes) -> Iterator[bytes]:
        """The decoded bytes ``chunk`` completes, in pieces of at most ``PIECE``; raises ValueError when
        the stream is not valid in its encoding."""


class _Zlib:
    def __init__(self, wbits: int) -> None:
        self._wbits = wbits
        self._decoder = zlib.decompressobj(wbits)
        self._started = False

    def decode(self, chunk: bytes) -> Iterator[bytes]:
        try:
            if not self._started and self._wbits == 15:
                self._started = True
                yield from self._first(chunk)
                return
            yield from self._pieces(chunk)
        except zlib.error as exc:
            raise ValueError(str(exc)) from None

    def _first(self, chunk: bytes) -> Iterator[bytes]:
        """``deflate`` is meant to be zlib-wrapped, but some servers send raw deflate: try both."""
        try:
            yield from self._pieces(chunk)
        except zlib.error:
            self._decoder = zlib.decompressobj(-15)
            yield from self._pieces(chunk)

    def _pieces(self, chunk: bytes) -> Iterator[bytes]:
        """At most ``PIECE`` at a time; input the limit held back waits in ``unconsumed_tail``."""
        yield self._decoder.decompress(chunk, PIECE)
        while self._decoder.unconsumed_tail:
            yield self._decoder.decompress(self._decoder.unconsumed_tail, PIECE)


class _Brotli:
    def __init__(self) -> None:
        import brotli  # type: ignore[import-untyped]

        self._error = brotli.error
        self._decoder = brotli.Decompressor()

    def decode(self, chunk: bytes) -> Iterator[bytes]:
        """At the output limit, more is pending: empty input fetches it (``can_accept_more_data`` says
        nothing about that)."""
        try:
            piece = self._decoder.process(chunk, output_buffer_limit=PIECE)
            yield piece
            while len(piece) >= PIECE and not self._decoder.is_finished():
                piece = self._decoder.process(b"", output_buffer_limit=PIECE)
                yield piece
        except self._error as exc:
            raise ValueError(str(exc)) from None


class _Zstd:
    def __init__(self) -> None:
        self._decoder = zstd_module().ZstdDecompressor()

    def decode(self, chunk: bytes) -> Iterator[bytes]:
        try:
            yield self._decoder.decompress(chunk, PIECE)
            while not self._decoder.needs_input and not self._decoder.eof:
                yield self._decoder.decompress(b"", PIECE)
        except (EOFError, zstd_module().ZstdError) as exc:
            raise ValueError(str(exc)) from None


def zstd_module() -> Any:
    """``compression.zstd`` (Python 3.14) or ``backports.zstd``: the same API."""
    try:
        from compression import zstd  # type: ignore[import-not-found]
    except ImportError:
        from backports import zstd
    return zstd


def decoder_for(content_encoding: str | None) -> StreamDecoder | None:
    """A decoder for one response's ``Content-Encoding``, or None when it needs none (or is unknown)."""
    encoding = (content_encoding or "").strip().lower()
    if encoding in ("gzip", "x-gzip"):
        return _Zlib(47)
    if encoding == "deflate":
        return _Zlib(15)
    if encoding == "br":
        return _Brotli()
    if encoding == "zstd":
        return _Zstd()
    return None
