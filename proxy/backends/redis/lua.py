"""The Redis backend's Lua scripts: every state change that must be atomic is one script, each starting
with the shared functions of ``lua_prelude``.

Keys of one provider (``{prefix}:{provider}:...``), always passed in this order:

====  ========  =============================================================
 1    cfg       hash: limit, configured_limit, auto_reduced_from, notice,
                cooldown_ms, configured_cooldown_ms, paused_until,
                last_reduction_at, last_backoff_at, recovering_notice
                (a template from the policy), recovery_ms, created_at,
                settle_until, seen and seen_ttl (the last RENEW and its
                lease_ttl), gaps_bridged, and the policy's counters
                (granted, ...)
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

Levels beside the provider's own (a key of its pool, ``k:<name>``, or a model
cap, ``m:<pattern>``) live under ``{prefix}:{provider}:lv:<level>`` (a hash with
the cfg's limit, pause, reduction and budget fields) and ``...:lv:<level>:leases``
(a zset like ``leases``). ``lmap`` maps each lease to its workspace and levels,
``wsheld`` counts each workspace's leases (for ``max_share``). The provider's
``layout`` (cfg field, JSON from CONFIGURE) names its keys and model caps. When
it has model caps or a share, waiters are also kept per class
(``...:q:<pattern>\n<workspace>``, names in the set ``...:classes``) so that a
full cap never holds up a waiter of another class. These keys are derived from
``KEYS[1]`` inside the scripts and share its hash tag, so one node of a Cluster holds them; so do the
token windows' buckets (``w:...``, see ``lua_windows``): a grant takes a waiter's slots and its window cost
in one script, and a head its windows hold leaves the earliest refill time in ``window_wake`` for
``next_event``, which the waiting replica sets its one dispatch timer by.

The rules are the policy's (:mod:`proxy.limiter.policy`). What it decides reaches
the scripts as arguments or settings fields: notice templates (auto-reduced,
recovering), the pause length, the listing length, the counters' names. What
must happen inside one atomic script is written here again: admission (limit,
pause, settle), the same-burst test, one reduction step, one recovery step, the
queue member's order; ``tests/backends/test_policy_vs_lua.py`` runs the same
event sequences through both and compares every status field.

All times come from Redis's own ``TIME``, so replicas with skewed clocks agree.
Grants are published on ``{prefix}:grant:{replica}`` as "waiter lease granted_at key ...", the grant's text
(``grants``: with what held it while it waited).

Nothing is granted for a provider whose ``cfg`` has no ``configured_limit``: that
is a Redis that lost its data (restarted empty, flushed, failed over). ENQUEUE then
answers -2 and RENEW reports it, and the replica runs CONFIGURE again. A CONFIGURE
that re-creates the provider may hold grants back until ``settle_until``, so every
replica's RENEW can first put back the leases it still holds (a lease granted
before ``created_at`` was lost with the data, not expired).

A Redis that no replica reached for over half a lease_ttl (a primary failing over,
a restart that kept its data) did not let the slots' time run meanwhile: the first
script after the gap pushes every lease and waiter heartbeat then alive on by the
gap, and sets ``created_at``, so the holders renew them (or put back a grant the
new primary never received) instead of losing the streams they carry.
"""

from __future__ import annotations

from .lua_prelude import PRELUDE

__all__ = ["BACKOFF", "BUDGET", "CANCEL", "CONFIGURE", "DISPATCH", "ENQUEUE", "PICK_KEY", "RELEASE", "RENEW", "RESTAR",
           "SET_COOLDOWN", "SET_LIMIT", "STATS", "USAGE_ADD", "WINDOW_CORRECT", "WINDOW_HIT", "WINDOW_LEARN",
           "WINDOW_RECOST", "WINDOW_SETTLE"]

