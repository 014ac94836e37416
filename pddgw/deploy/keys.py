"""`pddgw keys DIR [--config CFG]`: the files a deployment's node links need.

Writes, into DIR (created if missing; existing files are kept unless `force`):

1. `link-secret`: 32 random bytes as 64 hex characters (`net.secret_file`);
2. `ca.crt` / `ca.key`: a self-signed CA (ECDSA P-256, 10 years) that signs
   every node certificate (`net.tls.ca_file`);
3. `NAME.crt` / `NAME.key` for every node of the config (without a config,
   the embedded topology's router, p0, rld0, md0): signed by the CA, usable
   as server and client certificate (mutual TLS), with subject alternative
   names for the node's host (the router's also for `[server] host`), the
   node's name, `localhost` and `127.0.0.1` (`net.tls.cert_file =
   "DIR/{node}.crt"`, `key_file = "DIR/{node}.key"`).

Private keys and the secret are written with mode 0600.  `cryptography` does
the X.509 work.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

from pddgw.config import Config, ConfigError

EMBEDDED_NODES = ("router", "p0", "rld0", "md0")
_WILDCARD = {"", "0.0.0.0", "::"}


@dataclass(frozen=True, slots=True)
class Written:
    """What `write_keys` wrote: paths, and each node's subject alternative names."""

    secret: Path
    ca_cert: Path
    ca_key: Path
    nodes: dict[str, tuple[Path, Path, tuple[str, ...]]]   # name -> (cert, key, SANs)


def node_hosts(cfg: Config) -> dict[str, tuple[str, ...]]:
    """Node name -> the names its certificate must hold (host first, then name, localhost, 127.0.0.1)."""
    out: dict[str, tuple[str, ...]] = {}
    nodes = [(n.name, n.host, n.role) for n in cfg.nodes] or [(n, "127.0.0.1", "") for n in EMBEDDED_NODES]
    for name, host, role in nodes:
        names = [host, name, "localhost", "127.0.0.1"]
        if role == "router" or not cfg.nodes:
            names.insert(1, cfg.server.host)
        out[name] = tuple(dict.fromkeys(h for h in names if h not in _WILDCARD))
    return out


def _san(names: tuple[str, ...]):
    from cryptography import x509

    entries = []
    for h in names:
        try:
            entries.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            entries.append(x509.DNSName(h))
    return x509.SubjectAlternativeName(entries)


def _pem_key(key) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _write(path: Path, data: bytes, private: bool) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if private else 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def write_keys(directory: str | Path, cfg: Config, force: bool = False, days: int = 3650) -> Written:
    """Write the link secret, the CA and every node's certificate into `directory`."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    d = Path(directory)
    hosts = node_hosts(cfg)
    planned = [d / "link-secret", d / "ca.crt", d / "ca.key"]
    planned += [d / f"{name}.{ext}" for name in hosts for ext in ("crt", "key")]
    existing = [str(p) for p in planned if p.exists()]
    if existing and not force:
        raise ConfigError(f"{d}: would overwrite {', '.join(existing)} (a running deployment may use "
                          "them); pass --force to replace them, or pick another directory")
    try:
        d.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"cannot create {d}: {e.strerror}") from None

    now = datetime.datetime.now(datetime.UTC)
    start, end = now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=days)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "pddgw deployment CA")])
    ca_cert = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
               .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(start).not_valid_after(end)
               .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
               .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                            content_commitment=False, key_encipherment=False,
                                            data_encipherment=False, key_agreement=False,
                                            encipher_only=False, decipher_only=False), critical=True)
               .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
               .sign(ca_key, hashes.SHA256()))
    try:
        secret = d / "link-secret"
        _write(secret, (secrets.token_hex(32) + "\n").encode(), private=True)
        _write(d / "ca.key", _pem_key(ca_key), private=True)
        _write(d / "ca.crt", ca_cert.public_bytes(serialization.Encoding.PEM), private=False)
        nodes: dict[str, tuple[Path, Path, tuple[str, ...]]] = {}
        for name, names in hosts.items():
            key = ec.generate_private_key(ec.SECP256R1())
            cert = (x509.CertificateBuilder()
                    .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
                    .issuer_name(ca_name).public_key(key.public_key())
                    .serial_number(x509.random_serial_number())
                    .not_valid_before(start).not_valid_after(end)
                    .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                    .add_extension(_san(names), critical=False)
                    .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                          ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
                    .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
                                   critical=False)
                    .sign(ca_key, hashes.SHA256()))
            crt, kf = d / f"{name}.crt", d / f"{name}.key"
            _write(kf, _pem_key(key), private=True)
            _write(crt, cert.public_bytes(serialization.Encoding.PEM), private=False)
            nodes[name] = (crt, kf, names)
    except OSError as e:
        raise ConfigError(f"cannot write into {d}: {e.strerror}") from None
    return Written(secret, d / "ca.crt", d / "ca.key", nodes)


def config_lines(directory: str | Path) -> str:
    """The config lines that use what `write_keys` wrote into `directory`."""
    d = str(directory).rstrip("/") or "/"
    return (f'[net]\nsecret_file = "{d}/link-secret"\n\n'
            f'[net.tls]\nenabled = true\ncert_file = "{d}/{{node}}.crt"\nkey_file = "{d}/{{node}}.key"\n'
            f'ca_file = "{d}/ca.crt"\nmutual = true\n')
