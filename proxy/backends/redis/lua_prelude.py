"""The Lua every script of ``lua`` starts with: the provider's keys, the clock, levels (the provider's
own, its keys' and model caps'), the queue's members and classes, admission, grants and the policy's
rules written again in Lua; one text, prefixed to each script, so the scripts share one definition of
each function.
"""

from .lua_windows import WINDOWS

__all__ = ["PRELUDE"]

_HEAD = r"""
local BASE = string.sub(KEYS[1], 1, #KEYS[1] - 3)
local MAX_LIMIT = 100000

local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

local function hnum(hash, field, default)
  local v = redis.call('HGET', hash, field)
  if v == false or v == '' then return default end
  return tonumber(v)
end

local function num(field, default) return hnum(KEYS[1], field, default) end

local function hlimit(hash)
  local v = redis.call('HGET', hash, 'limit')
  if v == false or v == '' or v == 'none' then return nil end
  return tonumber(v)
end

local function limit_of() return hlimit(KEYS[1]) end

local function level_hash(lid) return BASE .. 'lv:' .. lid end

-- The provider's keys and model caps: {keys = {{n, l, a}...}, models = {{p, l}...}, share = x or nil}
local layout_cache = nil
local function layout()
  if layout_cache == nil then
    local raw = redis.call('HGET', KEYS[1], 'layout')
    layout_cache = (raw and raw ~= '') and cjson.decode(raw) or {keys = {}, models = {}}
    local windows = redis.call('HGET', KEYS[1], 'windows')
    if windows and windows ~= '' then layout_cache.win = cjson.decode(windows) end
    local pool, models = {}, {}
    for _, key in ipairs(layout_cache.keys) do
      if key.a == 1 then table.insert(pool, key.n) end
    end
    for _, cap in ipairs(layout_cache.models) do models[cap.p] = true end
    layout_cache.pool = pool
    layout_cache.capped = models
    -- with a pool, a WebSocket's waiters are pinned to their socket's key: every waiter then has a class
    -- with windows, a waiter's model group is part of its class
    layout_cache.classed = #layout_cache.models > 0 or layout_cache.share ~= nil or #pool > 0 or
      layout_cache.win ~= nil
  end
  return layout_cache
end

local function all_levels()
  local ids = {}
  for _, key in ipairs(layout().keys) do table.insert(ids, 'k:' .. key.n) end
  for _, cap in ipairs(layout().models) do table.insert(ids, 'm:' .. cap.p) end
  return ids
end

local function recover_hash(hash, now)
  local from = hnum(hash, 'auto_reduced_from', nil)
  local every = num('recovery_ms', 0)
  local limit = hlimit(hash)
  if from == nil or every <= 0 or limit == nil then return end
  if now - hnum(hash, 'last_backoff_at', now) < every then return end
  limit = math.min(from, limit + 1)
  redis.call('HSET', hash, 'limit', limit, 'last_backoff_at', now)
  if limit >= from then
    redis.call('HDEL', hash, 'auto_reduced_from', 'notice')
  else
    local template = redis.call('HGET', KEYS[1], 'recovering_notice') or ''
    local notice = string.gsub(string.gsub(template, '{N}', tostring(limit)), '{TARGET}', tostring(from))
    redis.call('HSET', hash, 'notice', notice)
  end
end

local function recover(now)
  recover_hash(KEYS[1], now)
  for _, lid in ipairs(all_levels()) do recover_hash(level_hash(lid), now) end
end

-- A lease's windows are no longer reserved when it ends (lua_windows).
local window_ended

-- A lease leaves every level it holds a slot at (a no-op for one already gone); 1 if it was held.
local function drop_lease(id)
  local removed = redis.call('ZREM', KEYS[2], id)
  local raw = redis.call('HGET', BASE .. 'lmap', id)
  if raw then
    local held = cjson.decode(raw)
    for _, lid in ipairs(held.l) do redis.call('ZREM', level_hash(lid) .. ':leases', id) end
    if redis.call('HINCRBY', BASE .. 'wsheld', held.w, -1) <= 0 then redis.call('HDEL', BASE .. 'wsheld', held.w) end
    if held.wc and held.wg then window_ended(held.k or '', held.wg, held.wc) end
    redis.call('HDEL', BASE .. 'lmap', id)
  end
  return removed
end

-- Take a waiter out: its queue entries, its info and its heartbeat (a no-op for one already gone).
local function forget_waiter(id)
  local info = redis.call('HGET', KEYS[5], id)
  if info then
    local decoded = cjson.decode(info)
    redis.call('ZREM', KEYS[4], decoded.m)
    if decoded.cl then redis.call('ZREM', BASE .. 'q:' .. decoded.cl, decoded.m) end
  end
  redis.call('HDEL', KEYS[5], id)
  redis.call('ZREM', KEYS[6], id)
end

-- Time stood still for the slots while no replica could reach this Redis (a primary failing over, a restart
-- that kept its data): nobody could renew then. Leases and waiter heartbeats still alive when the gap began
-- are pushed on by its length, so their holders renew them instead of losing them; a grant this Redis never
-- received (made just before the old primary died) is put back by RENEW, as after lost data (created_at).
-- RENEW (every replica runs it at least every second) and CONFIGURE write 'seen'; a gap is over half a lease_ttl.
local function seen_now(now, lease_ttl)
  redis.call('HSET', KEYS[1], 'seen', now, 'seen_ttl', lease_ttl)
end

local function bridge_gap(now)
  local stamp = redis.call('HMGET', KEYS[1], 'seen', 'seen_ttl')
  local seen, ttl = tonumber(stamp[1]), tonumber(stamp[2])
  if seen == nil or ttl == nil or now - seen <= ttl / 2 then return end
  local gap = now - seen
  for _, zset in ipairs({KEYS[2], KEYS[6]}) do
    local alive = redis.call('ZRANGEBYSCORE', zset, '(' .. seen, '+inf', 'WITHSCORES')
    for i = 1, #alive, 2 do redis.call('ZADD', zset, tonumber(alive[i + 1]) + gap, alive[i]) end
  end
  redis.call('HSET', KEYS[1], 'seen', now, 'created_at', now)
  redis.call('HINCRBY', KEYS[1], 'gaps_bridged', 1)
end

local function cleanup(now)
  bridge_gap(now)
  for _, id in ipairs(redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now)) do drop_lease(id) end
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

-- When a level's pause or budget hold ends (0: neither blocks it).
local function blocked_until(hash, now)
  local t = math.max(hnum(hash, 'paused_until', 0), hnum(hash, 'held_until', 0))
  if t > now then return t end
  return 0
end

-- Whether a level may take one more slot, and its free slots (nil: no limit).
local function level_room(lid, now)
  local hash = level_hash(lid)
  if blocked_until(hash, now) > 0 then return false, 0 end
  local limit = hlimit(hash)
  if limit == nil then return true, nil end
  local free = limit - redis.call('ZCARD', hash .. ':leases')
  return free > 0, free
end

-- policy.pool_paused_until: the provider's pause, else the earliest end while every pool key is blocked.
local function pause_end(now)
  local own = num('paused_until', 0)
  if own > now then return own end
  local pool = layout().pool
  if #pool == 0 then return 0 end
  local earliest = 0
  for _, name in ipairs(pool) do
    local t = blocked_until(level_hash('k:' .. name), now)
    if t == 0 then return 0 end
    if earliest == 0 or t < earliest then earliest = t end
  end
  return earliest
end

-- policy.choose_key: the preferred key if it may take one, else the most free slots, ties in config order.
local function choose_key(candidates, preferred)
  local best, best_free = nil, -1
  for _, c in ipairs(candidates) do
    if c[1] == preferred then return c[1] end
    local room = c[2] or (MAX_LIMIT + 1)
    if room > best_free then best, best_free = c[1], room end
  end
  return best
end

-- policy.share_cap over the provider's capacity (its limit, else its pool keys' limits together).
local function share_cap()
  local share = layout().share
  if share == nil then return nil end
  local capacity = limit_of()
  if capacity == nil then
    local pool = layout().pool
    if #pool == 0 then return nil end
    capacity = 0
    for _, name in ipairs(pool) do
      local l = hlimit(level_hash('k:' .. name))
      if l == nil then return nil end
      capacity = capacity + l
    end
  end
  return math.max(1, math.ceil(share * capacity - 1e-9))
end

-- A waiter's class; ``group`` is its model group when it has a window cost (nil: none).
local function waiter_class(pattern, workspace, pinned, group)
  if not layout().classed then return nil end
  return pattern .. '\n' .. (layout().share ~= nil and workspace or '') .. '\n' .. (pinned or '') .. '\n' ..
    (layout().win ~= nil and group or '')
end

-- A class name's parts: model cap pattern, workspace ('' unless shares apply), pinned key ('' = any), model
-- group ('' = no window cost).
local function class_parts(class)
  local parts, start = {}, 1
  while #parts < 3 do
    local cut = string.find(class, '\n', start, true)
    if cut == nil then break end
    table.insert(parts, string.sub(class, start, cut - 1))
    start = cut + 1
  end
  table.insert(parts, string.sub(class, start))
  return parts[1] or '', parts[2] or '', parts[3] or '', parts[4] or ''
end

local function in_pool(name)
  for _, key in ipairs(layout().pool) do
    if key == name then return true end
  end
  return false
end

"""

