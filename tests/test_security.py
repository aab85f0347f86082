"""Transport security, authentication, isolation between principals, and bounded resources, over
real loopback sockets: TLS (and mutual TLS) with a throwaway CA, bearer tokens at the handshake,
sessions bound to their principal and connection, caps on sessions, KV memory and frame size, and
peers that stop reading."""

from __future__ import annotations

import base64
import datetime
import io
import ipaddress
import json
import logging
import os
import secrets
import socket
import ssl
import struct
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch
from conftest import TINY_SPLIT
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from protocol_client import RawClient, greedy
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from splitllm.protocol import messages
from splitllm.protocol.messages import (
    ClosedMessage,
    ErrorMessage,
    OpenedMessage,
    OpenMessage,
    ResultMessage,
    StepMessage,
)
from splitllm.client.connection import (
    TOKEN_ENV,
    AuthenticationError,
    ConnectionOptions,
    ServerUnreachable,
    read_token,
)
from splitllm.client.remote import RemoteMiddle
from splitllm.testing.launch import ServerThread
from splitllm.weights.sources import ModelFiles
from splitllm.server.app import MiddleServer
from splitllm.server.auth import ANONYMOUS, TokenTable
from splitllm.server.logs import configure, event, formatter
from splitllm.server.settings import ServerSettings
from splitllm.server.transport import TlsFiles

FIRST, LAST = TINY_SPLIT
CONTEXT = 64
TOKENS = {name: secrets.token_urlsafe(24) for name in ("alice", "bob", "carol")}


# --- a throwaway PKI ------------------------------------------------------------------------------------


