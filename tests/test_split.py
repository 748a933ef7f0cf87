"""The router's cost model (``tiered_cache.split``): whole or split, and where, from the
prompt's cached tokens, each server's running decodes and queued prefill tokens, and the
measured rates."""

from __future__ import annotations

import pytest

from tiered_cache.split import DecayingRate, Ewma, Rates, ServerView, decide

RATES = Rates(prefill_tps=4000.0, handoff_s=0.2, step_s=0.03)


def pools(p: dict[str, float] | None = None, d: dict[str, float] | None = None
          ) -> list[ServerView]:  # fmt: skip
    return [ServerView("P", "prefill", **(p or {})), ServerView("D", "decode", **(d or {}))]  # type: ignore[arg-type]


def test_a_short_prompt_is_served_whole_where_the_handoff_would_cost_more() -> None:
    # 64 uncached tokens delay the 3 running decodes 48 ms: less than a handoff.
    c = decide(pools(d={"running": 3}), 64, 48, RATES, "auto")
    assert c is not None and c.kind == "whole"


def test_a_long_prefill_goes_where_no_decode_runs() -> None:
    # 1400 uncached tokens would stall D's 4 decodes 350 ms each: P prefills it.
    c = decide(pools(d={"running": 4}), 1400, 4, RATES, "auto")
    assert c is not None and (c.prefill or c.server) == "P"


def test_a_long_answer_is_decoded_away_from_the_server_that_takes_the_prefills() -> None:
    # D runs 4 decodes (the prefill would stall them); P is sent 20k prefill tokens/s, so
    # a 200-token answer there would be stalled ~30 s in all: P prefills, D decodes.
    c = decide(pools(p={"arrival_tps": 20000.0}, d={"running": 4}), 1400, 200, RATES, "auto")
    assert c is not None and (c.kind, c.prefill, c.server) == ("split", "P", "D")
    # Where P takes few prefills, the same request stays whole on P (no handoff).
    c = decide(pools(d={"running": 4}), 1400, 200, RATES, "auto")
    assert c is not None and (c.kind, c.server) == ("whole", "P")


def test_cached_tokens_make_the_split_pointless() -> None:
    # The same long prompt, all but 30 tokens cached: nothing worth a handoff.
    servers = [ServerView("P", "prefill", cached_tokens=1370),
               ServerView("D", "decode", running=4, cached_tokens=1370)]  # fmt: skip
    c = decide(servers, 1400, 4, RATES, "auto")
    assert c is not None and c.kind == "whole" and c.uncached == 30


def test_queued_prefill_tokens_steer_away() -> None:
    c = decide(pools(p={"queued_tokens": 8000}, d={"running": 1}), 1400, 4, RATES, "auto")
    assert c is not None and (c.kind, c.server) == ("whole", "D")


@pytest.mark.parametrize("mode", ["split", "whole"])
def test_forced_modes(mode: str) -> None:
    for n in (64, 1400):
        c = decide(pools(d={"running": 4}), n, 4, RATES, mode)  # type: ignore[arg-type]
        assert c is not None and c.kind == mode


def test_replicas_only_serve_whole_and_nothing_live_decides_nothing() -> None:
    reps = [ServerView("A", "decode", running=2), ServerView("B", "decode")]
    c = decide(reps, 500, 16, RATES, "auto")
    assert c is not None and (c.kind, c.server) == ("whole", "B")
    assert decide([], 500, 16, RATES, "auto") is None
    with pytest.raises(ValueError, match="prefill_tps"):
        decide(reps, 5, 1, Rates(0.0, 0.1, 0.01), "auto")


def test_measured_rates() -> None:
    e = Ewma(4000.0)
    assert e.value == 4000.0
    e.add(1000.0)  # the first sample replaces the prior
    assert e.value == 1000.0
    e.add(2000.0)
    assert 1000.0 < e.value < 2000.0
    r = DecayingRate(tau_s=10.0)
    r.add(1000.0, now=0.0)
    assert r.rate(0.0) == pytest.approx(100.0)
    assert r.rate(10.0) == pytest.approx(100.0 / 2.718281828, rel=1e-3)
