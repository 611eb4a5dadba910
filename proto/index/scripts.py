"""The index's Lua scripts, and the runner that sends each as one EVALSHA.

Every script declares at least one key, so that a cluster client sends it to the shard
that holds that key's slot; a script that names further keys itself (from the namespace base,
`IndexSchema.base`, in ARGV) names only keys of that same hash tag, so one script serves
every namespace and every key it touches is local. See docs/INDEX.md for what each does.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from redis.exceptions import NoScriptError

# KEYS[1]: block 0's claim key (it routes the call to the chain's shard). ARGV[1]: the
# bucket's key base; ARGV[2]: the chain's hashes in hex, concatenated (every key this script
# reads is ARGV[1] .. 'b:' or 'r:' .. one of them: the same slot); ARGV[3]: the pods the
# caller believes live, packed as "\0pod\1epoch\0pod\1epoch\0" (the router's registry: the
# leases live in the control slot, which this script cannot read on a cluster); ARGV[4]:
# "1" to read the routers' burst predictions too.
# Reply: flat [wrong-type keys, bad prediction entries, bad claim values, then pod, tier
# codes, predicted depth, ...] for the live pods that hold or are predicted to hold a prefix
# (absent: neither); the code string's length is the pod's depth. Garbage anyone may have
# written (a key of another type, a non-numeric expiry, a claim without its ':') is skipped
# and counted in the first three, never an error: one bad key must not fail the lookup.
# Block 0 is read whole: its claimants are the only candidates, so the work grows with the
# pods that hold the chain, not with the pods passed. A claim counts only under the epoch
# passed for its pod. Only pods still matching are asked about the next block, and the walk
# ends as soon as none is left.
# Predictions extend a pod's claimed prefix: blocks 1..c held (c claims), then a run of
# predictions from block c + 1 that have not expired (Redis's clock) gives depth c + run,
# reported only where it adds to c. Each prediction key holds few pods (the writer caps it):
# a block's are read whole, and only for blocks where some pod's claims end or its
# predictions continue.
LOOKUP_LUA = """
local base, hexes, live, want = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local w = #KEYS[1] - #base - 2
local n = #hexes / w
local codes, suffix, holders = {}, {}, {}
local bad_type, bad_pred, bad_claim = 0, 0, 0
local flat = redis.pcall('HGETALL', KEYS[1])
if flat.err then bad_type, flat = 1, {} end
for j = 1, #flat, 2 do
  local pod, v = flat[j], flat[j + 1]
  local k = string.find(v, ':', 1, true)
  if not k or k == 1 then
    bad_claim = bad_claim + 1
  else
    local epoch = string.sub(v, k + 1)
    if string.find(live, '\\0' .. pod .. '\\1' .. epoch .. '\\0', 1, true) then
      codes[pod] = {string.sub(v, 1, 1)}
      suffix[pod] = ':' .. epoch
      holders[#holders + 1] = pod
    end
  end
end
local active = holders
for i = 2, n do
  if #active == 0 then break end
  local key = base .. 'b:' .. string.sub(hexes, (i - 1) * w + 1, i * w)
  local vals = redis.pcall('HMGET', key, unpack(active))
  if vals.err then bad_type = bad_type + 1; break end
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
local pred = {}
if want == '1' then
  local t = redis.call('TIME')
  local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  local ends, maxc = {}, 0
  for _, pod in ipairs(holders) do
    local d = #codes[pod]
    ends[d] = true
    if d > maxc then maxc = d end
  end
  local cur, ncur = {}, 0
  for i = 1, n do
    if ncur == 0 and i > maxc + 1 then break end
    if ncur > 0 or i == 1 or ends[i - 1] then
      local key = base .. 'r:' .. string.sub(hexes, (i - 1) * w + 1, i * w)
      local entries = redis.pcall('HGETALL', key)
      if entries.err then bad_type, entries = bad_type + 1, {} end
      local nxt, m = {}, 0
      for j = 1, #entries, 2 do
        local pod = entries[j]
        local expiry = tonumber(entries[j + 1])
        if not expiry then
          bad_pred = bad_pred + 1
        elseif expiry > now then
          local c = codes[pod]
          local d = c and #c or 0
          if cur[pod] or (d == i - 1 and
              (c or string.find(live, '\\0' .. pod .. '\\1', 1, true))) then
            nxt[pod] = true
            m = m + 1
            pred[pod] = i
          end
        end
      end
      cur, ncur = nxt, m
    end
  end
end
local out = {bad_type, bad_pred, bad_claim}
for _, pod in ipairs(holders) do
  out[#out + 1] = pod
  out[#out + 1] = table.concat(codes[pod])
  out[#out + 1] = pred[pod] or 0
  pred[pod] = nil
end
for pod, d in pairs(pred) do
  out[#out + 1] = pod
  out[#out + 1] = ''
  out[#out + 1] = d
end
return out
"""

# KEYS: the burst-prediction keys of consecutive blocks of one chain (one bucket). ARGV: pod,
# TTL ms, the most pods one key keeps. Each key maps the pod to now + TTL (Redis's clock,
# shared by every router) and expires TTL after its last write. A key over the cap drops its
# expired entries, then its oldest: the cost of a write stays bounded however many pods one
# hot block is sent to. A key of another type is left alone (not written), an entry whose
# expiry is not a number is dropped. Reply: the number of keys written.
PREDICT_LUA = """
local pod, ttl, cap = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local expiry = string.format('%d', now + ttl)
local written = 0
for i = 1, #KEYS do
  local key = KEYS[i]
  local added = redis.pcall('HSET', key, pod, expiry)
  if type(added) == 'number' then
    written = written + 1
  end
  if added == 1 and redis.call('HLEN', key) > cap then
    local flat = redis.call('HGETALL', key)
    local keep = {}
    for j = 1, #flat, 2 do
      local e = tonumber(flat[j + 1])
      if not e or e <= now then
        redis.call('HDEL', key, flat[j])
      else
        keep[#keep + 1] = {flat[j], e}
      end
    end
    if #keep > cap then
      table.sort(keep, function(a, b) return a[2] < b[2] end)
      for j = 1, #keep - cap do redis.call('HDEL', key, keep[j][1]) end
    end
  end
  if type(added) == 'number' then redis.call('PEXPIRE', key, ttl) end
end
return written
"""

# A pod's claim writes in one bucket or several (several only on a single node: on a
# cluster each call holds one bucket). KEYS: the pod's claim SET of each bucket, in order.
# ARGV[1] pod, ARGV[2] hex hash width, ARGV[3] the number of tier masks, ARGV[4..] the claim
# value of each mask from 1 (schema.claim_values), then per bucket its key base and its
# records: one char, the new mask in base 36 ('0': no claim), and the hash in hex, each.
# A claim is HSET into its block key and its hash added to the SET (SADD is idempotent: a
# tier change re-adds it); '0' is HDEL and SREM. Reply: the number of records.
CLAIM_WRITES_LUA = """
local pod, w, nv = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local vals = {}
for m = 1, nv do vals[m] = ARGV[3 + m] end
local n = 0
for g = 1, #KEYS do
  local set, base, recs = KEYS[g], ARGV[2 + nv + 2 * g], ARGV[3 + nv + 2 * g]
  for i = 1, #recs, w + 1 do
    local m = tonumber(string.sub(recs, i, i), 36)
    local hex = string.sub(recs, i + 1, i + w)
    if m == 0 then
      redis.call('HDEL', base .. 'b:' .. hex, pod)
      redis.call('SREM', set, hex)
    else
      redis.call('HSET', base .. 'b:' .. hex, pod, vals[m])
      redis.call('SADD', set, hex)
    end
    n = n + 1
  end
end
return n
"""

# The control scripts below take the namespace's pods SET as KEYS[1] (so a cluster client
# sends them to the control slot's shard) and name the other control keys, all under the
# same `{ns}` tag, from ARGV[1], the namespace base.

# KEYS[1]: pods SET. ARGV[1]: the namespace base.
# Reply: [wrong-type keys skipped, [pod, lease epoch, lease pttl, [pod hash flat]], ...]: a
# pods SET, lease or pod HASH of another type (anyone's garbage) skips that pod, not all.
LIVE_PODS_LUA = """
local base = ARGV[1]
local out = {0}
local members = redis.pcall('SMEMBERS', KEYS[1])
if members.err then return {1} end
for _, pod in ipairs(members) do
  local lease = base .. 'l:' .. pod
  local epoch = redis.pcall('GET', lease)
  local fields = epoch and not epoch.err and redis.pcall('HGETALL', base .. 'p:' .. pod)
  if epoch and (epoch.err or fields.err) then
    out[1] = out[1] + 1
  elseif epoch then
    out[#out + 1] = {pod, epoch, redis.call('PTTL', lease), fields}
  end
end
return out
"""

# KEYS[1]: pods SET. ARGV[1]: the namespace base. Reply: flat [pod, registered epoch or ""]
# for every pod id in the pods set whose lease is gone: crashed or cut off, or mid-restart.
# A pods SET or pod HASH of another type is skipped (not reaped: it is not ours to read).
DEAD_PODS_LUA = """
local base = ARGV[1]
local out = {}
local members = redis.pcall('SMEMBERS', KEYS[1])
if members.err then return out end
for _, pod in ipairs(members) do
  if redis.call('EXISTS', base .. 'l:' .. pod) == 0 then
    local epoch = redis.pcall('HGET', base .. 'p:' .. pod, 'epoch')
    if type(epoch) ~= 'table' or not epoch.err then
      out[#out + 1] = pod
      out[#out + 1] = epoch or ''
    end
  end
end
return out
"""

# Reaping a dead pod takes three scripts, because its claims sit in many slots: REAP_START
# and REAP_FINISH in the control slot check that the pod id is still lease-less under the
# epoch seen dead; REAP_BUCKET, in each bucket's slot, removes only that epoch's claims. A
# pod id that restarts in between (new lease and epoch, written in one MULTI) has its new
# claims left alone, and several routers reaping at once cannot conflict.

# KEYS[1]: pods SET. ARGV: base, pod, the epoch seen dead ("" = no registration).
# Reply: -1 refused (it came back), else the pod's bucket list (bucket names; none when
# the list is a key of another type: REAP_FINISH deletes it).
REAP_START_LUA = """
local base, pod, epoch = ARGV[1], ARGV[2], ARGV[3]
if redis.call('EXISTS', base .. 'l:' .. pod) == 1 then return -1 end
if (redis.call('HGET', base .. 'p:' .. pod, 'epoch') or '') ~= epoch then return -1 end
local buckets = redis.pcall('SMEMBERS', base .. 'pbk:' .. pod)
if buckets.err then return {} end
return buckets
"""

# KEYS[1]: the pod's claim set in one bucket. ARGV: the bucket base, pod, dead epoch ("":
# any), batch size. Removes up to `batch` claims of the dead epoch. A claim of another epoch
# means the pod id is back: its member is put back and the reap refused. A claim set or
# block key of another type (garbage) is passed over.
# Reply: -1 refused, else {claims removed, 1 when the set is empty}.
REAP_BUCKET_LUA = """
local base, pod, epoch, n = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4])
local suffix = ':' .. epoch
local members = redis.pcall('SPOP', KEYS[1], n)
if members.err then return {0, 1} end
local removed = 0
for i, h in ipairs(members) do
  local key = base .. 'b:' .. h
  local v = redis.pcall('HGET', key, pod)
  if type(v) == 'string' then
    if epoch ~= '' and string.sub(v, -#suffix) ~= suffix then
      redis.call('SADD', KEYS[1], unpack(members, i))
      return -1
    end
    removed = removed + redis.call('HDEL', key, pod)
  end
end
return {removed, #members < n and 1 or 0}
"""

# KEYS[1]: pods SET. ARGV: base, pod, dead epoch. Reply: -1 refused (it came back), else 1
# (its HASH, bucket list and pods entry removed).
REAP_FINISH_LUA = """
local base, pod, epoch = ARGV[1], ARGV[2], ARGV[3]
if redis.call('EXISTS', base .. 'l:' .. pod) == 1 then return -1 end
if (redis.call('HGET', base .. 'p:' .. pod, 'epoch') or '') ~= epoch then return -1 end
redis.call('DEL', base .. 'p:' .. pod, base .. 'pbk:' .. pod)
redis.call('SREM', KEYS[1], pod)
return 1
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
PREDICT = Script(PREDICT_LUA)
LIVE_PODS = Script(LIVE_PODS_LUA)
DEAD_PODS = Script(DEAD_PODS_LUA)
REAP_START = Script(REAP_START_LUA)
REAP_BUCKET = Script(REAP_BUCKET_LUA)
REAP_FINISH = Script(REAP_FINISH_LUA)
RENEW_LEASE = Script(RENEW_LEASE_LUA)
CLAIM_WRITES = Script(CLAIM_WRITES_LUA)

# Loaded up front by a router, so that even its first lookup is one round trip.
PRELOADED: tuple[Script, ...] = (LOOKUP, LIVE_PODS, PREDICT)


def register_scripts(redis_client: Any) -> None:
    """SCRIPT LOAD the PRELOADED scripts on a synchronous client (a cluster client loads
    them on every primary)."""
    for script in PRELOADED:
        redis_client.script_load(script.source)