def _issue(cn: str, issuer=None, ca: bool = False, san=None, usage=None):  # type: ignore[no-untyped-def]
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(issuer[0].subject if issuer else name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if san:
        builder = builder.add_extension(x509.SubjectAlternativeName(san), critical=False)
    if usage:
        builder = builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    return builder.sign(issuer[1] if issuer else key, hashes.SHA256()), key


def _write(folder: Path, stem: str, cert, key) -> None:  # type: ignore[no-untyped-def]
    (folder / f"{stem}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (folder / f"{stem}.key").write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """ca, server (localhost / 127.0.0.1), client (signed by ca) and stranger (signed by another CA)."""
    folder = tmp_path_factory.mktemp("pki")
    ca = _issue("splitllm test CA", ca=True)
    _write(folder, "ca", *ca)
    san = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    _write(folder, "server", *_issue("localhost", ca, san=san, usage=ExtendedKeyUsageOID.SERVER_AUTH))
    _write(folder, "client", *_issue("alice", ca, usage=ExtendedKeyUsageOID.CLIENT_AUTH))
    other_ca = _issue("another CA", ca=True)
    _write(folder, "stranger", *_issue("mallory", other_ca, usage=ExtendedKeyUsageOID.CLIENT_AUTH))
    return folder


@pytest.fixture(scope="module")
def token_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("auth") / "tokens"
    path.write_text("# principal:token\n" + "".join(f"{p}:{t}\n" for p, t in TOKENS.items()))
    return path


@pytest.fixture(scope="module")
def secure(tiny, certs, token_file):  # type: ignore[no-untyped-def]
    """A wss:// server that wants a bearer token."""
    server = MiddleServer(tiny, ServerSettings(first=FIRST, last=LAST, operators=("carol",)),
                          TokenTable.load(token_file))
    with ServerThread(server, tls=TlsFiles(str(certs / "server.pem"), str(certs / "server.key"))) as thread:
        yield thread


def _options(certs: Path, principal: str | None = None, **kw: object) -> ConnectionOptions:
    return ConnectionOptions(token=TOKENS.get(principal or ""), ca_file=str(certs / "ca.pem"),
                             **{"deadline_s": 2.0, **kw})  # type: ignore[arg-type]


def _middle(thread: ServerThread, options: ConnectionOptions | None = None, context: int = CONTEXT) -> RemoteMiddle:
    files = thread.server.files
    return RemoteMiddle(thread.url, files.fingerprint, (FIRST, files.config.num_layers - LAST), "float16", context,
                        options)


def _sample(thread: ServerThread, name: str, **labels: str) -> float:
    return thread.server.metrics.total(name, **labels)


# --- transport security ---------------------------------------------------------------------------------


def test_tls_with_token_decodes_like_plain_websocket(  # type: ignore[no-untyped-def]
    tiny, secure, certs, server, load_client_model, random_ids
) -> None:
    client_model, prompt = load_client_model(tiny, FIRST, LAST), random_ids(8, 1)
    plain = greedy(client_model, _middle(server(tiny, FIRST, LAST)), prompt, 16)
    assert secure.url.startswith("wss://")
    assert greedy(client_model, _middle(secure, _options(certs, "alice")), prompt, 16) == plain


def test_tls_is_1_2_or_later_and_heads_go_through_h11(tiny, certs) -> None:  # type: ignore[no-untyped-def]
    from splitllm.server.http_guard import GuardedH11Protocol
    from splitllm.server.transport import uvicorn_config

    tls = TlsFiles(str(certs / "server.pem"), str(certs / "server.key"))
    config = uvicorn_config(MiddleServer(tiny, ServerSettings(first=FIRST, last=LAST)), "127.0.0.1", 0, tls)
    assert config.ssl is not None and config.ssl.minimum_version == ssl.TLSVersion.TLSv1_2
    assert issubclass(config.http_protocol_class, GuardedH11Protocol)  # never httptools, even when installed


def test_untrusted_server_certificate_fails_at_once(secure, certs) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ssl.SSLCertVerificationError):
        _middle(secure, ConnectionOptions(token=TOKENS["alice"], deadline_s=30.0))  # not retried for 30 s
    insecure = _middle(secure, ConnectionOptions(token=TOKENS["alice"], insecure=True))  # encrypted, unverified
    insecure.close()


def test_mutual_tls_admits_only_certificates_of_its_ca(tiny, certs, load_client_model,  # type: ignore[no-untyped-def]
                                                       random_ids) -> None:
    tls = TlsFiles(str(certs / "server.pem"), str(certs / "server.key"), client_ca=str(certs / "ca.pem"))
    with ServerThread(MiddleServer(tiny, ServerSettings(first=FIRST, last=LAST)), tls=tls) as thread:
        mine = _options(certs, client_cert=str(certs / "client.pem"), client_key=str(certs / "client.key"))
        assert len(greedy(load_client_model(tiny, FIRST, LAST), _middle(thread, mine), random_ids(4, 2), 4)) == 4
        stranger = str(certs / "stranger.pem"), str(certs / "stranger.key")
        for options in (_options(certs, deadline_s=0.3),
                        _options(certs, None, deadline_s=0.3, client_cert=stranger[0], client_key=stranger[1])):
            with pytest.raises(ServerUnreachable, match="client certificate"):
                _middle(thread, options)
        assert _sample(thread, "splitllm_sessions_opened_total") == 1


def test_client_certificate_names_the_principal(  # type: ignore[no-untyped-def]
    tiny, certs, token_file, load_client_model, random_ids
) -> None:
    """Under mutual TLS the certificate's common name (alice) is the principal; with tokens too, only
    alice's token goes with alice's certificate."""
    tls = TlsFiles(str(certs / "server.pem"), str(certs / "server.key"), client_ca=str(certs / "ca.pem"))
    cert = {"client_cert": str(certs / "client.pem"), "client_key": str(certs / "client.key")}
    client_model = load_client_model(tiny, FIRST, LAST)
    with ServerThread(MiddleServer(tiny, ServerSettings(first=FIRST, last=LAST)), tls=tls) as thread:
        greedy(client_model, _middle(thread, _options(certs, **cert)), random_ids(4, 5), 2)
        assert thread.server.metrics.total("splitllm_sessions_opened_total", principal="alice") == 1
    with ServerThread(MiddleServer(tiny, ServerSettings(first=FIRST, last=LAST), TokenTable.load(token_file)),
                      tls=tls) as thread:
        with pytest.raises(AuthenticationError):
            _middle(thread, _options(certs, "bob", **cert))
        greedy(client_model, _middle(thread, _options(certs, "alice", **cert)), random_ids(4, 5), 2)


# --- authentication -------------------------------------------------------------------------------------


def test_refused_handshakes_do_no_model_work(secure, certs) -> None:  # type: ignore[no-untyped-def]
    before = {n: _sample(secure, n) for n in ("splitllm_sessions_opened_total", "splitllm_steps_total")}
    refused = _sample(secure, "splitllm_handshakes_refused_total", reason="unauthenticated")
    for token in (None, "wrong-token", TOKENS["alice"] + "x", f"alice:{TOKENS['alice']}"):
        with pytest.raises(AuthenticationError, match="authentication failed") as info:
            _middle(secure, ConnectionOptions(token=token, ca_file=str(certs / "ca.pem"), deadline_s=30.0))
        assert info.value.code == "unauthenticated" and not info.value.retryable
    assert {n: _sample(secure, n) for n in before} == before
    assert _sample(secure, "splitllm_handshakes_refused_total", reason="unauthenticated") == refused + 4


def test_token_comes_from_a_file_or_the_environment(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    assert read_token() is None
    monkeypatch.setenv(TOKEN_ENV, "from-env")
    assert read_token() == "from-env"
    (tmp_path / "t").write_text("  from-file\n")
    assert read_token(tmp_path / "t") == "from-file"
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValueError, match="empty"):
        read_token(tmp_path / "empty")


def test_token_table_format(tmp_path) -> None:  # type: ignore[no-untyped-def]
    table = TokenTable({"alice": "a-token", "bob": "b-token"})
    assert [table.principal(h) for h in ("Bearer a-token", "bearer b-token", "Bearer c", "a-token", None,
                                         "Bearer ")] == [
        "alice", "bob", None, None, None, None,
    ]
    for bad in ("alice", "alice:", ":token", "alice:x\nalice:y"):
        (tmp_path / "t").write_text(bad)
        with pytest.raises(ValueError):
            TokenTable.load(tmp_path / "t")


def _get(url: str, ctx: ssl.SSLContext, principal: str | None = None) -> str:
    headers = {"Authorization": f"Bearer {TOKENS[principal]}"} if principal else {}
    return urllib.request.urlopen(urllib.request.Request(url, headers=headers), context=ctx, timeout=10).read().decode()


def test_metrics_need_a_token_and_show_each_principal_only_its_own(  # type: ignore[no-untyped-def]
    secure, certs, load_client_model, tiny, random_ids
) -> None:
    ctx = ssl.create_default_context(cafile=str(certs / "ca.pem"))
    url = f"https://127.0.0.1:{secure.port}/metrics"
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(url, context=ctx, timeout=10)
    assert refused.value.code == 401
    for principal in ("alice", "bob"):
        greedy(load_client_model(tiny, FIRST, LAST), _middle(secure, _options(certs, principal)), random_ids(4, 3), 2)
    bob = _get(url, ctx, "bob")
    assert 'splitllm_steps_total{principal="bob"}' in bob
    assert "alice" not in bob and "splitllm_sessions " not in bob and "splitllm_step_seconds_bucket" not in bob
    operator = _get(url, ctx, "carol")  # an operator principal sees the whole server
    for name in ("splitllm_sessions ", "splitllm_kv_bytes ", "splitllm_step_seconds_bucket", 'principal="alice"'):
        assert name in operator, name


def test_health_shows_load_only_to_authenticated_callers(secure, certs) -> None:  # type: ignore[no-untyped-def]
    ctx = ssl.create_default_context(cafile=str(certs / "ca.pem"))
    url = f"https://127.0.0.1:{secure.port}/health"
    anonymous = json.loads(_get(url, ctx))
    assert anonymous["status"] == "ok" and not {"sessions", "kv_bytes", "connections"} & set(anonymous)
    assert set(json.loads(_get(url, ctx, "bob"))) >= {"sessions", "kv_bytes"}
    assert "connections" in json.loads(_get(url, ctx, "carol"))


@pytest.mark.slow
def test_cli_generate_with_token_file_and_environment(default_files, token_file,  # type: ignore[no-untyped-def]
                                                      tmp_path) -> None:
    server = MiddleServer(None, ServerSettings(first=2, last=2), TokenTable.load(token_file))
    wrong = tmp_path / "wrong"
    wrong.write_text("not-a-token\n")
    base = [sys.executable, "-m", "splitllm.cli", "generate", "Say hi.", "--max-new-tokens", "4", "--json"]
    with ServerThread(server) as thread:
        env = {**os.environ, TOKEN_ENV: TOKENS["carol"]}
        ok = subprocess.run([*base, "--server", thread.url], env=env, capture_output=True, text=True, timeout=300)
        assert ok.returncode == 0, ok.stderr
        assert json.loads(ok.stdout)["new_tokens"] == 4
        bad = subprocess.run(
            [*base, "--server", thread.url, "--token-file", str(wrong)], env=env, capture_output=True, text=True,
            timeout=300
        )
        assert bad.returncode == 1 and "authentication failed" in bad.stderr
        assert _sample(thread, "splitllm_sessions_opened_total") == 1


# --- isolation ------------------------------------------------------------------------------------------


def test_sessions_belong_to_their_principal_and_connection(tiny, secure, certs) -> None:  # type: ignore[no-untyped-def]
    files = ModelFiles(tiny)
    layers = (FIRST, files.config.num_layers - LAST)
    hidden = torch.randn(3, files.config.hidden_size)
    with RawClient(secure.url, _options(certs, "alice")) as alice, RawClient(secure.url, _options(certs, "bob")) as bob:
        session = alice.open(files, layers).session  # type: ignore[union-attr]
        never = secrets.token_urlsafe(18)

        def refusal(client: RawClient, sid: str, op: str) -> tuple:
            reply = client.step(sid, hidden, [0, 1, 2], []) if op == "step" else client.close_session(sid)
            assert isinstance(reply, ErrorMessage), reply
            return reply.code, reply.message

        with RawClient(secure.url, _options(certs, "alice")) as alice_again:
            for op in ("step", "close"):
                # another principal, or the same one on another connection: the answer an unknown id gets
                assert refusal(bob, session, op) == refusal(bob, never, op) == refusal(alice_again, session, op)
                assert refusal(bob, session, op)[0] == "unknown_session"
        assert isinstance(alice.step(session, hidden, [0, 1, 2], []), ResultMessage)  # untouched


def test_expired_session_is_refused_as_expired_to_its_owner_only(tiny) -> None:  # type: ignore[no-untyped-def]
    files = ModelFiles(tiny)
    layers = (FIRST, files.config.num_layers - LAST)
    with ServerThread(MiddleServer(tiny, ServerSettings(first=FIRST, last=LAST, session_ttl_s=0.3))) as thread:
        with RawClient(thread.url) as owner, RawClient(thread.url) as other:
            session = owner.open(files, layers).session  # type: ignore[union-attr]
            deadline = time.monotonic() + 10
            while thread.server.info(ANONYMOUS)["sessions"] and time.monotonic() < deadline:
                time.sleep(0.05)
            hidden = torch.randn(1, files.config.hidden_size)
            assert owner.step(session, hidden, [0], []).code == "session_expired"  # type: ignore[union-attr]
            assert other.step(session, hidden, [0], []).code == "unknown_session"  # type: ignore[union-attr]
            assert thread.server.info(ANONYMOUS)["kv_bytes"] == 0


# --- bounded resources ----------------------------------------------------------------------------------


def test_session_caps_refuse_new_sessions_retryably_and_never_evict(tiny,  # type: ignore[no-untyped-def]
                                                                    token_file) -> None:
    files = ModelFiles(tiny)
    layers = (FIRST, files.config.num_layers - LAST)
    settings = ServerSettings(first=FIRST, last=LAST, max_sessions=3, max_sessions_per_principal=2)
    with ServerThread(MiddleServer(tiny, settings, TokenTable.load(token_file))) as thread:
        clients = {p: RawClient(thread.url, ConnectionOptions(token=TOKENS[p])) for p in TOKENS}
        try:
            a1, a2 = (clients["alice"].open(files, layers).session for _ in range(2))  # type: ignore[union-attr]
            third = clients["alice"].open(files, layers)
            assert isinstance(third, ErrorMessage) and (third.code, third.retryable) == ("principal_full", True)
            assert isinstance(clients["bob"].open(files, layers), OpenedMessage)
            full = clients["carol"].open(files, layers)
            assert isinstance(full, ErrorMessage) and (full.code, full.retryable) == ("server_full", True)
            assert isinstance(clients["alice"].close_session(a1), ClosedMessage)
            assert isinstance(clients["carol"].open(files, layers), OpenedMessage)
            step = clients["alice"].step(a2, torch.randn(2, files.config.hidden_size), [0, 1], [])
            assert isinstance(step, ResultMessage)  # the older session was never evicted
        finally:
            for c in clients.values():
                c.close()


def test_kv_memory_is_reserved_at_open_and_bounded(tiny) -> None:  # type: ignore[no-untyped-def]
    files = ModelFiles(tiny)
    layers = (FIRST, files.config.num_layers - LAST)
    probe = MiddleServer(tiny, ServerSettings(first=FIRST, last=LAST))
    per_session = probe.stage.new_cache(CONTEXT).nbytes
    settings = ServerSettings(first=FIRST, last=LAST, max_kv_bytes=int(2.5 * per_session))
    with ServerThread(MiddleServer(tiny, settings)) as thread, RawClient(thread.url) as raw:
        for _ in range(2):
            assert isinstance(raw.open(files, layers, CONTEXT), OpenedMessage)
        assert thread.server.info(ANONYMOUS)["kv_bytes"] == 2 * per_session
        full = raw.open(files, layers, CONTEXT)
        assert isinstance(full, ErrorMessage) and (full.code, full.retryable) == ("server_full",
                                                                                  True) and "KV" in full.message
        assert isinstance(raw.open(files, layers, CONTEXT // 4), OpenedMessage)  # a smaller one still fits
        too_big = raw.open(files, layers, 4 * CONTEXT)
        assert isinstance(too_big, ErrorMessage) and (too_big.code, too_big.retryable) == ("context_too_large", False)
        assert thread.server.info(ANONYMOUS)["kv_bytes"] <= settings.max_kv_bytes
    assert thread.server.info(ANONYMOUS)["kv_bytes"] == 0  # released with the connection


def test_nodes_per_step_and_context_are_capped(tiny) -> None:  # type: ignore[no-untyped-def]
    files = ModelFiles(tiny)
    layers = (FIRST, files.config.num_layers - LAST)
    settings = ServerSettings(first=FIRST, last=LAST, max_context=32, max_nodes_per_step=8)
    with ServerThread(MiddleServer(tiny, settings)) as thread, RawClient(thread.url) as raw:
        opened = raw.open(files, layers, 10_000)
        assert isinstance(opened, OpenedMessage) and (opened.max_context, opened.max_nodes) == (32, 8)
        d = files.config.hidden_size
        assert raw.step(opened.session, torch.randn(9, d), list(range(9)), []).code == "too_many_nodes"  # type: ignore[union-attr]
        assert isinstance(raw.step(opened.session, torch.randn(8, d), list(range(8)), []), ResultMessage)


def test_oversized_frame_is_refused_from_its_header(tiny, server) -> None:  # type: ignore[no-untyped-def]
    """A frame declaring 1 TiB is refused (close 1009) as soon as its length is read: nothing is buffered."""
    thread = server(tiny, FIRST, LAST, max_frame_bytes=1 << 20)
    with socket.create_connection(("127.0.0.1", thread.port), timeout=10) as sock:
        key = base64.b64encode(os.urandom(16))
        sock.sendall(
            b"GET /ws HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
            b"Sec-WebSocket-Key: " + key + b"\r\nSec-WebSocket-Version: 13\r\n\r\n"
        )
        response = b""
        while b"\r\n\r\n" not in response:
            response += sock.recv(4096)
        assert response.startswith(b"HTTP/1.1 101")
        sock.sendall(bytes([0x82, 0x80 | 127]) + struct.pack(">Q", 1 << 40) + os.urandom(4) + b"x" * 1000)
        reply = response.split(b"\r\n\r\n", 1)[1]
        while len(reply) < 4:
            chunk = sock.recv(4096)
            if not chunk:
                break
            reply += chunk
        assert reply[0] == 0x88 and struct.unpack(">H", reply[2:4])[0] == 1009  # close: message too big
    with RawClient(thread.url) as raw:  # and the server carries on
        assert raw.send_raw(b"\x00").code == "bad_frame"  # type: ignore[union-attr]


def test_a_peer_that_stops_reading_blocks_nobody(tiny, load_client_model,  # type: ignore[no-untyped-def]
                                                 random_ids) -> None:
    files = ModelFiles(tiny)
    layers = (FIRST, files.config.num_layers - LAST)
    client_model, prompt = load_client_model(tiny, FIRST, LAST), random_ids(8, 3)
    settings = ServerSettings(first=FIRST, last=LAST, send_timeout_s=1.0)
    with ServerThread(MiddleServer(tiny, settings)) as thread:
        expected = greedy(client_model, _middle(thread), prompt, 24)
        # max_queue=1: this client's reader thread stops taking data after one message
        staller = connect(thread.url + "/ws", compression=None, max_size=None, max_queue=1, legacy=True)
        staller.send(messages.encode(OpenMessage(files.fingerprint, layers, "float32", 256)))
        session = messages.decode(staller.recv(timeout=10), (OpenedMessage,)).session
        n = 256  # 64 KiB replies: a few hundred fill every socket buffer on the way back
        big = messages.encode(StepMessage(session, torch.randn(n, files.config.hidden_size), "float32",
                                          tuple(range(n))))

        def flood() -> None:
            try:
                for _ in range(1000):
                    staller.send(big)
            except Exception:
                pass  # the server gave up on this connection

        threading.Thread(target=flood, daemon=True).start()
        try:
            assert greedy(client_model, _middle(thread), prompt, 24) == expected
            deadline = time.monotonic() + 60
            while _sample(thread, "splitllm_connections_dropped_total", reason="stalled") < 1:
                assert time.monotonic() < deadline, "the stalled connection was never dropped"
                time.sleep(0.1)
            assert thread.server.info(ANONYMOUS)["sessions"] == 0  # its session and KV memory are released
            assert greedy(client_model, _middle(thread), prompt, 24) == expected
        finally:
            staller.socket.shutdown(socket.SHUT_RDWR)


def test_a_silent_connection_is_closed_and_its_sessions_freed(tiny) -> None:  # type: ignore[no-untyped-def]
    files = ModelFiles(tiny)
    with ServerThread(MiddleServer(tiny, ServerSettings(first=FIRST, last=LAST, idle_timeout_s=0.5))) as thread:
        with RawClient(thread.url) as raw:
            assert isinstance(raw.open(files, (FIRST, files.config.num_layers - LAST)), OpenedMessage)
            with pytest.raises(ConnectionClosed) as closed:
                raw.ws.recv(timeout=30)
        assert closed.value.rcvd is not None and closed.value.rcvd.code == 1000
        # The close frame goes out before the handler releases the session and counts the drop.
        deadline = time.monotonic() + 10
        while thread.server.info(ANONYMOUS)["sessions"] or not _sample(thread, "splitllm_connections_dropped_total",
                                                                       reason="idle"):
            assert time.monotonic() < deadline, "the silent connection's session was never freed"
            time.sleep(0.05)
        assert _sample(thread, "splitllm_connections_dropped_total", reason="idle") == 1


# --- observability --------------------------------------------------------------------------------------


def test_logs_are_structured_and_carry_no_tensors(tiny, load_client_model, random_ids,  # type: ignore[no-untyped-def]
                                                  caplog) -> None:
    client_model = load_client_model(tiny, FIRST, LAST)
    with caplog.at_level(logging.DEBUG, logger="splitllm.server"):
        with ServerThread(MiddleServer(tiny, ServerSettings(first=FIRST, last=LAST))) as thread:
            greedy(client_model, _middle(thread), random_ids(8, 4), 6)
            with RawClient(thread.url) as raw:
                raw.send_raw(b"garbage")
    records = [r for r in caplog.records if r.name == "splitllm.server"]
    events = [r.getMessage() for r in records]
    for expected in ("connection_opened", "session_opened", "step", "request_refused", "session_closed"):
        assert expected in events, events
    for r in records:
        fields = getattr(r, "fields", {})
        assert all(isinstance(v, (str, int, float, bool, type(None))) for v in fields.values()), fields
        assert all(len(str(v)) < 100 for v in fields.values()), fields  # ids are cut, no arrays
    opened = next(r for r in records if r.getMessage() == "session_opened")
    line = json.loads(formatter("json").format(opened))
    assert line["event"] == "session_opened" and len(line["session"]) == 8 and line["principal"] == "anonymous"


def test_logs_follow_stderr_when_it_is_swapped(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A server thread that outlives the stderr it was configured under (a test runner's capture) still logs."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    try:
        first = io.StringIO()
        monkeypatch.setattr(sys, "stderr", first)
        configure("text")
        first.close()
        second = io.StringIO()
        monkeypatch.setattr(sys, "stderr", second)
        event("after_swap", peer="x")
        assert "after_swap peer=x" in second.getvalue()
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
