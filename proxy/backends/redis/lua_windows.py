"""Token windows in Lua: the buckets of :mod:`proxy.limiter.window` and the admission rules of
:mod:`proxy.limiter.windowed`, written again for the scripts, which take a request's slots and its window
costs in one atomic step. Part of the prelude every script starts with.

Keys, under the provider's hash tag (``BASE``):

- ``w:<key>\\n<group>\\n<window>``: one bucket (hash: ``cap``, ``level`` as of ``at`` (ms; before ``at``, a
  window hit's time, it is empty and ``level`` is what it holds at ``at``), ``limit`` and ``source`` in
  force, ``reserved``, ``held`` (requests that waited on it), ``takes``); ``...:r`` the amounts it took over
  the last two minutes (zset by time), for ``correct``. ``<key>`` is the pool key, or empty for the provider
  itself.
- ``wpairs``: the (key, group) pairs that have buckets, scored by last use (``wuse`` counts uses); beyond
  ``MAX_GROUPS`` an idle pair is forgotten first, as in memory.
- ``wlearn``: limits learned from answers, ``whits``: window 429s, both by bucket id.

The windows' settings (the provider's, its model patterns', its keys', ``learn``, ``h`` the headroom) are the
cfg field ``windows`` (JSON from CONFIGURE; absent: no window is held). Times are Redis's ms, so a rate is
per ms: ``cap / 60000``. ``tests/backends/test_policy_vs_lua.py`` runs the same bucket operations through
``window.Bucket`` and these functions and compares the levels and waits.
"""

__all__ = ["WINDOWS"]

