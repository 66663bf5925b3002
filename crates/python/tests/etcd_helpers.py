"""A real etcd server for tests (Debian's etcd-server, or ``PAGEWIRE_ETCD``), on 127.0.0.1
ports of its own, and a reader of its keys over etcd's HTTP gateway. A test that needs
etcd and finds no binary fails with that advice; it never skips."""

import base64
import contextlib
import json
import os
import shutil
import subprocess
import tempfile
import urllib.request

from store_diff_cases import free_port, wait_port


@contextlib.contextmanager
def etcd_server(tls: dict | None = None):
    """Yields ``(url, client_port, process)``: one member, killed and removed on exit.
    With ``tls`` (``make_certs``' paths) it serves clients over TLS only and asks each
    for a certificate signed by the CA."""
    exe = os.environ.get("PAGEWIRE_ETCD") or shutil.which("etcd")
    assert exe, (
        "this test needs a real etcd server and found no `etcd` on PATH: "
        "run scripts/setup.sh (Debian's etcd-server) or set PAGEWIRE_ETCD"
    )
    d = tempfile.mkdtemp(prefix="pagewire-etcd-")
    client, peer = free_port(), free_port()
    scheme = "https" if tls else "http"
    c, p = f"{scheme}://127.0.0.1:{client}", f"http://127.0.0.1:{peer}"
    flags = []
    if tls:
        flags = [f"--cert-file={tls['server_cert']}", f"--key-file={tls['server_key']}",
                 f"--trusted-ca-file={tls['ca']}", "--client-cert-auth"]  # fmt: skip
    proc = subprocess.Popen(
        [exe, "--name=m0", f"--data-dir={d}/m0", f"--listen-client-urls={c}",
         f"--advertise-client-urls={c}", f"--listen-peer-urls={p}",
         f"--initial-advertise-peer-urls={p}", f"--initial-cluster=m0={p}",
         "--logger=zap", "--log-level=error", *flags],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        wait_port(client)
        yield f"etcd://127.0.0.1:{client}", client, proc
    finally:
        proc.kill()
        proc.wait()
        shutil.rmtree(d, ignore_errors=True)


def etcd_keys(port: int, prefix: str) -> dict:
    """Every key under ``prefix`` and its value (bytes), read through the HTTP gateway."""
    b64 = lambda b: base64.b64encode(b).decode()  # noqa: E731
    end = prefix[:-1] + chr(ord(prefix[-1]) + 1)
    body = json.dumps({"key": b64(prefix.encode()), "range_end": b64(end.encode())}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v3/kv/range", data=body)
    with urllib.request.urlopen(req, timeout=5) as r:
        kvs = json.load(r).get("kvs", [])
    return {base64.b64decode(kv["key"]).decode(): base64.b64decode(kv["value"]) for kv in kvs}


def _gateway(port: int, path: str, body: dict) -> dict:
    url = f"http://127.0.0.1:{port}/v3/{path}"
    req = urllib.request.Request(url, data=json.dumps(body).encode())
    with urllib.request.urlopen(req, timeout=5) as r:
        return json.load(r)


def enable_auth(port: int, users: dict) -> None:
    """Turns etcd's authentication on through its HTTP gateway: user ``root``, and for
    each ``name: (password, [prefix, ...])`` of ``users`` a user with read and write on
    those key prefixes only."""
    b64 = lambda s: base64.b64encode(s.encode()).decode()  # noqa: E731
    _gateway(port, "auth/role/add", {"name": "root"})
    _gateway(port, "auth/user/add", {"name": "root", "password": "root-pw"})
    _gateway(port, "auth/user/grant", {"user": "root", "role": "root"})
    for name, (password, prefixes) in users.items():
        role = f"role-{name}"
        _gateway(port, "auth/role/add", {"name": role})
        for p in prefixes:
            end = p[:-1] + chr(ord(p[-1]) + 1)
            perm = {"permType": "READWRITE", "key": b64(p), "range_end": b64(end)}
            _gateway(port, "auth/role/grant", {"name": role, "perm": perm})
        _gateway(port, "auth/user/add", {"name": name, "password": password})
        _gateway(port, "auth/user/grant", {"user": name, "role": role})
    _gateway(port, "auth/enable", {})


def make_certs(d: str) -> dict:
    """A CA, etcd's certificate (IP SAN 127.0.0.1) and a client certificate, made by
    ``openssl`` in ``d``: their paths by name."""
    def run(*args):
        subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True)

    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes"]
    run("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-days", "2", "-subj", "/CN=ca")
    with open(os.path.join(d, "server.ext"), "w") as f:
        f.write("subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth,clientAuth\n")
    with open(os.path.join(d, "client.ext"), "w") as f:
        f.write("extendedKeyUsage=clientAuth\n")
    for who in ("server", "client"):
        run("req", *ec, "-keyout", f"{who}.key", "-out", f"{who}.csr", "-subj", f"/CN={who}")
        run("x509", "-req", "-in", f"{who}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
            "-CAcreateserial", "-out", f"{who}.pem", "-days", "2",
            "-extfile", f"{who}.ext")  # fmt: skip
    j = lambda n: os.path.join(d, n)  # noqa: E731
    return {"ca": j("ca.pem"), "server_cert": j("server.pem"), "server_key": j("server.key"),
            "client_cert": j("client.pem"), "client_key": j("client.key")}  # fmt: skip