ENQUEUE = PRELUDE + r"""
-- ARGV: id, replica, workspace, header_starred, prompt_ms, conversation, seq ('' = new),
--       lease_ttl, waiter_ttl, max_queue, channel, model cap pattern ('' = none), preferred key ('' = none),
--       pinned key ('' = any key of the pool), transport ('' = http, 'ws' = websocket), model ('' = none named),
--       window cost (JSON, window name -> amount; '' = none), model group of its windows,
--       the cost's version ('' = 0: costed once; see WINDOW_RECOST)
local now = now_ms()
cleanup(now)
local done = redis.call('HGET', KEYS[7], ARGV[1])
if done then
  redis.call('HDEL', KEYS[7], ARGV[1])
  return {1, done, tonumber(ARGV[7]) or 0}
end
if not configured() then return {-2, '0', tonumber(ARGV[7]) or 0} end
forget_waiter(ARGV[1])
local seq = tonumber(ARGV[7])
if seq then
  -- a waiter put back after Redis lost its data keeps its number; later arrivals come after it
  if tonumber(redis.call('GET', KEYS[8]) or '0') < seq then redis.call('SET', KEYS[8], seq) end
else
  seq = redis.call('INCR', KEYS[8])
end
local starred = ARGV[4] == '1' or redis.call('SISMEMBER', KEYS[9], ARGV[3]) == 1
local cost = ARGV[17] ~= '' and ARGV[17] or nil
local info = {m = waiter_member(starred, tonumber(ARGV[5]), seq, ARGV[1]), r = ARGV[2], w = ARGV[3], s = ARGV[4],
  p = tonumber(ARGV[5]), q = seq, c = ARGV[6], t = now, pt = ARGV[12], k = ARGV[13],
  cl = waiter_class(ARGV[12], ARGV[3], ARGV[14], cost and ARGV[18])}
if cost then info.wc, info.wg, info.wv = cost, ARGV[18], tonumber(ARGV[19]) end
if ARGV[14] ~= '' then info.kp = ARGV[14] end
if ARGV[15] ~= '' then info.tr = ARGV[15] end
if ARGV[16] ~= '' then info.md = ARGV[16] end
queue_entry(info)
redis.call('HSET', KEYS[5], ARGV[1], cjson.encode(info))
redis.call('ZADD', KEYS[6], now + tonumber(ARGV[9]), ARGV[1])
answering = ARGV[1]
dispatch(now, tonumber(ARGV[8]), ARGV[11])
answering = nil
local g = redis.call('HGET', KEYS[7], ARGV[1])
if g then
  redis.call('HDEL', KEYS[7], ARGV[1])
  return {1, g, seq}
end
if redis.call('ZCARD', KEYS[4]) > tonumber(ARGV[10]) then
  forget_waiter(ARGV[1])
  redis.call('HINCRBY', KEYS[1], 'queue_full', 1)
  return {-1, pause_end(now) .. ' ' .. now, seq}
end
-- left queued: what holds it, kept for its grant to name (the windows, if they hold it, note themselves)
local queued = cjson.decode(redis.call('HGET', KEYS[5], ARGV[1]))
queued.hd = what_holds(queued, now)
redis.call('HSET', KEYS[5], ARGV[1], cjson.encode(queued))
return {0, tostring(next_event(now)), seq}
"""

DISPATCH = PRELUDE + r"""
-- ARGV: lease_ttl, channel
local now = now_ms()
cleanup(now)
dispatch(now, tonumber(ARGV[1]), ARGV[2])
return tostring(next_event(now))
"""

RELEASE = PRELUDE + r"""
-- ARGV: lease, waiter id, lease_ttl, channel
local now = now_ms()
local removed = drop_lease(ARGV[1])
redis.call('HDEL', KEYS[7], ARGV[2])
local cooldown = num('cooldown_ms', 0)
if removed == 1 and cooldown > 0 then
  redis.call('ZADD', KEYS[3], now + cooldown, ARGV[1])
end
cleanup(now)
dispatch(now, tonumber(ARGV[3]), ARGV[4])
return {removed, tostring(next_event(now))}
"""

