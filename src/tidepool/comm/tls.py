"""TLS for ``tls://`` addresses: certificates, contexts, and a quick-start certificate maker.

State: none but the immutable :class:`TLSConfig` (paths of a CA bundle, this process's certificate
and key, and whether peers must present certificates).  Data flow: ``comm.core`` asks a config for
an ``ssl.SSLContext`` when it listens on or connects to a ``tls://`` address; the HMAC token
handshake still runs inside the encrypted channel, so a peer needs both a certificate the CA signed
and the token.  A process without an explicit config takes it from the environment
(``TIDEPOOL_TLS_CA``, ``TIDEPOOL_TLS_CERT``, ``TIDEPOOL_TLS_KEY``), which is how providers hand it
to the workers they start.

Peers are verified against the CA (a private CA: whatever it signed is trusted); host names are
not checked, because workers on many machines share one certificate in the quick start.  Use a CA
of your own and one certificate per host for more.
"""

from __future__ import annotations

import datetime
import functools
import ipaddress
import os
import socket
import ssl
from dataclasses import dataclass
from pathlib import Path

from tidepool.errors import ConfigError

ENV_CA, ENV_CERT, ENV_KEY = "TIDEPOOL_TLS_CA", "TIDEPOOL_TLS_CERT", "TIDEPOOL_TLS_KEY"


@dataclass(frozen=True)
class TLSConfig:
    """``ca``: CA bundle that signed the peers' certificates; ``cert``/``key``: this process's
    certificate and private key (PEM); ``require_client_cert``: servers refuse peers without a
    certificate from ``ca`` (mutual TLS, the default)."""

    ca: str
    cert: str
    key: str
    require_client_cert: bool = True

    def __post_init__(self) -> None:
        for name in ("ca", "cert", "key"):
            path = getattr(self, name)
            if not path or not Path(path).is_file():
                raise ConfigError(f"TLS {name} file {path!r} does not exist; make a CA and certificates with "
                                  "`tidepool certs DIR` (or pass your own PEM files)")  # fmt: skip

    @functools.cache  # noqa: B019 - configs are few and immutable: one context each, reused by every connection
    def _context(self, purpose: ssl.Purpose) -> ssl.SSLContext:
        try:
            ctx = ssl.create_default_context(purpose, cafile=self.ca)
        except (ssl.SSLError, OSError) as exc:
            raise ConfigError(f"cannot load the TLS CA file {self.ca!r} (it must hold PEM certificates; make "
                              f"a CA with `tidepool certs DIR`): {exc}") from exc  # fmt: skip
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.check_hostname = False  # a private CA: the chain is what is checked (module docstring)
        try:
            ctx.load_cert_chain(self.cert, self.key)
        except (ssl.SSLError, OSError) as exc:
            raise ConfigError(f"cannot load TLS certificate {self.cert!r} with key {self.key!r}: {exc}") from exc
        if purpose is ssl.Purpose.CLIENT_AUTH:
            ctx.verify_mode = ssl.CERT_REQUIRED if self.require_client_cert else ssl.CERT_OPTIONAL
        else:
            ctx.verify_mode = ssl.CERT_REQUIRED
        return ctx

    def server_context(self) -> ssl.SSLContext:
        return self._context(ssl.Purpose.CLIENT_AUTH)

    def client_context(self) -> ssl.SSLContext:
        return self._context(ssl.Purpose.SERVER_AUTH)

    def env(self) -> dict[str, str]:
        """The environment that gives a started worker this configuration."""
        return {ENV_CA: str(Path(self.ca).resolve()), ENV_CERT: str(Path(self.cert).resolve()),
                ENV_KEY: str(Path(self.key).resolve())}  # fmt: skip

    @classmethod
    def from_env(cls) -> TLSConfig | None:
        ca, cert, key = (os.environ.get(k) for k in (ENV_CA, ENV_CERT, ENV_KEY))
        if not (ca or cert or key):
            return None
        if not (ca and cert and key):
            raise ConfigError(f"TLS needs all of {ENV_CA}, {ENV_CERT} and {ENV_KEY} set (some are missing)")
        return cls(ca, cert, key)


def resolve(tls: TLSConfig | None, address: str) -> TLSConfig:
    """The configuration for a ``tls://`` address: the one given, else the environment's."""
    cfg = tls or TLSConfig.from_env()
    if cfg is None:
        raise ConfigError(f"{address} is a TLS address but no TLS configuration was given: pass tls=tidepool.TLSConfig(...) "
                          f"(or --tls-ca-file/--tls-cert/--tls-key, or set {ENV_CA}, {ENV_CERT}, {ENV_KEY}); "
                          "`tidepool certs DIR` makes a CA and certificates")  # fmt: skip
    return cfg


def make_certs(directory: str | Path, hosts: list[str] | None = None, days: int = 365) -> TLSConfig:
    """A self-signed CA and one certificate it signs (for this machine's names and ``hosts``), in
    ``directory``: ``ca.pem``, ``cert.pem``, ``key.pem`` (mode 0600).  For a quick start: copy the
    three files to every machine (or share the directory) and pass them to every process."""
    try:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID
    except ImportError:
        raise ConfigError("making certificates needs the cryptography package: pip install 'tidepool[tls]'") from None
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "tidepool CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=days))
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                       content_commitment=False, key_encipherment=False, data_encipherment=False,
                                       key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
          .sign(ca_key, hashes.SHA256()))  # fmt: skip
    key = ec.generate_private_key(ec.SECP256R1())
    names: list[x509.GeneralName] = [x509.DNSName("localhost"), x509.DNSName(socket.gethostname()),
                                     x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]  # fmt: skip
    for h in hosts or []:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            names.append(x509.DNSName(h))
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "tidepool")]))
            .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.SubjectAlternativeName(names), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .sign(ca_key, hashes.SHA256()))  # fmt: skip
    pem = serialization.Encoding.PEM
    (out / "ca.pem").write_bytes(ca.public_bytes(pem))
    (out / "cert.pem").write_bytes(cert.public_bytes(pem))
    key_path = out / "key.pem"
    fd = os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "wb") as f:
        os.fchmod(f.fileno(), 0o600)
        f.write(key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    return TLSConfig(str(out / "ca.pem"), str(out / "cert.pem"), str(key_path))


__all__ = ["TLSConfig", "make_certs", "resolve"]
