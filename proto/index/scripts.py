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

# KEYS[1]: the chain's bucket's claims HASH (it routes the call to the chain's shard).
# ARGV[1]: the bucket's key base; ARGV[2]: the chain's claim fields (schema.claim_field,
# FIELD_BYTES each), concatenated; ARGV[3]: "1" to read the routers' burst predictions too,
# with ARGV[4] the chain's hashes in hex, concatenated (each prediction key is ARGV[1] ..
# 'r:' .. one of them: the same slot).
# A field's value is its holders' claims, CLAIM_ENTRY_BYTES each: a claim id, then a byte,
# the tier mask. The script knows no pods: it names holders by claim id (4 raw bytes) and
# the router maps them to its live pods (queries.LivePods), dropping the ids of no live
# registration (a dead or restarted pod's, garbage until reaped): no argument grows with
# the fleet, and nothing is searched per pod.
# Reply: flat [wrong-type keys, bad prediction entries, bad claim values, then claim id, tier
# codes, predicted depth, ...] for the claim ids that hold or are predicted to hold a prefix
# (absent: neither); the code string's length is the depth, '?' a mask no pod writes (the
# parser ends the prefix there). Garbage anyone may have written (a key of another type, a
# non-numeric expiry, a value that is not whole entries) is skipped and counted in the first
# three, never an error: one bad key must not fail the lookup.
# Block 0's holders are the only candidates. The fields are read CHUNK at a time (one HMGET
# each) and the walk ends as soon as no holder is left. Consecutive blocks of a chain mostly
# carry the identical value (same holders, same tiers), and Lua compares strings in O(1)
# (interned): a run of equal values is counted, and only where the value changes is each
# remaining holder looked up in it (its code for the run so far appended with string.rep), so
# the walk costs O(holders x distinct values), not O(holders x blocks).
# Predictions extend a holder's claimed prefix: blocks 1..c held (c claims), then a run of
# predictions from block c + 1 that have not expired (Redis's clock) gives depth c + run,
# reported only where it adds to c. A prediction key maps claim ids to expiries and holds few
# (the writer caps it): a block's are read whole, and only for blocks where some holder's
# claims end or its predictions continue.
LOOKUP_LUA = """
local base, fields, want, hexes = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local FW, EW, CHUNK = 8, 5, 32
local n = #fields / FW
local CODE = {'G', 'C', 'G', 'D', 'G', 'C', 'G'}
local holders, code, parts = {}, {}, {}
local bad_type, bad_pred, bad_claim = 0, 0, 0
local vals, loaded = {}, 0
local function value(i)
  if i > loaded then
    local names = {}
    for k = loaded + 1, math.min(n, loaded + CHUNK) do
      names[#names + 1] = string.sub(fields, (k - 1) * FW + 1, k * FW)
    end
    local got = redis.pcall('HMGET', KEYS[1], unpack(names))
    if got.err then bad_type = 1; n = 0; return nil end
    for k = 1, #names do vals[loaded + k] = got[k] end
    loaded = loaded + #names
  end
  local v = vals[i]
  if v and (#v == 0 or #v % EW ~= 0) then bad_claim = bad_claim + 1; return nil end
  return v
end
local active = {}
local prev = n > 0 and value(1)
if prev then
  for e = 1, #prev, EW do
    local cid = string.sub(prev, e, e + EW - 2)
    if not code[cid] then
      local c = CODE[string.byte(prev, e + EW - 1)] or '?'
      code[cid] = c
      holders[#holders + 1] = cid
      if c == '?' then parts[cid] = {'?'} else parts[cid] = {}; active[#active + 1] = cid end
    end
  end
end
local run = 1
for i = 2, n do
  if #active == 0 then break end
  local v = value(i)
  if not v then break end
  if v == prev then
    run = run + 1
  else
    local still = {}
    for _, cid in ipairs(active) do
      local pc = parts[cid]
      pc[#pc + 1] = string.rep(code[cid], run)
      local p = string.find(v, cid, 1, true)
      while p and (p - 1) % EW ~= 0 do p = string.find(v, cid, p + 1, true) end
      if p then
        local c = CODE[string.byte(v, p + EW - 1)] or '?'
        if c == '?' then pc[#pc + 1] = '?' else code[cid] = c; still[#still + 1] = cid end
      end
    end
    active, prev, run = still, v, 1
  end
end
for _, cid in ipairs(active) do
  local pc = parts[cid]
  pc[#pc + 1] = string.rep(code[cid], run)
end
local codes, depth = {}, {}
for _, cid in ipairs(holders) do
  local s = table.concat(parts[cid])
  codes[cid], depth[cid] = s, #s
end
local pred = {}
if want == '1' then
  local w = #hexes / (#fields / FW)
  n = #fields / FW
  local t = redis.call('TIME')
  local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  local ends, maxc = {}, 0
  for _, cid in ipairs(holders) do
    local d = depth[cid]
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
        local cid = entries[j]
        local expiry = tonumber(entries[j + 1])
        if not expiry then
          bad_pred = bad_pred + 1
        elseif expiry > now and (cur[cid] or (depth[cid] or 0) == i - 1) then
          nxt[cid] = true
          m = m + 1
          pred[cid] = i
        end
      end
      cur, ncur = nxt, m
    end
  end
end
local out = {bad_type, bad_pred, bad_claim}
for _, cid in ipairs(holders) do
  out[#out + 1] = cid
  out[#out + 1] = codes[cid]
  out[#out + 1] = pred[cid] or 0
  pred[cid] = nil
end
for cid, d in pairs(pred) do
  out[#out + 1] = cid
  out[#out + 1] = ''
  out[#out + 1] = d
end
return out
"""

