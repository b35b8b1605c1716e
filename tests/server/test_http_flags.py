"""`kvloom serve` with vLLM's uvicorn flags, as a real process: HTTPS from a key and a
certificate (made here by openssl), a root path a reverse proxy serves the API under, no
access log, and ``--trust-remote-code`` accepted; the TLS files only as a pair."""

from __future__ import annotations

import os
import re
import shutil
import signal
import ssl
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from kvloom.ports import reserve_ports

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl makes the test certificate")


def serve(model: Path, port: int, *flags: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    return subprocess.Popen(
        [sys.executable, "-m", "kvloom.server", str(model), "--port", str(port), "--dtype", "float32",
         "--num-blocks", "64", "--max-model-len", "256", "--num-threads", "1", "--log-level", "info", *flags],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_https_under_a_root_path_without_an_access_log(tiny_llama: Path, tmp_path: Path) -> None:
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                    str(cert), "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True)
    port = reserve_ports(1)[0]
    proc = serve(tiny_llama, port, "--ssl-keyfile", str(key), "--ssl-certfile", str(cert), "--root-path", "/kvloom",
                 "--disable-uvicorn-access-log", "--trust-remote-code")
    base = f"https://127.0.0.1:{port}"
    try:
        with httpx.Client(base_url=base, verify=ssl.create_default_context(cafile=str(cert)), timeout=30) as client:
            deadline = time.monotonic() + 90
            while True:  # until /health answers over TLS (the model loads meanwhile)
                assert proc.poll() is None, proc.communicate()[0]
                try:
                    if client.get("/health").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                assert time.monotonic() < deadline, "the server never became healthy"
                time.sleep(0.2)
            reply = client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 3})
            assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 3
            assert client.get("/openapi.json").json()["servers"] == [{"url": "/kvloom"}]
        with pytest.raises(httpx.TransportError):  # plain HTTP finds no HTTP there
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=10)
    finally:
        proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, output
    assert f"on https://127.0.0.1:{port}/kvloom" in output
    assert re.search(r'"(GET|POST) \S+ HTTP/1.1"', output) is None, output  # no access log line


def test_the_tls_files_go_together(tmp_path: Path) -> None:
    from kvloom.cli import build_parser
    from kvloom.server.cli import http_options
    args = build_parser().parse_args(["serve", "some/model", "--ssl-keyfile", str(tmp_path / "key.pem")])
    with pytest.raises(SystemExit, match="--ssl-keyfile and --ssl-certfile go together"):
        http_options(args)