WINDOWS = r"""
local WINDOW_NAMES = {'input_tokens_per_minute', 'output_tokens_per_minute', 'tokens_per_minute',
  'requests_per_minute'}
local REFILL_MS, SLACK_MS, RECENT_MS, MAX_GROUPS, RESERVED_RESIDUE = 60000, 1, 120000, 512, 1e-6

local function f17(x) return string.format('%.17g', x) end

local function win_settings() return layout().win end

local function member_id(member) return string.sub(member, string.find(member, ':', 1, true) + 1) end

local function bucket_hash(wid) return BASE .. 'w:' .. wid end

local function bucket_read(wid, name)
  local hash = bucket_hash(wid)
  local v = redis.call('HMGET', hash, 'cap', 'level', 'at', 'limit')
  if not v[1] then return nil end
  return {hash = hash, wid = wid, name = name, cap = tonumber(v[1]), level = tonumber(v[2]), at = tonumber(v[3]),
    limit = tonumber(v[4])}
end

local function bucket_rate(b) return b.cap / REFILL_MS end

local function bucket_level(b, now)
  local elapsed = now - b.at
  if elapsed < 0 then return math.min(b.level, 0) end
  if elapsed == 0 then return b.level end
  return math.min(b.cap, b.level + bucket_rate(b) * elapsed)
end

local function bucket_sync(b, now)
  if now > b.at then
    b.level = bucket_level(b, now)
    b.at = now
  end
end

local function bucket_save(b)
  redis.call('HSET', b.hash, 'cap', f17(b.cap), 'level', f17(b.level), 'at', f17(b.at))
end

-- Window.Bucket.wait_for, in ms: more than the whole capacity waits for a full bucket; room a millisecond's
-- refill would make counts as there, and a wait lasts until the whole amount is.
local function bucket_wait(b, amount, now)
  local need = math.min(amount, b.cap)
  local start = math.max(now, b.at)
  local missing = need - bucket_level(b, start)
  if missing <= bucket_rate(b) * SLACK_MS then return start - now end
  return start - now + missing / bucket_rate(b)
end

local function bucket_take(b, amount, now)
  bucket_sync(b, now)
  b.level = b.level - amount
  local n = redis.call('HINCRBY', b.hash, 'takes', 1)
  redis.call('ZADD', b.hash .. ':r', f17(now), n .. ':' .. f17(amount))
  redis.call('ZREMRANGEBYSCORE', b.hash .. ':r', '-inf', '(' .. f17(now - RECENT_MS))
end

local function bucket_give(b, amount, now)
  bucket_sync(b, now)
  b.level = math.min(b.cap, b.level + amount)
end

-- Bucket.empty_until: nothing before untl, then (at most the capacity) at untl; a later hit's time is kept.
local function bucket_empty_until(b, untl, now, then_)
  bucket_sync(b, now)
  local room = 0
  if then_ and then_ > 0 and untl > now then room = math.min(then_, b.cap) end
  if b.at > untl then
    b.level = math.min(b.level, room)
    return
  end
  if room > 0 then b.level = room else b.level = math.min(b.level, 0) end
  b.at = math.max(untl, now)
end

-- Bucket.correct: the provider's count is of its whole limit, so the headroom (limit - cap) comes off it too.
-- True when it lowered the level.
local function bucket_correct(b, remaining, slack, now)
  bucket_sync(b, now)
  remaining = remaining - ((b.limit or b.cap) - b.cap)
  if b.at > now then remaining = remaining + bucket_rate(b) * (b.at - now) end
  if b.level > remaining + slack then
    b.level = remaining - slack
    return true
  end
  return false
end

-- _Window.rebased_at: when the provider's word last lowered the bucket (-inf: never); rebase only moves it later.
local function bucket_rebased_at(b) return tonumber(redis.call('HGET', b.hash, 'rebased')) or -math.huge end

local function bucket_rebase(b, at)
  if at > bucket_rebased_at(b) then redis.call('HSET', b.hash, 'rebased', f17(at)) end
end

local function bucket_taken_since(b, since)
  local total = 0
  for _, entry in ipairs(redis.call('ZRANGEBYSCORE', b.hash .. ':r', '(' .. f17(since), '+inf')) do
    total = total + tonumber(string.sub(entry, string.find(entry, ':', 1, true) + 1))
  end
  return total
end

local function capacity(limit, headroom) return limit * (1.0 - headroom) end

-- Bucket.set_limit: what was spent stays spent; a debt stays; never above the new capacity. True if changed.
local function bucket_set_limit(b, limit, headroom, now)
  bucket_sync(b, now)
  local cap = capacity(limit, headroom)
  b.limit = limit
  if cap == b.cap then return false end
  b.level = math.max(b.level + cap - b.cap, math.min(b.level, 0))
  b.cap = cap
  return true
end

-- WindowBook._limits: name -> {limit, source}; config (provider, model pattern, key), then what was learned.
local function window_limits(key, group)
  local win = win_settings()
  local limits = {}
  local function apply(entries)
    if type(entries) ~= 'table' then return end
    for name, limit in pairs(entries) do limits[name] = {limit, 'config'} end
  end
  apply(win.p)
  if type(win.m) == 'table' then apply(win.m[group]) end
  if key ~= '' and type(win.k) == 'table' then apply(win.k[key]) end
  if win.learn then
    for _, name in ipairs(WINDOW_NAMES) do
      local learned = redis.call('HGET', BASE .. 'wlearn', key .. '\n' .. group .. '\n' .. name)
      if learned then
        learned = tonumber(learned)
        local configured = limits[name]
        if configured == nil then limits[name] = {learned, 'headers'}
        else limits[name] = {math.min(learned, configured[1]), 'both'} end
      end
    end
  end
  return limits
end

local function bucket_new(wid, name, entry, now)
  local cap = capacity(entry[1], win_settings().h or 0)
  redis.call('HSET', bucket_hash(wid), 'cap', f17(cap), 'level', f17(cap), 'at', f17(now), 'limit', entry[1],
    'source', entry[2], 'reserved', 0, 'held', 0, 'takes', 0)
  return {hash = bucket_hash(wid), wid = wid, name = name, cap = cap, level = cap, at = now, limit = entry[1]}
end

local function pair_buckets(pid)
  local set = {}
  for _, name in ipairs(WINDOW_NAMES) do
    local b = bucket_read(pid .. '\n' .. name, name)
    if b then table.insert(set, b) end
  end
  return set
end

local function bucket_drop(wid)
  redis.call('DEL', bucket_hash(wid), bucket_hash(wid) .. ':r')
end

-- WindowBook._forget_idle: the least recently used pair whose buckets are full with nothing reserved.
local function forget_idle(now, keep)
  for _, pid in ipairs(redis.call('ZRANGE', BASE .. 'wpairs', 0, -1)) do
    if pid ~= keep then
      local idle = true
      for _, b in ipairs(pair_buckets(pid)) do
        local reserved = tonumber(redis.call('HGET', b.hash, 'reserved') or '0') or 0
        if reserved > 0 or bucket_level(b, now) < b.cap then idle = false end
      end
      if idle then
        redis.call('ZREM', BASE .. 'wpairs', pid)
        for _, name in ipairs(WINDOW_NAMES) do
          bucket_drop(pid .. '\n' .. name)
          redis.call('HDEL', BASE .. 'wlearn', pid .. '\n' .. name)
          redis.call('HDEL', BASE .. 'whits', pid .. '\n' .. name)
        end
        return
      end
    end
  end
end

-- WindowBook._windows: the buckets of (key, group), made on first use, in window order.
local function window_set(key, group, now)
  local pid = key .. '\n' .. group
  local known = redis.call('ZSCORE', BASE .. 'wpairs', pid)
  redis.call('ZADD', BASE .. 'wpairs', redis.call('INCR', BASE .. 'wuse'), pid)
  if known then return pair_buckets(pid) end
  local limits = window_limits(key, group)
  local set = {}
  for _, name in ipairs(WINDOW_NAMES) do
    if limits[name] then table.insert(set, bucket_new(pid .. '\n' .. name, name, limits[name], now)) end
  end
  if redis.call('ZCARD', BASE .. 'wpairs') > MAX_GROUPS then forget_idle(now, pid) end
  return set
end

local function window_of(key, group, name, now)
  for _, b in ipairs(window_set(key, group, now)) do
    if b.name == name then return b end
  end
  return nil
end

-- WindowBook._refresh: each bucket of an existing pair takes the limit in force; true when the room changed.
local function window_refresh(key, group, now)
  local pid = key .. '\n' .. group
  if not redis.call('ZSCORE', BASE .. 'wpairs', pid) then return false end
  local limits = window_limits(key, group)
  local headroom = win_settings().h or 0
  local changed = false
  for _, name in ipairs(WINDOW_NAMES) do
    local wid = pid .. '\n' .. name
    local b = bucket_read(wid, name)
    local entry = limits[name]
    if b and entry == nil then
      bucket_drop(wid)
      changed = true
    elseif b then
      if bucket_set_limit(b, entry[1], headroom, now) then changed = true end
      bucket_save(b)
      redis.call('HSET', b.hash, 'limit', entry[1], 'source', entry[2])
    elseif entry then
      bucket_new(wid, name, entry, now)
      changed = true
    end
  end
  return changed
end

local function window_refresh_all(now)
  for _, pid in ipairs(redis.call('ZRANGE', BASE .. 'wpairs', 0, -1)) do
    local cut = string.find(pid, '\n', 1, true)
    window_refresh(string.sub(pid, 1, cut - 1), string.sub(pid, cut + 1), now)
  end
end

-- Every window's state goes (the provider holds no window any more).
local function windows_drop()
  for _, pid in ipairs(redis.call('ZRANGE', BASE .. 'wpairs', 0, -1)) do
    for _, name in ipairs(WINDOW_NAMES) do bucket_drop(pid .. '\n' .. name) end
  end
  redis.call('DEL', BASE .. 'wpairs', BASE .. 'wuse', BASE .. 'wlearn', BASE .. 'whits')
end

-- WindowBook.wait_for: ms until every window of (key, group) has room for cost (0: now).
local function window_wait(key, group, cost, now)
  local wait = 0
  for _, b in ipairs(window_set(key, group, now)) do
    local amount = cost[b.name]
    if amount and amount ~= 0 then wait = math.max(wait, bucket_wait(b, amount, now)) end
  end
  return wait
end

-- ProviderWindows.fit: the key a request with this cost may take now and 0, else nil and the ms until the
-- earliest of its windows has room (math.huge: no key has a slot free to wait for).
local function window_fit(pinned, preferred, group, cost, now)
  local pool = layout().pool
  if #pool == 0 then return '', window_wait('', group, cost, now) end
  if pinned ~= '' then return pinned, window_wait(pinned, group, cost, now) end
  local candidates, wait = {}, math.huge
  for _, name in ipairs(pool) do
    local ok, free = level_room('k:' .. name, now)
    if ok then
      local key_wait = window_wait(name, group, cost, now)
      if key_wait <= 0 then table.insert(candidates, {name, free})
      elseif key_wait < wait then wait = key_wait end
    end
  end
  if #candidates > 0 then return choose_key(candidates, preferred), 0 end
  return nil, wait
end

-- When the earliest held head will have room (ms), found by the current dispatch.
local window_wake = nil
-- The windows holding a head in the current dispatch (ProviderWindows.blocked): a later head needing one of
-- them waits behind it.
local window_blocked = {}

-- ProviderWindows.hold: the windows holding this head, each counted once per waiter, kept with the waiter
-- (``hb``) for status; and when dispatch must run again.
local function window_hold(id, info, pinned, group, wait, now)
  local cost = cjson.decode(info.wc)
  local held = {}
  local function blocked(key)
    for _, b in ipairs(window_set(key, group, now)) do
      local amount = cost[b.name]
      if amount and amount ~= 0 and bucket_wait(b, amount, now) > 0 then table.insert(held, b.wid) end
    end
  end
  local pool = layout().pool
  if #pool == 0 then blocked('')
  elseif pinned ~= '' then blocked(pinned)
  else
    for _, name in ipairs(pool) do
      if level_room('k:' .. name, now) then blocked(name) end
    end
  end
  local before = {}
  for _, wid in ipairs(info.hb or {}) do before[wid] = true end
  for _, wid in ipairs(held) do
    window_blocked[wid] = true
    if not before[wid] then redis.call('HINCRBY', bucket_hash(wid), 'held', 1) end
  end
  if table.concat(held, '\0') ~= table.concat(info.hb or {}, '\0') then
    info.hb = held
    redis.call('HSET', KEYS[5], id, cjson.encode(info))
  end
  if wait < math.huge and (window_wake == nil or now + wait < window_wake) then window_wake = now + wait end
end

-- The windows that held a waiter last (its ``hb``), as its grant names them: a JSON list of [key, window]
-- (key '' for the provider's own windows), put in words by holding.window_words.
local function windows_held(hb)
  local held = {}
  for _, wid in ipairs(hb) do
    table.insert(held, {string.match(wid, '^([^\n]*)\n'), string.match(wid, '\n([^\n]*)$')})
  end
  return cjson.encode(held)
end

-- ProviderWindows.behind_held: whether a head that fits needs a window an earlier head is held by.
local function window_behind_held(key, group, cost, now)
  if next(window_blocked) == nil then return false end
  for name, amount in pairs(cost) do
    if amount ~= 0 and window_blocked[key .. '\n' .. group .. '\n' .. name] then return true end
  end
  return false
end

-- WindowBook.take: a request is sent; its cost is spent, and reserved until it ends.
local function window_take(key, group, cost, now)
  for _, b in ipairs(window_set(key, group, now)) do
    local amount = cost[b.name]
    if amount and amount ~= 0 then
      bucket_take(b, amount, now)
      bucket_save(b)
      redis.call('HSET', b.hash, 'reserved', f17(tonumber(redis.call('HGET', b.hash, 'reserved') or '0') + amount))
    end
  end
end

-- WindowBook.ended: a request ended; nothing is given back, its cost is no longer reserved.
window_ended = function(key, group, raw_cost)
  local cost = cjson.decode(raw_cost)
  for _, b in ipairs(pair_buckets(key .. '\n' .. group)) do
    local amount = cost[b.name]
    if amount and amount ~= 0 then
      local reserved = tonumber(redis.call('HGET', b.hash, 'reserved') or '0') - amount
      redis.call('HSET', b.hash, 'reserved', f17(math.max(0, reserved)))
    end
  end
end

-- The window rows of status (every pair, in use order), with the waiters each window holds now: every
-- waiter of a class whose head it holds.
local function window_rows(now)
  if win_settings() == nil then return '' end
  local holding = {}
  for _, class in ipairs(redis.call('SMEMBERS', BASE .. 'classes')) do
    local head = redis.call('ZRANGE', BASE .. 'q:' .. class, 0, 0)
    if #head > 0 then
      local raw = redis.call('HGET', KEYS[5], member_id(head[1]))
      local info = raw and cjson.decode(raw)
      if info and info.hb then
        local waiting = redis.call('ZCARD', BASE .. 'q:' .. class)
        for _, wid in ipairs(info.hb) do holding[wid] = (holding[wid] or 0) + waiting end
      end
    end
  end
  local rows = {}
  for _, pid in ipairs(redis.call('ZRANGE', BASE .. 'wpairs', 0, -1)) do
    local cut = string.find(pid, '\n', 1, true)
    for _, b in ipairs(pair_buckets(pid)) do
      local v = redis.call('HMGET', b.hash, 'limit', 'source', 'reserved', 'held')
      table.insert(rows, {k = string.sub(pid, 1, cut - 1), g = string.sub(pid, cut + 1), w = b.name,
        limit = tonumber(v[1]), source = v[2], available = math.floor(bucket_level(b, now)),
        reserved = math.ceil((tonumber(v[3]) or 0) - RESERVED_RESIDUE), held = holding[b.wid] or 0,
        held_total = tonumber(v[4]) or 0,
        hits = tonumber(redis.call('HGET', BASE .. 'whits', b.wid) or '0')})
    end
  end
  return cjson.encode(rows)
end
"""