CANCEL = PRELUDE + r"""
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
    drop_lease(string.sub(g, 1, string.find(g, ' ', 1, true) - 1))
  end
end
cleanup(now)
dispatch(now, tonumber(ARGV[2]), ARGV[3])
return pause_end(now) .. ' ' .. now
"""

RENEW = PRELUDE + r"""
-- ARGV: lease_ttl, waiter_ttl, channel, n_leases, lease ids..., their grant times (ms)..., whether each is fresh
--       ('1': renewed within its lease_ttl by the replica's own clock, so it cannot have expired here)...,
--       waiter ids...
-- Returns {missing leases, grants found for our waiters ("id lease at key"), waiters lost, next event,
--          1 if the provider is configured here (0: Redis lost its data; run CONFIGURE)}.
-- A lease granted before this Redis's data was created was lost with it, not expired; so was a fresh lease
-- this Redis does not know (a failover to a replica that had not received it yet): both are put back
-- (at the provider's level; their key and model levels were lost with them).
local now = now_ms()
cleanup(now)
local lease_ttl, waiter_ttl = tonumber(ARGV[1]), tonumber(ARGV[2])
local n = tonumber(ARGV[4])
seen_now(now, lease_ttl)
local created = num('created_at', nil)
local missing, grants, lost = {}, {}, {}
for i = 5, 4 + n do
  if redis.call('ZSCORE', KEYS[2], ARGV[i]) then
    redis.call('ZADD', KEYS[2], 'XX', now + lease_ttl, ARGV[i])
    local raw = redis.call('HGET', BASE .. 'lmap', ARGV[i])
    if raw then
      for _, lid in ipairs(cjson.decode(raw).l) do
        redis.call('ZADD', level_hash(lid) .. ':leases', 'XX', now + lease_ttl, ARGV[i])
      end
    end
  elseif created == nil or tonumber(ARGV[i + n]) < created or ARGV[i + 2 * n] == '1' then
    redis.call('ZADD', KEYS[2], now + lease_ttl, ARGV[i])
  else
    table.insert(missing, ARGV[i])
  end
end
for i = 5 + 3 * n, #ARGV do
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

BACKOFF = PRELUDE + r"""
-- ARGV: cause, wait_ms (policy.pause_length), sent_at (-1 = unknown), notice template with {N},
--       reduces ('1': a status in reduce_statuses, lower the limit once per burst; '0': pause only),
--       level ('' = the provider; 'k:<name>' = the key the answer came on)
local now = now_ms()
local hash = hash_of(ARGV[6])
local wait = tonumber(ARGV[2])
local paused_until = hnum(hash, 'paused_until', 0)
local sent_at = tonumber(ARGV[3])
local same_burst = paused_until >= now or (sent_at >= 0 and sent_at <= hnum(hash, 'last_reduction_at', -1))
if now + wait > paused_until then redis.call('HSET', hash, 'paused_until', now + wait) end
redis.call('HINCRBY', hash, 'backoffs', 1)
redis.call('HSET', hash, 'last_backoff_at', now)
local reduced = 0
if not same_burst and ARGV[5] == '1' then
  redis.call('HSET', hash, 'last_reduction_at', now)
  local limit = hlimit(hash)
  if limit and limit > 1 then
    if hnum(hash, 'auto_reduced_from', nil) == nil then redis.call('HSET', hash, 'auto_reduced_from', limit) end
    limit = limit - 1
    local notice = string.gsub(ARGV[4], '{N}', tostring(limit))
    redis.call('HSET', hash, 'limit', limit, 'notice', notice)
    redis.call('HINCRBY', hash, 'auto_reductions', 1)
    reduced = 1
  end
