"""The Redis backend's Lua scripts: every state change that must be atomic is one script.

Keys of one provider (``{prefix}:{provider}:...``), always passed in this order:

====  ========  =============================================================
 1    cfg       hash: limit, configured_limit, auto_reduced_from, notice,
                cooldown_ms, configured_cooldown_ms, paused_until,
                last_reduction_at, last_backoff_at, recovering_notice
                (a template from the policy), recovery_ms, created_at,
                settle_until, and the policy's counters (granted, ...)
 2    leases    zset: lease id (= the waiter id it was granted to) -> expiry
                (ms); renewed by the holder
 3    cooling   zset: released lease id -> end of its release cooldown (ms)
 4    waiters   zset, all scores 0, ordered by member:
                ``{0 starred|1}{prompt ms:014}{arrival:012}:{waiter id}``
 5    winfo     hash: waiter id -> JSON (member, replica, workspace, ...)
 6    whb       zset: waiter id -> heartbeat expiry (ms)
 7    granted   hash: waiter id -> "lease granted_at" until its replica picks it up
 8    seq       counter for arrival numbers
 9    stars     set of starred workspaces (shared by all providers)
====  ========  =============================================================

The rules are the policy's (:mod:`proxy.limiter.policy`). What it decides reaches
the scripts as arguments or settings fields: notice templates (auto-reduced,
recovering), the pause length, the listing length, the counters' names. What
must happen inside one atomic script is written here again: admission (limit,
pause, settle), the same-burst test, one reduction step, one recovery step, the
queue member's order; ``tests/backends/test_policy_vs_lua.py`` runs the same
event sequences through both and compares every status field.

All times come from Redis's own ``TIME``, so replicas with skewed clocks agree.
Grants are published on ``{prefix}:grant:{replica}`` as "waiter lease granted_at".

Nothing is granted for a provider whose ``cfg`` has no ``configured_limit``: that
is a Redis that lost its data (restarted empty, flushed, failed over). ENQUEUE then
answers -2 and RENEW reports it, and the replica runs CONFIGURE again. A CONFIGURE
that re-creates the provider may hold grants back until ``settle_until``, so every
replica's RENEW can first put back the leases it still holds (a lease granted
before ``created_at`` was lost with the data, not expired).
"""

from __future__ import annotations

__all__ = ["BACKOFF", "CANCEL", "CONFIGURE", "DISPATCH", "ENQUEUE", "RELEASE", "RENEW", "RESTAR", "SET_COOLDOWN",
           "SET_LIMIT", "STATS"]