# KEYS: the burst-prediction keys of consecutive blocks of one chain (one bucket). ARGV: the
# pod's claim id (its registration's, 4 raw bytes: what the lookup names holders by), TTL ms,
# the most pods one key keeps. Each key maps the claim id to now + TTL (Redis's clock, shared
# by every router) and expires TTL after its last write. A key over the cap drops its
# expired entries, then its oldest: the cost of a write stays bounded however many pods one
# hot block is sent to. A key of another type is left alone (not written), an entry whose
# expiry is not a number is dropped. Reply: the number of keys written.
PREDICT_LUA = """
local cid, ttl, cap = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local expiry = string.format('%d', now + ttl)
local written = 0
for i = 1, #KEYS do
  local key = KEYS[i]
  local added = redis.pcall('HSET', key, cid, expiry)
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
# cluster each call holds one bucket). KEYS: each bucket's claims HASH, in order. ARGV[1]:
# the pod's claim id, then per bucket its records: one byte, the new tier mask (0: no
# claim), and the block's claim field (FIELD_BYTES), each. A record rewrites the claim id's
# entry in the field's packed value (read, modify, write: atomic, the script runs alone):
# the mask byte replaced, the entry appended, or removed (the field deleted with its last
# entry). A value that is not whole entries (garbage) is overwritten; a claims key of another
# type is left alone. Reply: the number of records.
CLAIM_WRITES_LUA = """
local cid = ARGV[1]
local FW, EW = 8, 5
local n = 0
for g = 1, #KEYS do
  local key, recs = KEYS[g], ARGV[1 + g]
  for i = 1, #recs, FW + 1 do
    local m = string.byte(recs, i)
    local f = string.sub(recs, i + 1, i + FW)
    local v = redis.pcall('HGET', key, f)
    if type(v) == 'table' and v.err then break end
    if not v or #v % EW ~= 0 then v = '' end
    local out = nil
    for e = 1, #v, EW do
      if string.sub(v, e, e + EW - 2) == cid then
        if m == 0 then
          out = string.sub(v, 1, e - 1) .. string.sub(v, e + EW)
        else
          out = string.sub(v, 1, e + EW - 2) .. string.char(m) .. string.sub(v, e + EW)
        end
        break
      end
    end
    if not out then out = m == 0 and v or v .. cid .. string.char(m) end
    if out == '' then
      redis.call('HDEL', key, f)
    else
      redis.call('HSET', key, f, out)
    end
    n = n + 1
  end
