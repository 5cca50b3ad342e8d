"""Transports move packed rows between ranks; everything above them (layout, epilogue, reduction) is shared."""

from .base import Transport, TransportTimeout, available_transports, resolve_transport

__all__ = ["Transport", "TransportTimeout", "available_transports", "resolve_transport"]
