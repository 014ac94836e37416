"""SSL contexts for node links from `TlsConfig` (PEM files)."""

from __future__ import annotations

import ssl

from pddgw.config import ConfigError, TlsConfig


def server_context(cfg: TlsConfig) -> ssl.SSLContext | None:
    """None when TLS is off; with `mutual`, clients must present a certificate signed by `ca_file`."""
    if not cfg.enabled:
        return None
    if not cfg.cert_file:
        raise ConfigError("net.tls: a server needs cert_file and key_file")
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    _load(ctx, cfg)
    if cfg.mutual:
        ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


def client_context(cfg: TlsConfig) -> ssl.SSLContext | None:
    """None when TLS is off; verifies the server against `ca_file` (or the system store)."""
    if not cfg.enabled:
        return None
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    _load(ctx, cfg)
    return ctx


def _load(ctx: ssl.SSLContext, cfg: TlsConfig) -> None:
    try:
        if cfg.ca_file:
            ctx.load_verify_locations(cafile=cfg.ca_file)
        if cfg.cert_file:
            ctx.load_cert_chain(cfg.cert_file, cfg.key_file)
    except (OSError, ssl.SSLError) as e:
        raise ConfigError(f"net.tls: cannot load certificates: {e}") from None