end
return {reduced, tostring(hlimit(hash) or 'none'), tostring(math.max(paused_until, now + wait))}
"""

BUDGET = PRELUDE + r"""
-- ARGV: level ('' = the provider, 'k:<name>' = a key), hold_ms (0: no hold), the budget as JSON
--       {remaining_requests, remaining_tokens, reset_in_ms, requests_reset_in_ms}.
-- Not a backoff: no pause, reduction or notice.
local now = now_ms()
local hash = hash_of(ARGV[1])
local budget = cjson.decode(ARGV[3])
local reset_at = ''
if budget.reset_in_ms ~= nil and budget.reset_in_ms ~= cjson.null then reset_at = now + budget.reset_in_ms end
redis.call('HSET', hash, 'budget', cjson.encode({budget.remaining_requests, budget.remaining_tokens, reset_at}))
local hold = tonumber(ARGV[2])
if hold > 0 and now + hold > hnum(hash, 'held_until', 0) then redis.call('HSET', hash, 'held_until', now + hold) end
local requests_reset = tonumber(budget.requests_reset_in_ms)
if type(budget.remaining_requests) == 'number' and requests_reset and requests_reset > 0 then
  local left, same_window = budget.remaining_requests, hnum(hash, 'left_reset', 0) > now
  -- the same window: an answer to an earlier request does not count the grants made since (LimitLevel)
  if same_window and hnum(hash, 'left', nil) ~= nil then left = math.min(left, hnum(hash, 'left', nil)) end
  redis.call('HSET', hash, 'left', left, 'left_reset', now + requests_reset)
end
return tostring(next_event(now))
"""

SET_LIMIT = PRELUDE + r"""
-- ARGV: limit ('none' or n), lease_ttl, channel, level ('' = the provider)
local now = now_ms()
local hash = hash_of(ARGV[4])
redis.call('HSET', hash, 'limit', ARGV[1])
redis.call('HDEL', hash, 'auto_reduced_from', 'notice')
cleanup(now)
dispatch(now, tonumber(ARGV[2]), ARGV[3])
return 1
"""

SET_COOLDOWN = PRELUDE + r"""
-- ARGV: cooldown_ms
redis.call('HSET', KEYS[1], 'cooldown_ms', ARGV[1])
return 1
"""

CONFIGURE = PRELUDE + r"""
-- ARGV: configured limit ('none' or n), configured cooldown_ms, recovering notice template ({N}, {TARGET}),
--       recovery_ms, lease_ttl, channel,
--       settle_ms (how long to hold grants back if this re-creates the provider after Redis lost its data),
--       layout (JSON: {keys = [{n, l, a}], models = [{p, l}], share}),
--       windows (JSON: {p, m, k, learn, h}, see lua_windows; '' = none held)
-- A changed configured value is a manual act: it replaces the effective one and clears any auto-reduction.
local now = now_ms()
if not configured() then
  redis.call('HSET', KEYS[1], 'created_at', now, 'settle_until', now + tonumber(ARGV[7]))
elseif num('created_at', nil) == nil then
  redis.call('HSET', KEYS[1], 'created_at', now)
end
local function configure_level(hash, limit)
  if redis.call('HGET', hash, 'configured_limit') ~= limit then
    redis.call('HSET', hash, 'limit', limit, 'configured_limit', limit)
    redis.call('HDEL', hash, 'auto_reduced_from', 'notice')
  end
end
configure_level(KEYS[1], ARGV[1])
local old_cooldown = redis.call('HGET', KEYS[1], 'configured_cooldown_ms')
if old_cooldown ~= ARGV[2] then
  redis.call('HSET', KEYS[1], 'cooldown_ms', ARGV[2], 'configured_cooldown_ms', ARGV[2])
end
local was_classed, had_share, had_windows = layout().classed, layout().share ~= nil, layout().win ~= nil
local windows_changed = (redis.call('HGET', KEYS[1], 'windows') or '') ~= ARGV[9]
redis.call('HSET', KEYS[1], 'recovering_notice', ARGV[3], 'recovery_ms', ARGV[4], 'layout', ARGV[8], 'windows', ARGV[9])
layout_cache = nil
if windows_changed and layout().win == nil then
  windows_drop()
