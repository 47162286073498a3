"""TLS (--ssl-keyfile / --ssl-certfile) and several API keys (--api-key k1 k2, --api-key-file) on real
processes: `llmserve serve` over https with the official openai client, and `llmserve route` over https in
front of it, talking https to it (--backend-ca-certs). The certificate is self-signed, made here."""

from __future__ import annotations

import datetime
import ipaddress
import shutil
import ssl
import subprocess

import httpx
import openai
import pytest

from llmserve.testing.launcher import ROUTE, ServerProcess

KEYS = ("sk-first", "sk-second")
FILE_KEY = "sk-from-file"
Q = [{"role": "user", "content": "Say hello."}]


def make_cert(folder) -> tuple[str, str]:
    """A self-signed certificate for localhost and 127.0.0.1, its own CA: (key file, cert file)."""
    key_path, cert_path = str(folder / "key.pem"), str(folder / "cert.pem")
    try:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID
    except ImportError:
        if shutil.which("openssl") is None:
            pytest.skip("neither the cryptography package nor the openssl command is available")
        subprocess.run(
            ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=localhost"]
            + ["-keyout", key_path, "-out", cert_path, "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"],
            check=True,
            capture_output=True,
        )
        return key_path, cert_path
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=2))
        .add_extension(
            x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    with open(key_path, "wb") as f:
        f.write(
            key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            )
        )
    with open(cert_path, "wb") as f:
        f.write(cert.public_bytes(serialization.Encoding.PEM))
    return key_path, cert_path


@pytest.fixture(scope="module")
def tls(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tls")
    key, cert = make_cert(folder)
    key_file = folder / "keys.txt"
    key_file.write_text(f"# the file's keys\n\n  {FILE_KEY}  \n# sk-commented-out\n")
    return {"key": key, "cert": cert, "key_file": str(key_file), "ca": ssl.create_default_context(cafile=cert)}


@pytest.fixture(scope="module")
def server(tls):
    tls_flags = ("--ssl-keyfile", tls["key"], "--ssl-certfile", tls["cert"])
    with ServerProcess(
        *tls_flags,
        *("--api-key", *KEYS, "--api-key-file", tls["key_file"]),
        *("--num-threads", "1", "--served-model-name", "smol", "--max-model-len", "512"),
        verify=tls["cert"],
    ) as srv:
        yield srv.wait_ready()


def client(url: str, key: str, ca: ssl.SSLContext) -> openai.OpenAI:
    """The official client over https, verifying the server against the test's certificate (httpx 0.28+ takes
    an SSLContext; a CA file path is deprecated)."""
    return openai.OpenAI(
        base_url=url + "/v1", api_key=key, http_client=httpx.Client(verify=ca), max_retries=0, timeout=120
    )


def test_chat_over_https_with_each_key(server, tls):
    assert server.url.startswith("https://")
    for key in (*KEYS, FILE_KEY):
        out = client(server.url, key, tls["ca"]).chat.completions.create(model="smol", messages=Q, max_tokens=4)
        assert out.choices[0].message.content and out.usage.completion_tokens >= 1


def test_another_key_is_refused_with_an_openai_error(server, tls):
    with pytest.raises(openai.AuthenticationError) as e:
        client(server.url, "sk-third", tls["ca"]).chat.completions.create(model="smol", messages=Q, max_tokens=4)
    assert e.value.status_code == 401
    body = httpx.post(
        server.url + "/v1/chat/completions",
        json={"messages": Q},
        headers={"x-api-key": "sk-commented-out"},
        verify=tls["ca"],
    )
    err = body.json()["error"]
    assert body.status_code == 401 and err["code"] == "invalid_api_key" and err["type"] and err["message"]
    # x-api-key (Anthropic's clients) takes any of the keys too
    r = httpx.get(server.url + "/v1/models", headers={"x-api-key": KEYS[1]}, verify=tls["ca"])
    assert r.status_code == 200


def test_plain_http_to_the_tls_port_fails(server):
    try:
        r = httpx.get(f"http://127.0.0.1:{server.port}/health", timeout=5)
    except httpx.HTTPError:
        return
    assert r.status_code != 200


def test_the_server_refuses_a_key_without_its_certificate(tls):
    with ServerProcess("--ssl-keyfile", tls["key"]) as srv:
        assert srv.proc.wait(120) != 0
        assert "--ssl-keyfile needs --ssl-certfile" in srv.log()


def test_router_over_https_in_front_of_an_https_backend(server, tls):
    with ServerProcess(
        *("--backend", server.url, "--backend-ca-certs", tls["cert"], "--backend-api-key", KEYS[0]),
        *("--ssl-keyfile", tls["key"], "--ssl-certfile", tls["cert"]),
        *("--api-key", "rk-1", "--api-key", "rk-2", "--health-interval", "1"),
        cmd=ROUTE,
        verify=tls["cert"],
    ) as router:
        router.wait_ready(60)
        for key in ("rk-1", "rk-2"):
            out = client(router.url, key, tls["ca"]).chat.completions.create(model="smol", messages=Q, max_tokens=3)
            assert out.choices[0].message.content
        with pytest.raises(openai.AuthenticationError):
            client(router.url, KEYS[0], tls["ca"]).models.list()  # a backend's key is not the router's
        stream = client(router.url, "rk-2", tls["ca"]).chat.completions.create(
            model="smol", messages=Q, max_tokens=3, stream=True
        )
        assert any(c.choices and c.choices[0].delta.content for c in stream)
