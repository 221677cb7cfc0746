"""A request's cost per token window, estimated before it is sent and learned from the answers."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

from proxy.http.windows import parsed_request
from proxy.providers.estimate import (
    INPUT_WINDOW,
    OUTPUT_WINDOW,
    PRIOR_RATIO,
    RATIO_MIN_BYTES,
    REQUESTS_WINDOW,
    TOKENS_WINDOW,
    Estimate,
    Estimator,
    RequestBody,
    actual_for,
    admitted_for,
)

ANTHROPIC = (INPUT_WINDOW, OUTPUT_WINDOW, REQUESTS_WINDOW)
OPENAI = (TOKENS_WINDOW, REQUESTS_WINDOW)
TOOLS = [{"name": "read_file", "description": "Reads a file. " * 200,
          "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}}}]
SYSTEM = "You are a careful engineer working in a large repository. " * 150
SONNET = "claude-sonnet-4-5"


def breakpoint(text: str, ttl: str | None = None) -> dict[str, Any]:
    mark: dict[str, Any] = {"type": "ephemeral"}
    if ttl:
        mark["ttl"] = ttl
    return {"type": "text", "text": text, "cache_control": mark}


def body(messages: list[dict[str, Any]], *, system: Any = None, tools: Any = None, max_tokens: int = 4096,
         **extra: Any) -> bytes:
    request: dict[str, Any] = {"model": SONNET, "max_tokens": max_tokens, "messages": messages, **extra}
    if system is not None:
        request["system"] = system
    if tools is not None:
        request["tools"] = tools
    return json.dumps(request, separators=(",", ":")).encode()


def first_turn(ttl: str | None = None, question: str = "Where is the config loaded?") -> bytes:
    return body([{"role": "user", "content": [breakpoint(question * 40, ttl)]}],
                system=[breakpoint(SYSTEM, ttl)], tools=TOOLS)


def next_turn(question: str = "Where is the config loaded?") -> bytes:
    return body([{"role": "user", "content": question * 40},
                 {"role": "assistant", "content": "In proxy/config/loader.py. " * 30},
                 {"role": "user", "content": [breakpoint("And where is it validated? " * 20)]}],
                system=[breakpoint(SYSTEM)], tools=TOOLS)


def estimate(estimator: Estimator, data: bytes, *, now: float = 0.0, key: str | None = "team-a",
             group: str = "claude-sonnet-*", dialect: str = "anthropic", windows: tuple[str, ...] = ANTHROPIC,
             request: dict[str, Any] | None = None, continuation: tuple[int, int] | None = None) -> Estimate:
    return estimator.estimate(dialect=dialect, key=key, group=group, body=data, request=request,
                              windows=windows, continuation=continuation, now=now)


def answer(estimator: Estimator, made: Estimate, *, now: float = 1.0, key: str | None = "team-a",
           group: str = "claude-sonnet-*", input_tokens: int | None = None, cached_read: int = 0,
           cache_write: int | None = None, output_tokens: int = 200) -> None:
    tokens = round(made.input) if input_tokens is None else input_tokens
    estimator.learn(key=key, group=group, estimate=made, input_tokens=tokens, cached_read=cached_read,
                    output_tokens=output_tokens, now=now,
                    cache_write=tokens - cached_read if cache_write is None else cache_write)


def test_prior_ratio_and_output_before_any_answer() -> None:
    estimator = Estimator()
    data = body([{"role": "user", "content": "x" * 1000}], max_tokens=8000)
    made = estimate(estimator, data)
    assert made.input_bytes == len(data)
    assert made.input == pytest.approx(len(data) * 0.30)
    assert made.cost == {INPUT_WINDOW: made.input, OUTPUT_WINDOW: 8000.0, REQUESTS_WINDOW: 1.0}
    assert made.cache_read == 0.0
    no_max = estimate(estimator, json.dumps({"model": "gpt-4.1", "input": "hi"}).encode(), dialect="openai",
                      windows=(OUTPUT_WINDOW,))
    assert no_max.output == 1024.0
    assert estimator.status("team-a", "claude-sonnet-*") == {
        "ratio": 0.30, "estimate_error_p50": None, "estimate_error_p90": None}


def test_only_the_windows_asked_for_are_costed_and_requests_cost_one() -> None:
    made = estimate(Estimator(), b"not json at all", windows=(REQUESTS_WINDOW,))
    assert made.cost == {REQUESTS_WINDOW: 1.0}


def test_the_learned_ratio_is_a_recent_p90() -> None:
    estimator = Estimator()
    data = b"x" * 10_000
    for ratio in (0.20, 0.21, 0.22, 0.23, 0.24, 0.25, 0.26, 0.27, 0.28, 0.29):
        made = estimate(estimator, data, windows=(INPUT_WINDOW,))
        answer(estimator, made, input_tokens=round(ratio * 10_000))
    assert estimator.status(None, "claude-sonnet-*")["ratio"] == pytest.approx(0.28)
    assert estimate(estimator, data, windows=(INPUT_WINDOW,)).cost[INPUT_WINDOW] == pytest.approx(2800)
    for _ in range(50):  # only the last 50 answers count
        answer(estimator, estimate(estimator, data, windows=(INPUT_WINDOW,)), input_tokens=1000)
    assert estimator.status(None, "claude-sonnet-*")["ratio"] == pytest.approx(0.10)
    assert estimator.status(None, "claude-opus-*")["ratio"] == 0.30  # another group learns its own


def test_a_window_hit_raises_the_ratio_boundedly_and_it_eases_back() -> None:
    estimator = Estimator()
    estimator.raise_ratio("team-a", "g")
    assert estimator.status("team-a", "g")["ratio"] == pytest.approx(0.30 * 1.25)
    for _ in range(10):
        estimator.raise_ratio("team-a", "g")
    assert estimator.status("team-a", "g")["ratio"] == pytest.approx(0.60)
    made = estimate(estimator, b"x" * 1000, group="g", windows=(INPUT_WINDOW,))
    assert made.input == pytest.approx(600)
    for _ in range(40):
        answer(estimator, estimate(estimator, b"x" * 1000, group="g"), group="g", input_tokens=300)
    assert estimator.status("team-a", "g")["ratio"] == pytest.approx(0.30, rel=0.02)


def test_a_small_body_teaches_no_ratio_and_the_next_long_prompt_is_estimated_from_the_prior() -> None:
    """A probe's "hi" is mostly JSON that counts no token: learned, it would have a long prompt estimated at a
    fraction of its tokens; its output still counts."""
    estimator = Estimator()
    probe = body([{"role": "user", "content": "hi"}], max_tokens=16)
    assert len(probe) < RATIO_MIN_BYTES
    for _ in range(5):
        answer(estimator, estimate(estimator, probe), input_tokens=8, output_tokens=3)
    assert estimator.status("team-a", "claude-sonnet-*")["ratio"] == PRIOR_RATIO
    long = body([{"role": "user", "content": "x" * 16_000}])
    assert estimate(estimator, long).input == pytest.approx(len(long) * PRIOR_RATIO)
    answer(estimator, estimate(estimator, long), input_tokens=4000)
    assert estimator.status("team-a", "claude-sonnet-*")["ratio"] == pytest.approx(4000 / len(long))


def test_what_the_provider_charges_when_it_admits_a_request() -> None:
    """Anthropic counts the prompt it is sent (less cache reads) and the output as it is produced; OpenAI's tokens
    window the larger of the maximum output asked and the input; a request, one."""
    assert admitted_for(INPUT_WINDOW, 1000, 600, 4096) == 400
    assert admitted_for(OUTPUT_WINDOW, 1000, 600, 4096) == 0
    assert admitted_for(TOKENS_WINDOW, 1000, 0, 4096) == 4096
    assert admitted_for(TOKENS_WINDOW, 1000, 0, None) == 1000
    assert admitted_for(REQUESTS_WINDOW, 1000, 0, None) == 1
    assert estimate(Estimator(), body([], max_tokens=321), windows=OPENAI, dialect="openai").asked == 321


def test_estimate_errors_per_window_and_of_the_input() -> None:
    estimator = Estimator()
    made = estimate(estimator, b"x" * 4000, windows=(INPUT_WINDOW, OUTPUT_WINDOW), request={"max_tokens": 400})
    answer(estimator, made, input_tokens=1800, output_tokens=100)
    assert estimator.status("team-a", "claude-sonnet-*") == {
        "ratio": pytest.approx(0.45), "estimate_error_p50": pytest.approx(0.5),
        "estimate_error_p90": pytest.approx(0.5)}
    assert estimator.status("team-a", "claude-sonnet-*", OUTPUT_WINDOW)["estimate_error_p50"] == \
        pytest.approx(100 / 400 - 1)


def test_output_is_the_recent_p90_never_above_the_requests_maximum() -> None:
    estimator = Estimator()
    for produced in range(100, 1100, 100):
        answer(estimator, estimate(estimator, body([], max_tokens=4096)), output_tokens=produced)
    assert estimate(estimator, body([], max_tokens=4096)).cost[OUTPUT_WINDOW] == 900.0
    assert estimate(estimator, body([], max_tokens=500)).cost[OUTPUT_WINDOW] == 500.0
    frame = {"type": "response.create", "response": {"model": "gpt-5", "max_output_tokens": 300}}
    assert estimate(estimator, json.dumps(frame).encode(), dialect="openai",
                    windows=(OUTPUT_WINDOW,)).output == 300.0
    chat = {"model": "gpt-4.1", "max_completion_tokens": 250, "messages": []}
    assert estimate(estimator, json.dumps(chat).encode(), dialect="openai",
                    windows=(OUTPUT_WINDOW,)).output == 250.0


def test_a_parsed_request_is_used_as_given() -> None:
    made = estimate(Estimator(), b"{truncated", request={"max_tokens": 77}, windows=(OUTPUT_WINDOW,))
    assert made.output == 77.0


def test_openai_tokens_per_minute_is_the_larger_of_maximum_output_and_input() -> None:
    estimator = Estimator()
    data = json.dumps({"model": "gpt-4.1", "messages": [{"role": "user", "content": "y" * 3000}],
                       "max_completion_tokens": 2000}).encode()
    made = estimate(estimator, data, dialect="openai", windows=OPENAI, group="gpt-4.1")
    assert made.cost == {TOKENS_WINDOW: 2000.0, REQUESTS_WINDOW: 1.0}
    small = estimate(estimator, data, dialect="openai", windows=OPENAI, group="gpt-4.1",
                     request={"max_completion_tokens": 10})
    assert small.cost[TOKENS_WINDOW] == pytest.approx(len(data) * 0.30)
    no_max = estimate(estimator, data, dialect="openai", windows=OPENAI, group="gpt-4.1", request={})
    assert no_max.cost[TOKENS_WINDOW] == pytest.approx(len(data) * 0.30 + 1024)


def test_openai_reads_no_cache_discount() -> None:
    estimator = Estimator()
    answer(estimator, estimate(estimator, first_turn(), dialect="openai", windows=(INPUT_WINDOW,)))
    again = estimate(estimator, first_turn(), dialect="openai", windows=(INPUT_WINDOW,), now=2.0)
    assert again.cache_read == 0.0 and again.cost[INPUT_WINDOW] == pytest.approx(again.input)


def test_a_websocket_continuation_adds_the_previous_responses_tokens() -> None:
    estimator = Estimator()
    frame = json.dumps({"type": "response.create", "model": "gpt-5", "previous_response_id": "resp_1",
                        "input": [{"role": "user", "content": "and now the tests"}]}).encode()
    made = estimate(estimator, frame, dialect="openai", windows=OPENAI, group="gpt-5", continuation=(5000, 800))
    assert made.input == pytest.approx(5800 + len(frame) * 0.30)
    assert made.cost[TOKENS_WINDOW] == pytest.approx(made.input + 1024)
    answer(estimator, made, group="gpt-5", input_tokens=6000)
    assert estimator.status(None, "gpt-5")["ratio"] == 0.30  # a frame's bytes are not the input counted


def test_actual_for_counts_each_window_as_the_provider_does() -> None:
    # input_tokens as TokenCounts has it: 1000 uncached + 5000 read + 2000 written
    assert actual_for("anthropic", INPUT_WINDOW, 8000, 5000, 2000, 300) == 3000.0
    assert actual_for("anthropic", OUTPUT_WINDOW, 8000, 5000, 2000, 300) == 300.0
    assert actual_for("openai", TOKENS_WINDOW, 8000, 5000, 0, 300) == 8300.0
    assert actual_for("openai", REQUESTS_WINDOW, 8000, 5000, 0, 300) == 1.0
    assert Estimator.actual_for("anthropic", REQUESTS_WINDOW, 0, 0, 0, 0) == 1.0
    with pytest.raises(ValueError, match="unknown token window 'tokens_per_hour': the windows are"):
        actual_for("openai", "tokens_per_hour", 1, 0, 0, 1)


def test_an_unknown_window_or_dialect_is_refused_in_words() -> None:
    with pytest.raises(ValueError, match="unknown token window 'itpm'"):
        estimate(Estimator(), b"{}", windows=("itpm",))
    with pytest.raises(ValueError, match="unknown provider dialect 'gemini': it is 'anthropic' or 'openai'"):
        estimate(Estimator(), b"{}", dialect="gemini")


def test_a_conversations_next_turn_costs_only_what_is_new() -> None:
    estimator = Estimator()
    first = estimate(estimator, first_turn())
    assert first.cache_read == 0.0
    answer(estimator, first)
    second_body = next_turn()
    second = estimate(estimator, second_body, now=30.0)
    written = len(first_turn()) * 0.30
    assert written * 0.9 < second.cache_read <= written
    assert second.cost[INPUT_WINDOW] == pytest.approx(second.input - second.cache_read)
    assert second.cost[INPUT_WINDOW] < (len(second_body) - len(first_turn())) * 0.30 + 0.1 * written


def test_a_new_session_reads_the_tools_and_system_another_session_wrote() -> None:
    estimator = Estimator()
    answer(estimator, estimate(estimator, first_turn()))
    other = estimate(estimator, first_turn(question="Why does the queue stall? "), now=60.0)
    shared = len(json.dumps(TOOLS)) * 0.30 + len(SYSTEM) * 0.30
    assert shared * 0.95 < other.cache_read < shared * 1.05
    elsewhere = estimate(estimator, first_turn(question="Why does the queue stall? "), now=60.0, key="team-b")
    assert elsewhere.cache_read == 0.0  # each key has its own cache
    changed = body([{"role": "user", "content": [breakpoint("hi " * 2000)]}],
                   system=[breakpoint(SYSTEM + "Be brief.")], tools=TOOLS)
    assert estimate(estimator, changed, now=60.0).cache_read == 0.0  # the tools alone were no breakpoint
    marked_tools = [dict(TOOLS[0], description="Reads a file. " * 400, cache_control={"type": "ephemeral"})]
    answer(estimator, estimate(estimator, body([], system=SYSTEM, tools=marked_tools), now=61.0), now=62.0)
    changed = body([{"role": "user", "content": [breakpoint("hi " * 2000)]}],
                   system=[breakpoint(SYSTEM + "Be brief.")], tools=marked_tools)
    tools_only = len(json.dumps(marked_tools[0])) * 0.30
    assert tools_only * 0.95 < estimate(estimator, changed, now=63.0).cache_read < tools_only * 1.05


def test_nothing_is_read_before_the_answer_that_wrote_it() -> None:
    estimator = Estimator()
    estimate(estimator, first_turn())
    assert estimate(estimator, first_turn(), now=0.5).cache_read == 0.0  # sent alongside: both write


def test_an_answer_that_used_no_cache_remembers_nothing() -> None:
    estimator = Estimator()
    answer(estimator, estimate(estimator, first_turn()), cache_write=0, cached_read=0)
    assert estimate(estimator, first_turn(), now=2.0).cache_read == 0.0


def test_a_read_the_answer_denies_is_forgotten() -> None:
    estimator = Estimator()
    answer(estimator, estimate(estimator, first_turn()))
    believed = estimate(estimator, next_turn(), now=10.0)
    assert believed.cache_read > 0
    answer(estimator, believed, now=11.0, cached_read=0, cache_write=0)
    assert estimate(estimator, next_turn(), now=12.0).cache_read == 0.0


def test_a_prefix_expires_after_five_minutes() -> None:
    in_time, too_late = Estimator(), Estimator()
    for estimator in (in_time, too_late):
        answer(estimator, estimate(estimator, first_turn()), now=1.0)
    assert estimate(in_time, next_turn(), now=1.0 + 299.0).cache_read > 0
    assert estimate(too_late, next_turn(), now=1.0 + 301.0).cache_read == 0.0


def test_a_one_hour_prefix_is_renewed_when_read() -> None:
    estimator = Estimator()
    answer(estimator, estimate(estimator, first_turn(ttl="1h")), now=0.0)
    assert estimate(estimator, first_turn(ttl="1h"), now=3500.0).cache_read > 0  # renewed until 7100
    assert estimate(estimator, first_turn(ttl="1h"), now=7000.0).cache_read > 0
    unread = Estimator()
    answer(unread, estimate(unread, first_turn(ttl="1h")), now=0.0)
    assert estimate(unread, first_turn(ttl="1h"), now=3601.0).cache_read == 0.0


def test_a_prefix_too_short_to_cache_is_not_read() -> None:
    estimator = Estimator()
    short = body([{"role": "user", "content": [breakpoint("hello")]}], system=[breakpoint("Be brief.")])
    answer(estimator, estimate(estimator, short))
    assert estimate(estimator, short, now=2.0).cache_read == 0.0


def test_a_prefix_further_back_than_anthropic_looks_is_not_read() -> None:
    estimator = Estimator()
    answer(estimator, estimate(estimator, first_turn()))
    turns = [{"role": "user", "content": "Where is the config loaded?" * 40}]
    turns += [{"role": "assistant" if i % 2 == 0 else "user", "content": f"step {i}"} for i in range(30)]
    turns.append({"role": "user", "content": [breakpoint("and then?")]})
    marked_system = body(turns, system=[breakpoint(SYSTEM)], tools=TOOLS)
    shared = len(json.dumps(TOOLS)) * 0.30 + len(SYSTEM) * 0.30  # not the first question, 33 blocks back
    assert shared * 0.95 < estimate(estimator, marked_system, now=5.0).cache_read < shared * 1.05
    unmarked_system = body(turns, system=SYSTEM, tools=TOOLS)
    assert estimate(estimator, unmarked_system, now=5.0).cache_read == 0.0


def test_memory_is_bounded() -> None:
    estimator = Estimator(groups_kept=2, prefixes_kept=3)
    for n in range(5):
        estimator.raise_ratio(None, f"group-{n}")
    assert estimator.status(None, "group-0")["ratio"] == 0.30  # dropped, back to the prior
    assert estimator.status(None, "group-4")["ratio"] == pytest.approx(0.375)
    first = estimate(estimator, first_turn())
    answer(estimator, first)
    for n in range(3):
        answer(estimator, estimate(estimator, first_turn(question=f"question {n} " * 300)), now=2.0)
    system_only = estimate(estimator, first_turn(question="another question "), now=3.0).cache_read
    assert 0 < system_only < first.input * 0.95
    assert estimate(estimator, first_turn(), now=3.0).cache_read == pytest.approx(system_only, rel=0.01)


def test_hashing_a_long_conversation_is_quick() -> None:
    turns = [{"role": "user" if i % 2 == 0 else "assistant", "content": [{"type": "text", "text": "z" * 2000}]}
             for i in range(1000)]
    turns[-1]["content"][0]["cache_control"] = {"type": "ephemeral"}
    data = body(turns, system=[breakpoint(SYSTEM)], tools=TOOLS)
    estimator = Estimator()
    started = time.perf_counter()
    answer(estimator, estimate(estimator, data))
    assert estimate(estimator, data, now=2.0).cache_read > 0
    assert time.perf_counter() - started < 2.0


def test_blocks_compare_without_cache_control_and_whatever_their_key_order() -> None:
    estimator = Estimator()
    answer(estimator, estimate(estimator, first_turn()))
    reordered = body([{"role": "user", "content": [{"text": "Where is the config loaded?" * 40, "type": "text"}]},
                      {"role": "assistant", "content": [breakpoint("Elsewhere.")]}],
                     system=[{"cache_control": {"type": "ephemeral"}, "text": SYSTEM, "type": "text"}],
                     tools=[dict(reversed(list(TOOLS[0].items())))])
    assert estimate(estimator, reordered, now=2.0).cache_read == pytest.approx(
        len(first_turn()) * 0.30, rel=0.05)
    as_assistant = body([{"role": "assistant", "content": [breakpoint("Where is the config loaded?" * 40)]}],
                        system=[breakpoint(SYSTEM)], tools=TOOLS)
    shared = len(json.dumps(TOOLS)) * 0.30 + len(SYSTEM) * 0.30  # the same text in another role is not read
    assert estimate(estimator, as_assistant, now=2.0).cache_read == pytest.approx(shared, rel=0.05)


PNG = "iVBORw0KGgo" * 100_000  # about 1 MB of base64: a screenshot


def test_an_inline_image_counts_as_an_image_not_as_its_base64() -> None:
    estimator = Estimator()
    screenshot = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG}}
    data = body([{"role": "user", "content": [screenshot, {"type": "text", "text": "What is on screen?"}]}])
    made = estimate(estimator, data)
    assert made.images == 1 and made.input_bytes == len(data) - len(PNG)
    assert made.input == pytest.approx(made.input_bytes * 0.30 + 1600)
    chat = json.dumps({"model": "gpt-4.1", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64," + PNG}},
        {"type": "input_image", "image_url": "data:image/png;base64," + PNG},
        {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}]}]}).encode()
    openai = estimate(estimator, chat, dialect="openai", windows=OPENAI, group="gpt-4.1")
    assert openai.images == 2 and openai.input == pytest.approx(openai.input_bytes * 0.30 + 3200)


def test_the_tokens_an_image_costs_are_learned_per_group() -> None:
    estimator = Estimator()
    shot = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG}}
    data = body([{"role": "user", "content": [shot, shot, {"type": "text", "text": "Compare them."}]}])
    made = estimate(estimator, data)
    answer(estimator, made, input_tokens=round(made.input_bytes * 0.30) + 2 * 700)
    assert estimate(estimator, data, now=2.0).input == pytest.approx(made.input_bytes * 0.30 + 1400, abs=1)
    assert estimator.status(None, "claude-sonnet-*")["ratio"] == 0.30  # the text ratio is not learned from it


def test_an_image_in_a_cached_prefix_is_read_at_its_image_tokens() -> None:
    estimator = Estimator()
    shot = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG}}
    opening = [{"role": "user", "content": [shot, breakpoint("Describe it. " * 400)]}]
    first = estimate(estimator, body(opening))
    answer(estimator, first)
    later = body([*opening, {"role": "assistant", "content": "A login form."},
                  {"role": "user", "content": [breakpoint("Fill it in.")]}])
    again = estimate(estimator, later, now=5.0)
    assert again.cache_read == pytest.approx(first.input, rel=0.05)
    assert again.cost[INPUT_WINDOW] < 100


SDK_CHAT = (b'{"model":"gpt-4.1","messages":[{"role":"user","content":"hi"}],"max_tokens":64,'
            b'"temperature":0,"user":"u-1"}')
MAXIMA = [
    SDK_CHAT,
    b'{"model":"m","messages":[],"max_completion_tokens": 250 }\n',
    b'{"max_output_tokens":9,"input":"x"}',
    b'{"model":"m","max_tokens":0}',
    b'{"model":"m","max_tokens":-5}',
    b'{"model":"m","max_tokens":4.5}',
    b'{"model":"m","max_tokens":"12"}',
    b'{"model":"m","max_tokens":8,"stop":["a","}"]}',
    b'{"model":"m","metadata":{"max_tokens":7}}',
    b'{"model":"m","metadata":{"max_tokens":7},"n":1}',
    b'{"model":"m","max_tokens":5,"metadata":{"max_tokens":7}}',
    b'{"model":"m","max_tokens":5,"max_completion_tokens":9}',
    b'{"model":"m","max_tokens":5,"max_tokens":6}',
    b'{"model":"m","messages":[{"role":"user","content":"say \\"max_tokens\\":99"}],"max_tokens":3}',
    b'{"model":"m","messages":[{"role":"user","content":"\\"max_tokens\\":99}"}]}',
    b'{"type":"response.create","response":{"model":"m","max_output_tokens":300}}',
    b'{"model":"m"}',
    b'{"model":"m","max_tokens":5',
    b'[{"max_tokens":5}]',
    b'',
]


@pytest.mark.parametrize("data", MAXIMA)
def test_the_output_maximum_read_from_the_bytes_is_the_parsed_bodys(data: bytes) -> None:
    parsed = RequestBody(data)
    parsed.parsed()
    assert RequestBody(data).max_output() == parsed.max_output()
    estimator = Estimator()
    assert (estimate(estimator, data, dialect="openai", windows=OPENAI).cost
            == estimate(Estimator(), data, dialect="openai", windows=OPENAI, request=dict(parsed)).cost)


def test_an_sdk_shaped_openai_body_is_estimated_without_a_parse() -> None:
    request = RequestBody(SDK_CHAT)
    made = Estimator().estimate(dialect="openai", key=None, group="gpt-4.1", body=SDK_CHAT, request=request,
                                windows=OPENAI, now=1.0)
    assert made.cost[TOKENS_WINDOW] == pytest.approx(max(64.0, len(SDK_CHAT) * 0.30))
    assert request._data is None
    model, body = parsed_request("chat/completions", SDK_CHAT)
    assert model == "gpt-4.1"
    assert isinstance(body, RequestBody) and body._data is None
    assert parsed_request("", b'{"model":"a","x":{"model":"b"},"model":"c"}')[0] == "c"
    assert parsed_request("", b'{"type":"response.create","response":{"model":"r"}}')[0] == "r"


def test_error_percentiles_are_the_recent_estimates() -> None:
    estimator = Estimator()
    data = json.dumps({"model": "g", "messages": [{"role": "user", "content": "x" * 300}]}).encode()
    for output in range(1, 61):
        made = estimate(estimator, data, dialect="openai", windows=OPENAI, group="g")
        estimator.learn(key=None, group="g", estimate=made, input_tokens=100, cached_read=0,
                        output_tokens=output, now=1.0)
    status = estimator.status(None, "g", TOKENS_WINDOW)
    assert status["estimate_error_p50"] is not None and status["estimate_error_p90"] is not None
    assert status["estimate_error_p50"] <= status["estimate_error_p90"]


def test_a_group_used_again_is_found_without_a_lookup_and_the_least_recently_used_is_still_forgotten_first(
        ) -> None:
    """A request's estimate and the learning from its answer use the same group: the second finds it without
    a lookup (nor a move: it is already the most recently used)."""
    from collections import OrderedDict
    from typing import Any

    class Counted(OrderedDict[Any, Any]):
        looked_up = 0

        def get(self, *args: Any) -> Any:
            Counted.looked_up += 1
            return super().get(*args)

    estimator = Estimator(groups_kept=2)
    estimator._groups = Counted()
    body = json.dumps({"model": "gpt-m", "messages": [{"role": "user", "content": "h" * 4000}],
                       "max_tokens": 64}).encode()

    def answered(group: str) -> None:
        estimate = estimator.estimate(dialect="openai", key=None, group=group, body=body, request=None,
                                      windows=OPENAI, now=0.0)
        estimator.learn(key=None, group=group, estimate=estimate, input_tokens=1000, cached_read=0, output_tokens=5,
                        now=1.0)
    answered("a")
    first = Counted.looked_up
    answered("a")
    answered("a")
    assert Counted.looked_up == first, "the group last used: no lookup"
    answered("b")
    answered("a")  # b is now the least recently used
    answered("c")
    assert list(estimator._groups) == ["a", "c"]
    assert estimator.status(None, "a")["ratio"] == pytest.approx(1000 / len(body))