elseif windows_changed then
  -- a reload: every bucket takes its new limit (learned ones forgotten when learning is off)
  if not layout().win.learn then redis.call('DEL', BASE .. 'wlearn') end
  window_refresh_all(now)
end
for _, key in ipairs(layout().keys) do configure_level(level_hash('k:' .. key.n), key.l) end
for _, cap in ipairs(layout().models) do configure_level(level_hash('m:' .. cap.p), cap.l) end
if was_classed ~= layout().classed or had_share ~= (layout().share ~= nil) or had_windows ~= (layout().win ~= nil) then
  -- waiters are kept apart differently now: file each under its new class
  for _, class in ipairs(redis.call('SMEMBERS', BASE .. 'classes')) do redis.call('DEL', BASE .. 'q:' .. class) end
  redis.call('DEL', BASE .. 'classes')
  local all = redis.call('HGETALL', KEYS[5])
  for i = 1, #all, 2 do
    local info = cjson.decode(all[i + 1])
    info.cl = waiter_class(info.pt or '', info.w, info.kp, info.wc and info.wg)
    queue_entry(info)
    redis.call('HSET', KEYS[5], all[i], cjson.encode(info))
  end
end
cleanup(now)
seen_now(now, ARGV[5])
dispatch(now, tonumber(ARGV[5]), ARGV[6])
return 1
"""

RESTAR = PRELUDE + r"""
-- ARGV: lease_ttl, channel, the starred workspaces... Keep them as the provider's starred set (KEYS[9], under
-- the provider's hash tag, so ENQUEUE reads it on the provider's node) and re-key every waiter against it.
local now = now_ms()
redis.call('DEL', KEYS[9])
for i = 3, #ARGV do redis.call('SADD', KEYS[9], ARGV[i]) end
local all = redis.call('HGETALL', KEYS[5])
for i = 1, #all, 2 do
  local id, info = all[i], cjson.decode(all[i + 1])
  local starred = info.s == '1' or redis.call('SISMEMBER', KEYS[9], info.w) == 1
  local member = waiter_member(starred, info.p, info.q, id)
  if member ~= info.m then
    redis.call('ZREM', KEYS[4], info.m)
    if info.cl then redis.call('ZREM', BASE .. 'q:' .. info.cl, info.m) end
    info.m = member
    queue_entry(info)
    redis.call('HSET', KEYS[5], id, cjson.encode(info))
  end
end
cleanup(now)
dispatch(now, tonumber(ARGV[1]), ARGV[2])
return 1
"""

STATS = PRELUDE + r"""
-- ARGV: queue entries (and holders) to list. Returns {cfg pairs, leases, cooling, queued, now, queue infos...,
--          levels: {level id, its hash pairs, its leases}..., pause end, holders: lmap entries, longest held first,
--          window rows (JSON; '' without windows)}
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
local levels = {}
for _, lid in ipairs(all_levels()) do
  local hash = level_hash(lid)
  table.insert(levels, {lid, redis.call('HGETALL', hash), redis.call('ZCARD', hash .. ':leases')})
