"""The index's Lua scripts, and the runner that sends each as one EVALSHA.

Every script takes the namespace base (`IndexSchema.base`) as ARGV[1] where it needs to name
keys itself, so one script serves every namespace. See docs/INDEX.md for what each does.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from redis.exceptions import NoScriptError

# KEYS: the request's block keys in chain order. ARGV[1]: the namespace base.
# Reply: flat [pod, tier codes, pod, tier codes, ...] for every live pod; the code string's
# length is the pod's depth. Only pods still matching are asked about the next block, and
# the walk ends as soon as none is left.
LOOKUP_LUA = """
local base = ARGV[1]
local live, suffix, codes = {}, {}, {}
for _, pod in ipairs(redis.call('SMEMBERS', base .. 'pods')) do
  local epoch = redis.call('GET', base .. 'l:' .. pod)
  if epoch then
    live[#live + 1] = pod
    suffix[pod] = ':' .. epoch
    codes[pod] = {}
  end
end
local active = live
for i = 1, #KEYS do
  if #active == 0 then break end
  local vals = redis.call('HMGET', KEYS[i], unpack(active))
  local still = {}
  for j = 1, #active do
    local v = vals[j]
    if v then
      local pod = active[j]
      local s = suffix[pod]
      if #v > #s and string.sub(v, -#s) == s then
        local c = codes[pod]
        c[#c + 1] = string.sub(v, 1, 1)
        still[#still + 1] = pod
      end
    end
  end
  active = still
end
local out = {}
for _, pod in ipairs(live) do
  out[#out + 1] = pod
  out[#out + 1] = table.concat(codes[pod])
end
return out
"""

# ARGV[1]: the namespace base. Reply: [[pod, lease epoch, lease pttl, [pod hash flat]], ...].
LIVE_PODS_LUA = """
local base = ARGV[1]
local out = {}
for _, pod in ipairs(redis.call('SMEMBERS', base .. 'pods')) do
  local lease = base .. 'l:' .. pod
  local epoch = redis.call('GET', lease)
  if epoch then
    out[#out + 1] = {pod, epoch, redis.call('PTTL', lease), redis.call('HGETALL', base .. 'p:' .. pod)}
  end
end
return out
"""


# ARGV[1]: the namespace base. Reply: flat [pod, registered epoch or ""] for every pod id in
# the pods set whose lease is gone: crashed or cut off, or mid-restart.
DEAD_PODS_LUA = """
local base = ARGV[1]
local out = {}
for _, pod in ipairs(redis.call('SMEMBERS', base .. 'pods')) do
  if redis.call('EXISTS', base .. 'l:' .. pod) == 0 then
    out[#out + 1] = pod
    out[#out + 1] = redis.call('HGET', base .. 'p:' .. pod, 'epoch') or ''
  end
end
return out
"""

# ARGV: base, pod, the epoch seen dead ("" = no registration), batch size. Removes up to
# `batch` of the pod's claims, but only while the pod id is still lease-less under that same
# epoch: a restarted instance (new lease and epoch, written in one MULTI) is left alone.
# Reply: -1 refused (it came back), else {claims removed, 1 when nothing of it is left}.
REAP_POD_LUA = """
local base, pod, epoch, n = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4])
if redis.call('EXISTS', base .. 'l:' .. pod) == 1 then return -1 end
if (redis.call('HGET', base .. 'p:' .. pod, 'epoch') or '') ~= epoch then return -1 end
local set = base .. 'pb:' .. pod
local members = redis.call('SPOP', set, n)
local removed = 0
for _, h in ipairs(members) do
  removed = removed + redis.call('HDEL', base .. 'b:' .. h, pod)
end
if #members < n then
  redis.call('DEL', base .. 'p:' .. pod, set)
  redis.call('SREM', base .. 'pods', pod)
  return {removed, 1}
end
return {removed, 0}
"""

# KEYS[1] lease, KEYS[2] pod hash. ARGV[1] epoch, ARGV[2] ttl ms, ARGV[3..] field/value pairs.
# Returns 1 renewed, 0 registration gone (the caller must re-register and republish),
# -1 another instance of this pod id took over (the caller must stop publishing).
RENEW_LEASE_LUA = """
local owner = redis.call('HGET', KEYS[2], 'epoch')
if not owner then return 0 end
if owner ~= ARGV[1] then return -1 end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
if #ARGV > 2 then redis.call('HSET', KEYS[2], unpack(ARGV, 3)) end
return 1
"""


@dataclass(slots=True)
class Script:
    """A Lua script run by EVALSHA; loaded with SCRIPT LOAD only when the server lacks it
    (a restarted or flushed Redis), so a call stays one round trip."""

    source: str
    sha: str = ""

    def __post_init__(self) -> None:
        self.sha = hashlib.sha1(self.source.encode()).hexdigest()

    def run(self, client: Any, keys: Sequence[str], args: Sequence[Any]) -> Any:
        """On a `redis.Redis` client."""
        try:
            return client.evalsha(self.sha, len(keys), *keys, *args)
        except NoScriptError:
            client.script_load(self.source)
            return client.evalsha(self.sha, len(keys), *keys, *args)

    async def run_async(self, client: Any, keys: Sequence[str], args: Sequence[Any]) -> Any:
        """On a `redis.asyncio` client."""
        try:
            return await client.evalsha(self.sha, len(keys), *keys, *args)
        except NoScriptError:
            await client.script_load(self.source)
            return await client.evalsha(self.sha, len(keys), *keys, *args)


LOOKUP = Script(LOOKUP_LUA)
LIVE_PODS = Script(LIVE_PODS_LUA)
DEAD_PODS = Script(DEAD_PODS_LUA)
REAP_POD = Script(REAP_POD_LUA)
RENEW_LEASE = Script(RENEW_LEASE_LUA)

# Loaded up front by a router, so that even its first lookup is one round trip.
PRELOADED: tuple[Script, ...] = (LOOKUP, LIVE_PODS)


def register_scripts(redis_client: Any) -> None:
    """SCRIPT LOAD the PRELOADED scripts on a `redis.Redis` client."""
    for script in PRELOADED:
        redis_client.script_load(script.source)