_PRELUDE = r"""
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

local function num(field, default)
  local v = redis.call('HGET', KEYS[1], field)
  if v == false or v == '' then return default end
  return tonumber(v)
end

local function limit_of()
  local v = redis.call('HGET', KEYS[1], 'limit')
  if v == false or v == '' or v == 'none' then return nil end
  return tonumber(v)
end

local function recover(now)
  local from = num('auto_reduced_from', nil)
  local every = num('recovery_ms', 0)
  local limit = limit_of()
  if from == nil or every <= 0 or limit == nil then return end
  if now - num('last_backoff_at', now) < every then return end
  limit = math.min(from, limit + 1)
  redis.call('HSET', KEYS[1], 'limit', limit, 'last_backoff_at', now)
  if limit >= from then
    redis.call('HDEL', KEYS[1], 'auto_reduced_from', 'notice')
  else
    local template = redis.call('HGET', KEYS[1], 'recovering_notice') or ''
    local notice = string.gsub(string.gsub(template, '{N}', tostring(limit)), '{TARGET}', tostring(from))
    redis.call('HSET', KEYS[1], 'notice', notice)
  end
end

-- Take a waiter out: its queue entry, its info and its heartbeat (a no-op for one already gone).
local function forget_waiter(id)
  local info = redis.call('HGET', KEYS[5], id)
  if info then redis.call('ZREM', KEYS[4], cjson.decode(info).m) end
  redis.call('HDEL', KEYS[5], id)
  redis.call('ZREM', KEYS[6], id)
end

local function cleanup(now)
  redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
  redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now)
  for _, id in ipairs(redis.call('ZRANGEBYSCORE', KEYS[6], '-inf', now)) do
    forget_waiter(id)
  end
  recover(now)
end

local function configured()
  return redis.call('HEXISTS', KEYS[1], 'configured_limit') == 1
end

local function in_flight()
  return redis.call('ZCARD', KEYS[2]) + redis.call('ZCARD', KEYS[3])
end

-- The head waiter's info, or nil for an orphan entry (no info, or a stale member), which is dropped.
local function pop_head()
  local head = redis.call('ZRANGE', KEYS[4], 0, 0)
  if #head == 0 then return nil, nil, false end
  local member = head[1]
  redis.call('ZREM', KEYS[4], member)
  local id = string.sub(member, string.find(member, ':', 1, true) + 1)
  local raw = redis.call('HGET', KEYS[5], id)
  if not raw then return id, nil, true end
  local info = cjson.decode(raw)
  if info.m ~= member then return id, nil, true end
  redis.call('HDEL', KEYS[5], id)
  redis.call('ZREM', KEYS[6], id)
  return id, info, true
end

-- Grant head waiters while there is room; each grant becomes a lease and a message to its replica.
local function dispatch(now, lease_ttl, channel)
  if not configured() or num('settle_until', 0) > now then return 0 end
  if num('paused_until', 0) > now then return 0 end
  local limit = limit_of()
  local count = 0
  while limit == nil or in_flight() < limit do
    local id, info, found = pop_head()
    if not found then break end
    if info then
      redis.call('ZADD', KEYS[2], now + lease_ttl, id)
      redis.call('HSET', KEYS[7], id, id .. ' ' .. now)
      redis.call('HINCRBY', KEYS[1], 'granted', 1)
      redis.call('PUBLISH', channel .. info.r, id .. ' ' .. id .. ' ' .. now)
      count = count + 1
    end
  end
  return count
end

-- When something time-based next changes the room: the end of a pause, a cooldown or a lease.
local function next_event(now)
  local best = 0
  local function consider(t)
    if t and t > now and (best == 0 or t < best) then best = t end
  end
  consider(num('paused_until', 0))
  consider(num('settle_until', 0))
  local c = redis.call('ZRANGE', KEYS[3], 0, 0, 'WITHSCORES')
  if #c > 0 then consider(tonumber(c[2])) end
  local l = redis.call('ZRANGE', KEYS[2], 0, 0, 'WITHSCORES')
  if #l > 0 then consider(tonumber(l[2])) end
  return best
end

local function waiter_member(starred, prompt_ms, seq, id)
  return string.format('%d%014d%012d:%s', starred and 0 or 1, prompt_ms, seq, id)
end
"""

ENQUEUE = _PRELUDE + r"""
-- ARGV: id, replica, workspace, header_starred, prompt_ms, conversation, seq ('' = new),
--       lease_ttl, waiter_ttl, max_queue, channel
local now = now_ms()
cleanup(now)
local done = redis.call('HGET', KEYS[7], ARGV[1])
if done then
  redis.call('HDEL', KEYS[7], ARGV[1])
  return {1, done, tonumber(ARGV[7]) or 0}
end
if not configured() then return {-2, '0', tonumber(ARGV[7]) or 0} end
local old = redis.call('HGET', KEYS[5], ARGV[1])
if old then redis.call('ZREM', KEYS[4], cjson.decode(old).m) end
local seq = tonumber(ARGV[7])
if seq then
  -- a waiter put back after Redis lost its data keeps its number; later arrivals come after it
  if tonumber(redis.call('GET', KEYS[8]) or '0') < seq then redis.call('SET', KEYS[8], seq) end
else
  seq = redis.call('INCR', KEYS[8])
end
local starred = ARGV[4] == '1' or redis.call('SISMEMBER', KEYS[9], ARGV[3]) == 1
local member = waiter_member(starred, tonumber(ARGV[5]), seq, ARGV[1])
redis.call('ZADD', KEYS[4], 0, member)
redis.call('HSET', KEYS[5], ARGV[1], cjson.encode({m = member, r = ARGV[2], w = ARGV[3], s = ARGV[4],
  p = tonumber(ARGV[5]), q = seq, c = ARGV[6], t = now}))
redis.call('ZADD', KEYS[6], now + tonumber(ARGV[9]), ARGV[1])
dispatch(now, tonumber(ARGV[8]), ARGV[11])
local g = redis.call('HGET', KEYS[7], ARGV[1])
if g then
  redis.call('HDEL', KEYS[7], ARGV[1])
  return {1, g, seq}
end
if redis.call('ZCARD', KEYS[4]) > tonumber(ARGV[10]) then
  forget_waiter(ARGV[1])
  redis.call('HINCRBY', KEYS[1], 'queue_full', 1)
  return {-1, num('paused_until', 0) .. ' ' .. now, seq}
end
return {0, tostring(next_event(now)), seq}
"""

