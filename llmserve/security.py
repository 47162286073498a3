"""What the server (`llmserve serve`) and the router (`llmserve route`) share for their front door: API keys
(several, from flags and a file, compared in constant time) and TLS (uvicorn's ssl_* settings).

Both declare the same flags, named as vLLM names them: `--api-key` (several values, or given several
times), `--api-key-file`, `--ssl-keyfile`, `--ssl-certfile`, `--ssl-ca-certs`, `--ssl-cert-reqs`; the
field factories below make them, so that the two stay alike."""

from __future__ import annotations

import hmac
import os
import ssl
from collections.abc import Iterable, Mapping
from dataclasses import field

from llmserve.flags import flag


def api_key_field(help: str, env: str | None = None):
    """`--api-key KEY [KEY ...]`, also given several times; a str from Python is one key."""
    return field(default=None, metadata=flag(help, action="extend", metavar="KEY", env=env))


def api_key_file_field():
    return field(
        default=None,
        metadata=flag(
            "a file of API keys, one a line (blank lines and # comments ignored); accepted beside --api-key's",
            metavar="FILE",
        ),
    )


def ssl_field(name: str):
    """The TLS setting `name`'s field (ssl_keyfile, ssl_certfile, ssl_ca_certs, ssl_cert_reqs)."""
    return _SSL_FIELDS[name]()


_SSL_FIELDS = {
    "ssl_keyfile": lambda: field(
        default=None, metadata=flag("TLS: the private key file (PEM); with --ssl-certfile, serve https", metavar="FILE")
    ),
    "ssl_certfile": lambda: field(
        default=None, metadata=flag("TLS: the certificate (chain) file (PEM)", metavar="FILE")
    ),
    "ssl_ca_certs": lambda: field(
        default=None, metadata=flag("TLS: CA certificates to verify client certificates with", metavar="FILE")
    ),
    "ssl_cert_reqs": lambda: field(
        default=int(ssl.CERT_NONE),
        metadata=flag(
            "TLS: client certificates, as uvicorn's (Python's ssl.VerifyMode): 0 none, 1 optional, 2 required",
            metavar="N",
        ),
    ),
}


def read_key_file(path: str) -> list[str]:
    """The keys of an --api-key-file: one a line, blank lines and `#` comments skipped."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError as e:
        raise ValueError(f"--api-key-file: cannot read {path}: {e.strerror or e}") from None
    return [k for k in (line.strip() for line in lines) if k and not k.startswith("#")]


def resolve_api_keys(api_key: str | Iterable[str] | None, api_key_file: str | None = None) -> tuple[str, ...]:
    """Every accepted key: `api_key` (one str, or several) and the file's, duplicates dropped, in order.
    Empty: no key asked. A ValueError for an unreadable file or one with no key."""
    keys = [api_key] if isinstance(api_key, str) else list(api_key or ())
    if api_key_file:
        from_file = read_key_file(api_key_file)
        if not from_file:
            raise ValueError(f"--api-key-file: {api_key_file} holds no key")
        keys += from_file
    return tuple(dict.fromkeys(k.strip() for k in keys if k and k.strip()))


def key_ok(headers: Mapping[str, str], keys: Iterable[str]) -> bool:
    """`Authorization: Bearer KEY` (OpenAI's clients) or `x-api-key: KEY` (Anthropic's) holds one of `keys`
    (lower-case header names). Each key is compared in constant time (hmac.compare_digest), all of them
    whatever matched: the time does not tell which key, or how much of one, matched."""
    auth = headers.get("authorization") or ""
    bearer = auth[7:].strip().encode("latin-1", "replace") if auth.startswith("Bearer ") else b""
    xkey = (headers.get("x-api-key") or "").strip().encode("latin-1", "replace")
    ok = False
    for key in keys:
        want = key.encode()
        ok |= hmac.compare_digest(bearer, want) | hmac.compare_digest(xkey, want)
    return ok


def uvicorn_ssl(settings, who: str) -> dict:
    """uvicorn.Config's ssl_* keywords of `settings` (a ServerSettings or RouterConfig); {} without TLS.
    A ValueError (a start-up error) for a key without its certificate or the reverse, or a missing file."""
    key, cert = settings.ssl_keyfile, settings.ssl_certfile
    if bool(key) != bool(cert):
        given, missing = ("--ssl-keyfile", "--ssl-certfile") if key else ("--ssl-certfile", "--ssl-keyfile")
        raise ValueError(f"{who}: {given} needs {missing} too (TLS takes both the private key and the certificate)")
    if not key:
        if settings.ssl_ca_certs:
            raise ValueError(f"{who}: --ssl-ca-certs needs --ssl-keyfile and --ssl-certfile")
        return {}
    for name, path in (("--ssl-keyfile", key), ("--ssl-certfile", cert), ("--ssl-ca-certs", settings.ssl_ca_certs)):
        if path and not os.path.isfile(path):
            raise ValueError(f"{who}: {name} {path}: no such file")
    if settings.ssl_cert_reqs not in (0, 1, 2):
        raise ValueError(f"{who}: --ssl-cert-reqs must be 0, 1 or 2, got {settings.ssl_cert_reqs}")
    return {
        "ssl_keyfile": key,
        "ssl_certfile": cert,
        "ssl_ca_certs": settings.ssl_ca_certs,
        "ssl_cert_reqs": settings.ssl_cert_reqs,
    }