_TAIL = r"""
-- Take the queue entry ``member`` out and return its waiter's id and info (nil info: an orphan entry).
local function take_entry(member, class)
  redis.call('ZREM', KEYS[4], member)
  if class then
    local q = BASE .. 'q:' .. class
    redis.call('ZREM', q, member)
    if redis.call('ZCARD', q) == 0 then redis.call('SREM', BASE .. 'classes', class) end
  end
  local id = string.sub(member, string.find(member, ':', 1, true) + 1)
  local raw = redis.call('HGET', KEYS[5], id)
  if not raw then return id, nil end
  local info = cjson.decode(raw)
  if info.m ~= member then return id, nil end
  redis.call('HDEL', KEYS[5], id)
  redis.call('ZREM', KEYS[6], id)
  return id, info
end

-- The windows a class head needs: nil when they have room (or it needs none), with the key they have it on;
-- else held (the head's windows are noted and the wake-up set).
local function head_windows(member, pinned, group, now)
  if group == '' or layout().win == nil then return true, nil end
  local id = member_id(member)
  local raw = redis.call('HGET', KEYS[5], id)
  local info = raw and cjson.decode(raw)
  if not info or info.m ~= member or not info.wc then return true, nil end
  local key, wait = window_fit(pinned, info.k or '', group, cjson.decode(info.wc), now)
  if wait > 0 then
    window_hold(id, info, pinned, group, wait, now)
    return false, nil
  end
  if window_behind_held(key or '', group, cjson.decode(info.wc), now) then return false, nil end
  return true, key
end

-- The next waiter to grant: the queue's head, or with classes the first class head whose model cap has
-- room (and whose windows have room for its cost), passing over a workspace at its share while another can go.
-- Returns id, info, found, and the key its windows have room on (nil: any the grant chooses).
local function next_waiter(now)
  window_wake = nil
  window_blocked = {}
  if not layout().classed then
    local head = redis.call('ZRANGE', KEYS[4], 0, 0)
    if #head == 0 then return nil, nil, false end
    local id, info = take_entry(head[1], nil)
    return id, info, true
  end
  local heads = {}
  for _, class in ipairs(redis.call('SMEMBERS', BASE .. 'classes')) do
    local head = redis.call('ZRANGE', BASE .. 'q:' .. class, 0, 0)
    if #head == 0 then
      redis.call('SREM', BASE .. 'classes', class)
    else
      table.insert(heads, {head[1], class})
    end
  end
  table.sort(heads, function(a, b) return a[1] < b[1] end)
  local cap = share_cap()
  local over_share = nil
  for _, head in ipairs(heads) do
    local pattern, workspace, pinned, group = class_parts(head[2])
    local room, key = true, nil
    if pattern ~= '' and layout().capped[pattern] then room = level_room('m:' .. pattern, now) end
    if room and pinned ~= '' then room = in_pool(pinned) and level_room('k:' .. pinned, now) end
    if room then room, key = head_windows(head[1], pinned, group, now) end
    if room then
      local held = 0
      if cap ~= nil then held = tonumber(redis.call('HGET', BASE .. 'wsheld', workspace) or '0') end
      if cap ~= nil and held >= cap then
        if over_share == nil then over_share = {head[1], head[2], key} end
      else
        local id, info = take_entry(head[1], head[2])
        return id, info, true, key
      end
    end
  end
  if over_share ~= nil then
    local id, info = take_entry(over_share[1], over_share[2])
    return id, info, true, over_share[3]
  end
  return nil, nil, false
end

-- A grant counts against the requests the last answer said were left in the window (LimitLevel.take):
-- the last one left holds the key until the window resets.
local function count_against_budget(hash, now)
  local left = hnum(hash, 'left', nil)
  if left == nil then return end
  if left - 1 > 0 then
    redis.call('HSET', hash, 'left', left - 1)
    return
  end
  redis.call('HDEL', hash, 'left')
  local reset = hnum(hash, 'left_reset', 0)
  if reset > now and reset > hnum(hash, 'held_until', 0) then redis.call('HSET', hash, 'held_until', reset) end
end

-- holding.what_holds: the code of the first level without room for a waiter its ENQUEUE left queued, in the
-- order admission asks them ('queue': every level has room; the windows or the waiters ahead hold it).
local function what_holds(info, now)
  if blocked_until(KEYS[1], now) > 0 then return 'paused' end
  local limit = limit_of()
  if limit ~= nil and in_flight() >= limit then return 'limit' end
  local pool = layout().pool
  if #pool > 0 then
    local room = false
    for _, name in ipairs(pool) do
      if level_room('k:' .. name, now) then room = true break end
    end
    if not room then return 'keys' end
  end
  if info.pt and info.pt ~= '' and layout().capped[info.pt] and not level_room('m:' .. info.pt, now) then
    return 'm:' .. info.pt
  end
  if info.kp and info.kp ~= '' and not (in_pool(info.kp) and level_room('k:' .. info.kp, now)) then
    return 'k:' .. info.kp
  end
  return 'queue'
end

-- holding.holder_words: what held a waiter, as its grant names it: 'w:' and the windows that held it last,
-- else the code of what held it when it came ('': nothing did, it went straight through).
local function held_code(info)
  if info.hb and #info.hb > 0 then return 'w:' .. windows_held(info.hb) end
  return info.hd or ''
end

-- The waiter whose own ENQUEUE is running: a grant to it is in the script's answer, so no message is sent.
local answering = nil

local function grant(id, info, key, now, lease_ttl, channel)
  local levels = {}
  if key ~= '' then table.insert(levels, 'k:' .. key) end
  if info.pt and info.pt ~= '' and layout().capped[info.pt] then table.insert(levels, 'm:' .. info.pt) end
  count_against_budget(key ~= '' and level_hash('k:' .. key) or KEYS[1], now)
  -- with windows, its cost is taken at once with the slots (the grant says so: ' w', and which cost when it was
  -- costed again: ' w<version>')
  local took = layout().win ~= nil and info.wc ~= nil and info.wg ~= nil
  if took then window_take(key, info.wg, cjson.decode(info.wc), now) end
  redis.call('ZADD', KEYS[2], now + lease_ttl, id)
  for _, lid in ipairs(levels) do redis.call('ZADD', level_hash(lid) .. ':leases', now + lease_ttl, id) end
  local granted = redis.call('HINCRBY', KEYS[1], 'granted', 1)
  -- who holds it (for the status listing): workspace, levels, conversation, model, key, star, transport, since,
  -- and the grant's number (grants in one millisecond listed in the order they were made, as in memory)
  redis.call('HSET', BASE .. 'lmap', id, cjson.encode({w = info.w, l = levels, c = info.c, md = info.md, k = key,
    s = string.sub(info.m, 1, 1) == '0', tr = info.tr, t = now, g = granted, wc = took and info.wc or nil,
    wg = took and info.wg or nil}))
  redis.call('HINCRBY', BASE .. 'wsheld', info.w, 1)
  -- "lease granted_at key", then ' w<version>' if it took its window cost ('-' if not, before what held it), then
  -- what held it
  local grant_text = id .. ' ' .. now .. ' ' .. key .. (took and (' w' .. (info.wv or '')) or '')
  local held = held_code(info)
  if held ~= '' then grant_text = grant_text .. (took and ' ' or ' - ') .. held end
  redis.call('HSET', KEYS[7], id, grant_text)
  if id ~= answering then redis.call('PUBLISH', channel .. info.r, id .. ' ' .. grant_text) end
end

-- Grant waiters while every level they need has room; each grant becomes a lease and a message to its replica.
local dispatch_grants

local function dispatch(now, lease_ttl, channel)
  window_wake = nil
  local count = dispatch_grants(now, lease_ttl, channel)
  if window_wake ~= nil then
    redis.call('HSET', KEYS[1], 'window_wake', f17(math.ceil(window_wake)))
  elseif layout().win ~= nil then
    redis.call('HDEL', KEYS[1], 'window_wake')
  end
  return count
end

dispatch_grants = function(now, lease_ttl, channel)
  if not configured() or num('settle_until', 0) > now then return 0 end
  if blocked_until(KEYS[1], now) > 0 then return 0 end
  local limit = limit_of()
  local pool = layout().pool
  local count = 0
  while limit == nil or in_flight() < limit do
    local candidates = {}
    for _, name in ipairs(pool) do
      local ok, free = level_room('k:' .. name, now)
      if ok then table.insert(candidates, {name, free}) end
    end
    if #pool > 0 and #candidates == 0 then break end
    local id, info, found, fitted = next_waiter(now)
    if not found then break end
    if info then
      local key = ''
      if fitted ~= nil then
        key = fitted
      elseif #pool > 0 then
        if info.kp and info.kp ~= '' then key = info.kp else key = choose_key(candidates, info.k) end
      end
      grant(id, info, key, now, lease_ttl, channel)
      count = count + 1
    end
  end
  return count
end

-- When something time-based next changes the room: the end of a pause, a hold, a cooldown or a lease.
local function next_event(now)
  local best = 0
  local function consider(t)
    if t and t > now and (best == 0 or t < best) then best = t end
  end
  consider(num('paused_until', 0))
  consider(num('held_until', 0))
  consider(num('settle_until', 0))
  if layout().win ~= nil then consider(num('window_wake', 0)) end
  for _, lid in ipairs(all_levels()) do
    consider(hnum(level_hash(lid), 'paused_until', 0))
    consider(hnum(level_hash(lid), 'held_until', 0))
  end
  local c = redis.call('ZRANGE', KEYS[3], 0, 0, 'WITHSCORES')
  if #c > 0 then consider(tonumber(c[2])) end
  local l = redis.call('ZRANGE', KEYS[2], 0, 0, 'WITHSCORES')
  if #l > 0 then consider(tonumber(l[2])) end
  return best
end

local function waiter_member(starred, prompt_ms, seq, id)
  return string.format('%d%014d%012d:%s', starred and 0 or 1, prompt_ms, seq, id)
end

-- Put a waiter's entry in the queue (and its class's), given its info.
local function queue_entry(info)
  redis.call('ZADD', KEYS[4], 0, info.m)
  if info.cl then
    redis.call('ZADD', BASE .. 'q:' .. info.cl, 0, info.m)
    redis.call('SADD', BASE .. 'classes', info.cl)
  end
end

-- The level a script's level argument names: '' is the provider's own cfg hash.
local function hash_of(lid)
  if lid == nil or lid == '' then return KEYS[1] end
  return level_hash(lid)
end
"""

PRELUDE = _HEAD + WINDOWS + _TAIL