end
local holders = {}
local listed = tonumber(ARGV[1])
if listed > 0 then
  local ids = redis.call('ZRANGE', KEYS[2], 0, -1)
  for first = 1, #ids, 1000 do  -- unpack's arguments are bounded: read the map a thousand at a time
    local chunk = {}
    for i = first, math.min(first + 999, #ids) do table.insert(chunk, ids[i]) end
    for _, raw in ipairs(redis.call('HMGET', BASE .. 'lmap', unpack(chunk))) do
      if raw then table.insert(holders, cjson.decode(raw)) end
    end
  end
  table.sort(holders, function(a, b)
    if (a.t or 0) ~= (b.t or 0) then return (a.t or 0) < (b.t or 0) end
    return (a.g or 0) < (b.g or 0)
  end)
  for i = #holders, listed + 1, -1 do holders[i] = nil end
  for i, holder in ipairs(holders) do holders[i] = cjson.encode(holder) end
end
return {redis.call('HGETALL', KEYS[1]), redis.call('ZCARD', KEYS[2]), redis.call('ZCARD', KEYS[3]),
        redis.call('ZCARD', KEYS[4]), tostring(now), infos, levels, tostring(pause_end(now)), holders,
        window_rows(now)}
"""

PICK_KEY = PRELUDE + r"""
-- ARGV: preferred key ('' = none). The key a new WebSocket opens with (policy.socket_key): as a grant would
-- choose it, else the preferred or first key neither paused nor held, else the pool's first ('' = no pool).
local now = now_ms()
cleanup(now)
local pool = layout().pool
if #pool == 0 then return '' end
local candidates, unblocked = {}, {}
for _, name in ipairs(pool) do
  local ok, free = level_room('k:' .. name, now)
  if ok then table.insert(candidates, {name, free}) end
  if blocked_until(level_hash('k:' .. name), now) == 0 then table.insert(unblocked, name) end
end
local chosen = choose_key(candidates, ARGV[1])
if chosen ~= nil then return chosen end
for _, name in ipairs(unblocked) do
  if name == ARGV[1] then return name end
end
if #unblocked > 0 then return unblocked[1] end
return pool[1]
"""

WINDOW_SETTLE = PRELUDE + r"""
-- ARGV: lease_ttl, channel, key ('' = the provider's own), group, granted_at (ms), then (window, charged,
-- actual, rule, admitted) fives. WindowBook.settle for each: charge what went beyond the estimate; with
-- give_back, give back an over-estimate (then waiters may have room: dispatch). A lease granted before the
-- provider's word last lowered the window ('rebased') settles against what the provider charged it when it
-- admitted it (admitted; '' when unknown), charging only what went beyond that.
local now = now_ms()
if layout().win == nil then return 0 end
local pid = ARGV[3] .. '\n' .. ARGV[4]
local granted_at = tonumber(ARGV[5])
local room = false
for i = 6, #ARGV, 5 do
  local b = bucket_read(pid .. '\n' .. ARGV[i], ARGV[i])
  if b and redis.call('ZSCORE', BASE .. 'wpairs', pid) then
    local charged, rule = tonumber(ARGV[i + 1]), ARGV[i + 3]
    if ARGV[i + 4] ~= '' and granted_at <= bucket_rebased_at(b) then
      charged, rule = tonumber(ARGV[i + 4]), 'charge_beyond'
    end
    local beyond = tonumber(ARGV[i + 2]) - charged
    if beyond > 0 then
      bucket_take(b, beyond, now)
      bucket_save(b)
    elseif beyond < 0 and rule == 'give_back' then
      bucket_give(b, -beyond, now)
      bucket_save(b)
      room = true
    end
  end
end
if room then
  cleanup(now)
  dispatch(now, tonumber(ARGV[1]), ARGV[2])
end
return tostring(next_event(now))
"""

WINDOW_HIT = PRELUDE + r"""
-- ARGV: key ('' = the provider's own), group, window, until (ms), what it holds then. A 429 named this
-- window: counted, and empty until then (WindowBook.hit), the leases granted before now settling against
-- what the provider charged them ('rebased'); the slots' limit is not touched.
local now = now_ms()
if layout().win == nil then return 0 end
redis.call('HINCRBY', BASE .. 'whits', ARGV[1] .. '\n' .. ARGV[2] .. '\n' .. ARGV[3], 1)
local b = window_of(ARGV[1], ARGV[2], ARGV[3], now)
if b then
  bucket_empty_until(b, tonumber(ARGV[4]), now, tonumber(ARGV[5]))
  bucket_save(b)
  bucket_rebase(b, now)
end
return 1
"""

WINDOW_LEARN = PRELUDE + r"""
-- ARGV: lease_ttl, channel, key ('' = the provider's own), group, then (window, limit) pairs an answer's
-- headers announced (WindowBook.learn). A limit in force that changed may make room: dispatch.
local now = now_ms()
local win = layout().win
if win == nil or not win.learn then return tostring(next_event(now)) end
local known = {}
for _, name in ipairs(WINDOW_NAMES) do known[name] = true end
local learned = false
for i = 5, #ARGV, 2 do
  local id, limit = ARGV[3] .. '\n' .. ARGV[4] .. '\n' .. ARGV[i], tonumber(ARGV[i + 1])
  if known[ARGV[i]] and limit >= 1 and tonumber(redis.call('HGET', BASE .. 'wlearn', id) or '') ~= limit then
    redis.call('HSET', BASE .. 'wlearn', id, ARGV[i + 1])
    learned = true
  end
end
if learned and window_refresh(ARGV[3], ARGV[4], now) then
  cleanup(now)
  dispatch(now, tonumber(ARGV[1]), ARGV[2])
end
return tostring(next_event(now))
"""

WINDOW_RECOST = PRELUDE + r"""
-- ARGV: lease_ttl, channel, then (waiter id, version, window cost JSON) triples: one replica's own waiters of one
-- model group, costed again because the group's estimates moved (proxy.providers.recost has the rule; this only
-- applies it, as ProviderWindows.recost does). A waiter no longer queued (granted, gone) keeps what it took; a
-- version not newer than the waiter's own is stale (an earlier re-costing that arrived late) and changes nothing.
-- The queue member holds no cost, so no entry moves. Then admission runs at once, as after a grant; a grant of a
-- re-costed waiter names the version it took (' w<version>').
local now = now_ms()
if layout().win == nil then return tostring(next_event(now)) end
local changed = false
for i = 3, #ARGV, 3 do
  local raw = redis.call('HGET', KEYS[5], ARGV[i])
  local info = raw and cjson.decode(raw)
  local version = tonumber(ARGV[i + 1])
  if info and info.wc and (info.wv or 0) < version then
    info.wc, info.wv = ARGV[i + 2], version
    redis.call('HSET', KEYS[5], ARGV[i], cjson.encode(info))
    changed = true
  end
end
if changed then
  cleanup(now)
  dispatch(now, tonumber(ARGV[1]), ARGV[2])
end
return tostring(next_event(now))
"""

WINDOW_CORRECT = PRELUDE + r"""
-- ARGV: key ('' = the provider's own), group, answered_at (ms), then (window, remaining, slack) triples: what an
-- answer said was left; the room believed is never more than that, less what was sent since, beyond the
-- announcement's rounding (slack: window.ROUNDED_REMAINING; WindowBook.correct).
local now = now_ms()
if layout().win == nil then return 0 end
local since = tonumber(ARGV[3])
for i = 4, #ARGV, 3 do
  local b = window_of(ARGV[1], ARGV[2], ARGV[i], now)
  if b then
    local announced = tonumber(ARGV[i + 1])
    local slack = math.min(tonumber(ARGV[i + 2]), math.max(announced, 0))
    if bucket_correct(b, announced - bucket_taken_since(b, since), slack, now) then bucket_rebase(b, since) end
    bucket_save(b)
  end
end
return 1
"""

USAGE_ADD = r"""
-- KEYS[1]: one provider's hour of usage aggregates (proxy.ledger.fleet). ARGV: when it expires (epoch ms), then
-- field, amount pairs: a field named max:... keeps the larger value, every other one is added to.
for i = 2, #ARGV, 2 do
  local field, amount = ARGV[i], tonumber(ARGV[i + 1])
  if string.sub(field, 1, 4) == 'max:' then
    if amount > tonumber(redis.call('HGET', KEYS[1], field) or '-1') then redis.call('HSET', KEYS[1], field, amount) end
  else
    redis.call('HINCRBY', KEYS[1], field, amount)
  end
end
redis.call('PEXPIREAT', KEYS[1], ARGV[1])
return 1
"""
