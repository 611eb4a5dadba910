"""Credentials never printed: `redact_url` and the objects whose repr shows a Redis URL."""

from __future__ import annotations

import pytest

from pagekv.deploy.local_cluster import LocalCluster
from pagekv.proto.redact import redact_url
from pagekv.router.config import RouterConfig


@pytest.mark.parametrize("url, want", [
    ("redis://:s3cret@10.0.0.5:6379/0", "redis://***@10.0.0.5:6379/0"),
    ("rediss://pagekv:s3cret@redis.internal:6380/1", "rediss://***@redis.internal:6380/1"),
    ("redis://user@host:6379/0", "redis://***@host:6379/0"),  # a user name says too much
    # Typed unescaped, a password with @ / ? must not leak its tail.
    ("redis://:p@ss/w?rd@host:6379/0", "redis://***@host:6379/0"),
    ("redis://host:6379/0?password=s3cret&db=2", "redis://host:6379/0?password=***&db=2"),
    ("rediss://host/0?ssl_password=s3cret", "rediss://host/0?ssl_password=***"),
    ("redis://127.0.0.1:6379/0", "redis://127.0.0.1:6379/0"),
    ("unix:///tmp/redis.sock?db=0", "unix:///tmp/redis.sock?db=0"),
    ("", ""),
    (None, ""),
])
def test_redact_url(url: str | None, want: str) -> None:
    assert redact_url(url) == want


def test_reprs_hide_the_password_and_tokens() -> None:
    cfg = RouterConfig(redis_url="redis://:s3cret@h:1/0", api_token="tok-api",
                       pod_api_token="tok-pod")
    assert "s3cret" not in repr(cfg) and "tok-" not in repr(cfg)
    assert "redis://***@h:1/0" in repr(cfg)
    cluster = LocalCluster(redis_url="redis://:s3cret@h:1/0", admin_token="tok-admin")
    assert "s3cret" not in repr(cluster) and "tok-admin" not in repr(cluster)
    assert "s3cret" not in cluster.describe()
