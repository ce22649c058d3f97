"""Builds behind a TLS-intercepting proxy: a certificate failure in a build log is recognised, and the error says
what to do (--trust-host-ca), which then works.

The log lines are what the tools printed on a machine whose HTTPS goes through such a proxy. The Docker test
needs that machine: it skips where a plain build reaches PyPI (no proxy) or reaches nothing."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from sandbox.images.base_image import CA_REPOSITORY, REPOSITORY, from_images, tls_advice
from sandbox.images.docker_build import tls_failure

ROOT = Path(__file__).resolve().parent.parent

FAILED = [
    ("pip", "WARNING: Retrying (Retry(total=0, connect=None, read=None, redirect=None, status=None)) after "
            "connection broken by 'SSLError(SSLCertVerificationError(1, '[SSL: CERTIFICATE_VERIFY_FAILED] certificate "
            "verify failed: self-signed certificate in certificate chain (_ssl.c:992)'))': /simple/six/"),
    ("curl", "curl: (60) SSL certificate problem: self-signed certificate in certificate chain"),
    ("git", "fatal: unable to access 'https://pypi.org/x/': server certificate verification failed. CAfile: none "
            "CRLfile: none"),
    ("npm", "npm ERR! code SELF_SIGNED_CERT_IN_CHAIN"),
    ("apt", "Err:1 https://deb.nodesource.com/node_20.x nodistro InRelease Certificate verification failed: The "
            "certificate is NOT trusted."),
    ("uv", "error: invalid peer certificate: UnknownIssuer"),
    ("go", "x509: certificate signed by unknown authority"),
]
NOT_TLS = ["curl: (6) Could not resolve host: raw.githubusercontent.com",
           "ERROR: No matching distribution found for six",
           "E: Version '4.3.3-2build2' for 'r-base-core' was not found",
           "ssl: handshake timed out after 30 s"]


@pytest.mark.parametrize("tool,line", FAILED, ids=[t for t, _ in FAILED])
def test_certificate_failures_are_recognised(tool: str, line: str) -> None:
    log = f"Step 3/4 : RUN something\n ---> Running in 0123456789ab\n{line}\nmore output\n"
    assert tls_failure(log) == line


def test_other_failures_are_not() -> None:
    assert tls_failure("\n".join(NOT_TLS)) is None


def test_advice_depends_on_what_the_image_builds_on() -> None:
    plain = tls_advice("x", from_images(f"FROM {REPOSITORY}:abc\nRUN pip install six\n"))
    assert "rerun with --trust-host-ca" in plain
    trusted = tls_advice("x", from_images(f"FROM --platform=linux/amd64 {CA_REPOSITORY}:abc AS b\n"))
    assert "although the image trusts this host's CA bundle" in trusted and "T1_HOST_CA_BUNDLE" in trusted
    foreign = tls_advice("x", from_images("FROM ghcr.io/x/toolchain:1\n"))
    assert "ghcr.io/x/toolchain:1" in foreign and "--base-image" in foreign


def _probe_plain_base() -> str:
    """What pip prints reaching PyPI from the plain base image, with a network."""
    from sandbox.images.base_image import ensure_base_image

    r = subprocess.run(["docker", "run", "--rm", ensure_base_image(trust_host_ca=False), "python3", "-m", "pip",
                        "download", "--no-deps", "--retries", "1", "-d", "/tmp", "six"],
                       capture_output=True, text=True, timeout=300)
    return r.stdout + r.stderr if r.returncode else ""


@pytest.mark.docker
@pytest.mark.slow
def test_run_task_says_trust_host_ca_and_it_works(tmp_path: Path) -> None:
    out = _probe_plain_base()
    if tls_failure(out) is None:
        pytest.skip("pip reaches PyPI from the plain base here (no intercepting proxy)" if not out else
                    f"PyPI is not reachable from a build here for another reason: {out.strip()[-200:]}")
    task = tmp_path / "needs-pypi"
    files = {"task.toml": "", "instruction.md": "Nothing.\n",
             # The marker keeps the image out of the task-image cache other runs may hold.
             "environment/Dockerfile": f"FROM debian:bookworm\nRUN python3 -m pip download --no-deps --retries 1 "
                                       f"-d /opt six  # {os.getpid()} {tmp_path.name}\n",
             "tests/test_x.py": "import os\n\ndef test_six():\n"
                                "    assert any('six' in f for f in os.listdir('/opt'))\n"}
    for rel, text in files.items():
        (task / rel).parent.mkdir(parents=True, exist_ok=True)
        (task / rel).write_text(text)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "T1_TRUST_HOST_CA": "0"}
    cmd = [sys.executable, "-m", "sandbox.run_task", str(task)]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env, timeout=900)
    assert r.returncode == 2, r
    assert "certificate verification failed" in r.stderr and "rerun with --trust-host-ca" in r.stderr, r.stderr
    r = subprocess.run([*cmd, "--trust-host-ca"], cwd=ROOT, capture_output=True, text=True, env=env, timeout=900)
    assert r.returncode == 0 and "passed 1/1" in r.stdout, r