end
return n
"""

# KEYS[1]: one bucket's claims HASH. ARGV: the HSCAN cursor, the fields per call, the claim
# ids to strip (packed, CLAIM_ID_BYTES each), "1" to remove their claims ("": count them),
# and optionally a claim id whose remaining claims are counted too. Reply: {next cursor
# ("0": done), claims of the stripped ids seen, claims of the counted id seen}. One call
# reads one HSCAN page: a bucket is cleaned in bounded steps, never one long script. A key of
# another type has nothing of ours; a value that is not whole entries is left alone.
STRIP_LUA = """
local r = redis.pcall('HSCAN', KEYS[1], ARGV[1], 'COUNT', ARGV[2])
if r.err then return {'0', 0, 0} end
local EW, gone, strip, keep_id = 5, {}, ARGV[3], ARGV[5] or ''
for j = 1, #strip, EW - 1 do gone[string.sub(strip, j, j + EW - 2)] = true end
local hits, kept = 0, 0
local flat = r[2]
for j = 1, #flat, 2 do
  local f, v = flat[j], flat[j + 1]
  if #v % EW == 0 then
    local keep, k = {}, 0
    for e = 1, #v, EW do
      local cid = string.sub(v, e, e + EW - 2)
      if gone[cid] then
        k = k + 1
      else
        keep[#keep + 1] = string.sub(v, e, e + EW - 1)
        if cid == keep_id then kept = kept + 1 end
      end
    end
    if k > 0 then
      hits = hits + k
      if ARGV[4] == '1' then
        if #keep == 0 then
          redis.call('HDEL', KEYS[1], f)
        else
          redis.call('HSET', KEYS[1], f, table.concat(keep))
        end
      end
    end
  end
end
return {r[1], hits, kept}
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

# Registering a pod instance, in the control slot. KEYS[1]: pods SET. ARGV: base, pod,
# epoch, claim id (hex), lease ms, the instance's previous claim id ("": none), then the pod
# HASH's other field/value pairs. A claim id already in the namespace's claim ids (any
# pod's, this one's retired ones included: their claims may remain) is refused (reply 0:
# pick another); else it is taken, added to the pod's claim ids, and the pod HASH, lease and
# pods entry are written (reply 1), all at once: a reader never sees a lease without its
# registration, nor a claim id that is not reserved. The previous claim id is listed again
# (a wipe or a failover of the control keys may have lost it while its claims, on other
# shards, remain) unless another pod holds it, so that it is stripped like any retired one.
REGISTER_LUA = """
local base, pod, epoch, cid, ttl, prev = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6]
if redis.call('HSETNX', base .. 'cids', cid, pod) == 0 then return 0 end
redis.call('SADD', base .. 'pc:' .. pod, cid)
if prev ~= '' then
  redis.call('HSETNX', base .. 'cids', prev, pod)
  if redis.call('HGET', base .. 'cids', prev) == pod then
    redis.call('SADD', base .. 'pc:' .. pod, prev)
  end
end
local key = base .. 'p:' .. pod
redis.call('DEL', key)
redis.call('HSET', key, 'epoch', epoch, 'claim', cid, unpack(ARGV, 7))
redis.call('SET', base .. 'l:' .. pod, epoch, 'PX', ttl)
redis.call('SADD', KEYS[1], pod)
return 1
"""

# Reaping a dead pod takes three kinds of call, because its claims sit in many slots:
# REAP_START and REAP_FINISH in the control slot check that the pod id is still lease-less
# under the epoch seen dead; STRIP, in each bucket's slot, removes the claims of the claim
# ids REAP_START listed (all of the pod's: a dead instance writes nothing more). A pod id
# that restarts in between registers a new claim id, which no strip touches, and several
# routers reaping at once cannot conflict.

# KEYS[1]: pods SET. ARGV: base, pod, the epoch seen dead ("" = no registration).
# Reply: -1 refused (it came back), else {the pod's bucket list, its claim ids (hex)}; a
# bucket list or claim id set of another type reads as empty (REAP_FINISH deletes it).
REAP_START_LUA = """
local base, pod, epoch = ARGV[1], ARGV[2], ARGV[3]
if redis.call('EXISTS', base .. 'l:' .. pod) == 1 then return -1 end
if (redis.call('HGET', base .. 'p:' .. pod, 'epoch') or '') ~= epoch then return -1 end
local buckets = redis.pcall('SMEMBERS', base .. 'pbk:' .. pod)
if buckets.err then buckets = {} end
local cids = redis.pcall('SMEMBERS', base .. 'pc:' .. pod)
if cids.err then cids = {} end
return {buckets, cids}
"""

# KEYS[1]: pods SET. ARGV: base, pod, dead epoch, then the claim ids (hex) stripped. Those
# leave the namespace's claim ids and the pod's (their claims are gone). Reply: -1 when the
# pod id came back meanwhile (its registration stays), else 1 (its HASH, bucket list, claim
# ids and pods entry removed).
REAP_FINISH_LUA = """
local base, pod, epoch = ARGV[1], ARGV[2], ARGV[3]
for i = 4, #ARGV do
  if redis.call('HGET', base .. 'cids', ARGV[i]) == pod then
    redis.call('HDEL', base .. 'cids', ARGV[i])
  end
  redis.pcall('SREM', base .. 'pc:' .. pod, ARGV[i])
end
if redis.call('EXISTS', base .. 'l:' .. pod) == 1 then return -1 end
if (redis.call('HGET', base .. 'p:' .. pod, 'epoch') or '') ~= epoch then return -1 end
redis.call('DEL', base .. 'p:' .. pod, base .. 'pbk:' .. pod, base .. 'pc:' .. pod)
redis.call('SREM', KEYS[1], pod)
return 1
"""

# KEYS[1]: pods SET. ARGV: base, pod, then claim ids (hex) whose claims are stripped: they
# leave the pod's claim ids and the namespace's (a retired id's, or a clean stop's).
RELEASE_CLAIM_IDS_LUA = """
local base, pod = ARGV[1], ARGV[2]
for i = 3, #ARGV do
  if redis.call('HGET', base .. 'cids', ARGV[i]) == pod then
    redis.call('HDEL', base .. 'cids', ARGV[i])
  end
  redis.call('SREM', base .. 'pc:' .. pod, ARGV[i])
end
return #ARGV - 2
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
REGISTER = Script(REGISTER_LUA)
REAP_START = Script(REAP_START_LUA)
STRIP = Script(STRIP_LUA)
REAP_FINISH = Script(REAP_FINISH_LUA)
RELEASE_CLAIM_IDS = Script(RELEASE_CLAIM_IDS_LUA)
RENEW_LEASE = Script(RENEW_LEASE_LUA)
CLAIM_WRITES = Script(CLAIM_WRITES_LUA)

# Loaded up front by a router, so that even its first lookup is one round trip.
PRELOADED: tuple[Script, ...] = (LOOKUP, LIVE_PODS, PREDICT)


def register_scripts(redis_client: Any) -> None:
    """SCRIPT LOAD the PRELOADED scripts on a synchronous client (a cluster client loads
    them on every primary)."""
    for script in PRELOADED:
        redis_client.script_load(script.source)
