"""SSL contexts for node links and the front door from `TlsConfig` (PEM files).

Every file is opened before OpenSSL sees it, so a missing or unreadable one is a
`ConfigError` naming the key and the path (`net.tls.ca_file: cannot read
/etc/pddgw/ca.crt: No such file or directory`), and one OpenSSL rejects names
the key too.
"""

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


def front_door_context(cfg: TlsConfig) -> ssl.SSLContext | None:
    """The front door's server context (`front_door = true`), None when it is plain HTTP.

    Clients are not asked for certificates (they authenticate with API keys).
    """
    if not cfg.front_door:
        return None
    cert_key, cert, key_key, key = cfg.front_files()
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    _readable(cert_key, cert)
    _readable(key_key, key)
    try:
        ctx.load_cert_chain(cert, key)
    except ssl.SSLError as e:
        raise ConfigError(f"{cert_key}: {cert} with {key_key} {key}: not a PEM certificate "
                          f"and its private key ({e.reason or e})") from None
    return ctx


def _readable(key: str, path: str) -> None:
    try:
        with open(path, "rb"):
            pass
    except OSError as e:
        raise ConfigError(f"{key}: cannot read {path}: {e.strerror}") from None


def _load(ctx: ssl.SSLContext, cfg: TlsConfig) -> None:
    if cfg.ca_file:
        _readable("net.tls.ca_file", cfg.ca_file)
        try:
            ctx.load_verify_locations(cafile=cfg.ca_file)
        except ssl.SSLError as e:
            raise ConfigError(f"net.tls.ca_file: {cfg.ca_file}: not a PEM CA certificate "
                              f"({e.reason or e})") from None
    if cfg.cert_file:
        _readable("net.tls.cert_file", cfg.cert_file)
        _readable("net.tls.key_file", cfg.key_file)
        try:
            ctx.load_cert_chain(cfg.cert_file, cfg.key_file)
        except ssl.SSLError as e:
            raise ConfigError(f"net.tls.cert_file: {cfg.cert_file} with net.tls.key_file {cfg.key_file}: "
                              f"not a PEM certificate and its private key ({e.reason or e})") from None
