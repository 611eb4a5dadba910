"""Credentials out of everything printed: log lines, error messages, `describe()` output.

A Redis URL carries its password (`redis://:secret@host:6379/0`, or `?password=`); whatever
shows a URL to a person or a log collector shows it through `redact_url`.
"""

from __future__ import annotations

import re

REDACTED = "***"

# Query parameters whose value is a secret (redis-py reads `password`; a key's passphrase
# travels as `ssl_password`).
_SECRET_QUERY = re.compile(r"([?&][^=&#]*(?:password|passwd|token|secret)[^=&#]*=)[^&#]*",
                           re.IGNORECASE)


def redact_url(url: str | None) -> str:
    """`url` with its `user:password@` replaced by `***@` and secret query values by `***`.

    Deliberately blunt: everything between `://` and the last `@` goes, so a password that
    contains `@`, `/` or `?` (unescaped, as people type them) cannot leak half of itself.
    Text without `://` only has its secret query values replaced."""
    if not url:
        return "" if url is None else url
    scheme, sep, rest = url.partition("://")
    if sep and "@" in rest:
        rest = REDACTED + rest[rest.rindex("@"):]
    return _SECRET_QUERY.sub(lambda m: m.group(1) + REDACTED, scheme + sep + rest)