DISPATCH = _PRELUDE + r"""
-- ARGV: lease_ttl, channel
local now = now_ms()
cleanup(now)
dispatch(now, tonumber(ARGV[1]), ARGV[2])
return tostring(next_event(now))
"""

RELEASE = _PRELUDE + r"""
-- ARGV: lease, waiter id, lease_ttl, channel
local now = now_ms()
local removed = redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('HDEL', KEYS[7], ARGV[2])
local cooldown = num('cooldown_ms', 0)
if removed == 1 and cooldown > 0 then
  redis.call('ZADD', KEYS[3], now + cooldown, ARGV[1])
end
cleanup(now)
dispatch(now, tonumber(ARGV[3]), ARGV[4])
return {removed, tostring(next_event(now))}
"""

CANCEL = _PRELUDE + r"""
-- ARGV: waiter id, lease_ttl, channel, keep ('1': the waiter holds its lease under this id; leave it),
--       timed_out ('1': its queue_timeout passed: counted). Returns "paused_until now" for the Retry-After hint.
-- A waiter granted in the same instant hands its lease back.
local now = now_ms()
if ARGV[5] == '1' then redis.call('HINCRBY', KEYS[1], 'queue_timeouts', 1) end
forget_waiter(ARGV[1])
local g = redis.call('HGET', KEYS[7], ARGV[1])
if g then
  redis.call('HDEL', KEYS[7], ARGV[1])
  if ARGV[4] ~= '1' then
    redis.call('ZREM', KEYS[2], string.sub(g, 1, string.find(g, ' ', 1, true) - 1))
  end
end
cleanup(now)
dispatch(now, tonumber(ARGV[2]), ARGV[3])
return num('paused_until', 0) .. ' ' .. now
"""

RENEW = _PRELUDE + r"""
-- ARGV: lease_ttl, waiter_ttl, channel, n_leases, lease ids..., their grant times (ms)..., waiter ids...
-- Returns {missing leases, grants found for our waiters ("id lease at"), waiters lost, next event,
--          1 if the provider is configured here (0: Redis lost its data; run CONFIGURE)}.
-- A lease granted before this Redis's data was created was lost with it, not expired: it is put back.
local now = now_ms()
cleanup(now)
local lease_ttl, waiter_ttl = tonumber(ARGV[1]), tonumber(ARGV[2])
local n = tonumber(ARGV[4])
local created = num('created_at', nil)
local missing, grants, lost = {}, {}, {}
for i = 5, 4 + n do
  if redis.call('ZSCORE', KEYS[2], ARGV[i]) then
    redis.call('ZADD', KEYS[2], 'XX', now + lease_ttl, ARGV[i])
  elseif created == nil or tonumber(ARGV[i + n]) < created then
    redis.call('ZADD', KEYS[2], now + lease_ttl, ARGV[i])
  else
    table.insert(missing, ARGV[i])
  end
end
for i = 5 + 2 * n, #ARGV do
  local id = ARGV[i]
  if redis.call('HEXISTS', KEYS[5], id) == 1 then
    redis.call('ZADD', KEYS[6], 'XX', now + waiter_ttl, id)
  else
    local g = redis.call('HGET', KEYS[7], id)
    if g then
      redis.call('HDEL', KEYS[7], id)
      table.insert(grants, id .. ' ' .. g)
    else
      table.insert(lost, id)
    end
  end
end
dispatch(now, lease_ttl, ARGV[3])
return {missing, grants, lost, tostring(next_event(now)), configured() and 1 or 0}
"""

BACKOFF = _PRELUDE + r"""
-- ARGV: cause, wait_ms (policy.pause_length), sent_at (-1 = unknown), notice template with {N},
--       reduces ('1': a status in reduce_statuses, lower the limit once per burst; '0': pause only)
local now = now_ms()
local wait = tonumber(ARGV[2])
local paused_until = num('paused_until', 0)
local sent_at = tonumber(ARGV[3])
local same_burst = paused_until > now or (sent_at >= 0 and sent_at <= num('last_reduction_at', -1))
if now + wait > paused_until then redis.call('HSET', KEYS[1], 'paused_until', now + wait) end
redis.call('HINCRBY', KEYS[1], 'backoffs', 1)
redis.call('HSET', KEYS[1], 'last_backoff_at', now)
local reduced = 0
if not same_burst and ARGV[5] == '1' then
  redis.call('HSET', KEYS[1], 'last_reduction_at', now)
  local limit = limit_of()
  if limit and limit > 1 then
    if num('auto_reduced_from', nil) == nil then redis.call('HSET', KEYS[1], 'auto_reduced_from', limit) end
    limit = limit - 1
    local notice = string.gsub(ARGV[4], '{N}', tostring(limit))
    redis.call('HSET', KEYS[1], 'limit', limit, 'notice', notice)
    redis.call('HINCRBY', KEYS[1], 'auto_reductions', 1)
    reduced = 1
  end
end
return {reduced, tostring(limit_of() or 'none'), tostring(math.max(paused_until, now + wait))}
"""

