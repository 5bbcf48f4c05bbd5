"""What a client of a sandbox host needs: the sandbox's own CA (which signs each host's certificate) and
an API key. All of it lives in the sandbox's state directory, root-only except the CA certificate.

The CA is made with the first host and removed with the last (`sandbox down`); each host's certificate
names its address, its name, `localhost` and 127.0.0.1. The key is one per sandbox (id
`sandbox`); hosts get only its SHA-256 digest, seeded into their key store at deploy.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

from gemmaserve.ops.keys import key_digest, new_api_key
from gemmaserve.sandbox import state

TLS_DIR = state.STATE_DIR / "tls"
CA_CERT = TLS_DIR / "ca.pem"
CA_KEY = TLS_DIR / "ca.key"
API_KEY = state.STATE_DIR / "api-key"
KEY_STORE = state.STATE_DIR / "api-keys.store"
KEY_ID = "sandbox"
# Short enough to be obviously a test CA, long enough to outlive any sandbox.
CA_DAYS = 825
CERT_DAYS = 397


@dataclass(frozen=True)
class HostCredentials:
    ca_cert: Path  # PEM, public: what clients trust
    tls_bundle: Path  # PEM chain + private key, root-only: what the host serves (access_tls_src)
    api_key: str
    key_store: Path  # the key's digest store, root-only (access_api_keys_src)


def _write_private(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as handle:
        handle.write(data)
    os.chmod(path, 0o600)


def make_ca(common_name: str = "gemmaserve sandbox CA"):
    """(certificate, private key) of a new self-signed CA."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=CA_DAYS))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(True, False, False, False, False, True, True, False, False), critical=True
        )  # digital_signature, key_cert_sign, crl_sign
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return cert, key


def issue_server_bundle(ca_cert, ca_key, names: list[str]) -> bytes:
    """A server certificate for `names` (IP addresses or DNS names) signed by the CA, as one PEM bundle:
    certificate, CA certificate, private key (the layout HAProxy's `crt` reads)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    def alt(name: str):
        try:
            return x509.IPAddress(ipaddress.ip_address(name))
        except ValueError:
            return x509.DNSName(name)

    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, names[0])]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=CERT_DAYS))
        .add_extension(x509.SubjectAlternativeName([alt(n) for n in names]), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    pem = serialization.Encoding.PEM
    private = key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    return cert.public_bytes(pem) + ca_cert.public_bytes(pem) + private


def ensure_ca():
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    if CA_CERT.exists() and CA_KEY.exists():
        cert = x509.load_pem_x509_certificate(CA_CERT.read_bytes())
        key = serialization.load_pem_private_key(CA_KEY.read_bytes(), password=None)
        return cert, key
    cert, key = make_ca()
    _write_private(
        CA_KEY,
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()),
    )
    TLS_DIR.mkdir(parents=True, exist_ok=True)
    CA_CERT.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return cert, key


def tls_bundle_path(host_name: str) -> Path:
    return TLS_DIR / f"{host_name}.pem"


def ensure(host: state.Host) -> HostCredentials:
    """The CA, this host's certificate and the sandbox's API key, made where missing (idempotent)."""
    ca_cert, ca_key = ensure_ca()
    bundle = tls_bundle_path(host.name)
    if not bundle.exists():
        names = [host.address, host.name, "localhost", "127.0.0.1"]
        _write_private(bundle, issue_server_bundle(ca_cert, ca_key, names))
    if not API_KEY.exists():
        _write_private(API_KEY, new_api_key().encode() + b"\n")
    key = API_KEY.read_text().strip()
    if not KEY_STORE.exists():
        created = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        _write_private(KEY_STORE, f"{KEY_ID} {key_digest(key)} {created}\n".encode())
    return HostCredentials(CA_CERT, bundle, key, KEY_STORE)


def existing(host_name: str) -> tuple[str | None, str | None]:
    """(api_key, ca_cert path) where they exist; never creates anything."""
    key = API_KEY.read_text().strip() if API_KEY.exists() else None
    return key, (str(CA_CERT) if CA_CERT.exists() and tls_bundle_path(host_name).exists() else None)


def base_url(host: state.Host) -> str:
    """The host's load balancer as an OpenAI base URL (TLS, the router port)."""
    return f"https://{host.address}:{state.LB_PORT}/v1"


def endpoint(host: state.Host):
    """How a client calls this host's load balancer: its base URL with the sandbox's API key and CA
    (gemmaserve.ops.endpoint.Endpoint); the key and CA are made where missing."""
    from gemmaserve.ops.endpoint import Credentials, Endpoint

    made = ensure(host)
    return Endpoint(base_url(host), Credentials(made.api_key, str(made.ca_cert)))


def remove() -> None:
    """What the last host's `down` removes: the CA, the certificates, the key and its store."""
    import shutil

    shutil.rmtree(TLS_DIR, ignore_errors=True)
    for path in (API_KEY, KEY_STORE):
        path.unlink(missing_ok=True)