SET_LIMIT = _PRELUDE + r"""
-- ARGV: limit ('none' or n), lease_ttl, channel
local now = now_ms()
redis.call('HSET', KEYS[1], 'limit', ARGV[1])
redis.call('HDEL', KEYS[1], 'auto_reduced_from', 'notice')
cleanup(now)
dispatch(now, tonumber(ARGV[2]), ARGV[3])
return 1
"""

SET_COOLDOWN = _PRELUDE + r"""
-- ARGV: cooldown_ms
redis.call('HSET', KEYS[1], 'cooldown_ms', ARGV[1])
return 1
"""

CONFIGURE = _PRELUDE + r"""
-- ARGV: configured limit ('none' or n), configured cooldown_ms, recovering notice template ({N}, {TARGET}),
--       recovery_ms, lease_ttl, channel,
--       settle_ms (how long to hold grants back if this re-creates the provider after Redis lost its data)
-- A changed configured value is a manual act: it replaces the effective one and clears any auto-reduction.
local now = now_ms()
if not configured() then
  redis.call('HSET', KEYS[1], 'created_at', now, 'settle_until', now + tonumber(ARGV[7]))
elseif num('created_at', nil) == nil then
  redis.call('HSET', KEYS[1], 'created_at', now)
end
local old_limit = redis.call('HGET', KEYS[1], 'configured_limit')
if old_limit ~= ARGV[1] then
  redis.call('HSET', KEYS[1], 'limit', ARGV[1], 'configured_limit', ARGV[1])
  redis.call('HDEL', KEYS[1], 'auto_reduced_from', 'notice')
end
local old_cooldown = redis.call('HGET', KEYS[1], 'configured_cooldown_ms')
if old_cooldown ~= ARGV[2] then
  redis.call('HSET', KEYS[1], 'cooldown_ms', ARGV[2], 'configured_cooldown_ms', ARGV[2])
end
redis.call('HSET', KEYS[1], 'recovering_notice', ARGV[3], 'recovery_ms', ARGV[4])
cleanup(now)
dispatch(now, tonumber(ARGV[5]), ARGV[6])
return 1
"""

RESTAR = _PRELUDE + r"""
-- ARGV: lease_ttl, channel. Re-key every waiter against the current starred set (KEYS[9]).
local now = now_ms()
local all = redis.call('HGETALL', KEYS[5])
for i = 1, #all, 2 do
  local id, info = all[i], cjson.decode(all[i + 1])
  local starred = info.s == '1' or redis.call('SISMEMBER', KEYS[9], info.w) == 1
  local member = waiter_member(starred, info.p, info.q, id)
  if member ~= info.m then
    redis.call('ZREM', KEYS[4], info.m)
    redis.call('ZADD', KEYS[4], 0, member)
    info.m = member
    redis.call('HSET', KEYS[5], id, cjson.encode(info))
  end
end
cleanup(now)
dispatch(now, tonumber(ARGV[1]), ARGV[2])
return 1
"""

STATS = _PRELUDE + r"""
-- ARGV: queue entries to list. Returns {cfg pairs, leases, cooling, queued, now, queue infos...}
local now = now_ms()
cleanup(now)
local head = redis.call('ZRANGE', KEYS[4], 0, tonumber(ARGV[1]) - 1)
local infos = {}
for _, member in ipairs(head) do
  local id = string.sub(member, string.find(member, ':', 1, true) + 1)
  local info = cjson.decode(redis.call('HGET', KEYS[5], id))
  info.starred = string.sub(member, 1, 1) == '0'
  table.insert(infos, cjson.encode(info))
end
return {redis.call('HGETALL', KEYS[1]), redis.call('ZCARD', KEYS[2]), redis.call('ZCARD', KEYS[3]),
        redis.call('ZCARD', KEYS[4]), tostring(now), infos}
"""
