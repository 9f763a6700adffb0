"""The energy guard: when a generation must stop so that its metered energy stays within what
its reservation paid for (readings, time and token counts given, no model)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from appliance.inference.energy_guard import EnergyGuard


class Readings:
    """A meter reading: the prompt's joules at the first read, then `per_token` joules for each
    token generated since."""

    def __init__(self, prompt: float, per_token: float, tokens: Iterator[int]) -> None:
        self.prompt, self.per_token, self.tokens = prompt, per_token, tokens
        self.reads = 0

    def __call__(self) -> float:
        self.reads += 1
        return self.prompt + self.per_token * next(self.tokens)


def run(guard: EnergyGuard, gap: float, start: float, n: int) -> int | None:
    """Ask the guard before each of `n` tokens, one every `gap` seconds from `start`; the
    tokens generated when it said stop (None: it never did)."""
    for k in range(n):
        if guard.stop(start + k * gap, k):
            return k
    return None


def test_it_stops_while_the_tokens_before_the_next_reading_still_fit() -> None:
    # The prompt: 1 J. Then a token every 0.125 s at 0.25 J each; readings every 0.5 s: 4 tokens
    # between readings, so the margin is 2 x 0.25 x (1 + 8 tokens/s x 0.5 s) = 2.5 J.
    generated = [0]
    guard = EnergyGuard(10.0, lambda: 1.0 + 0.25 * generated[0], started=0.0, every=0.5)
    stopped_at = None
    for k in range(100):
        generated[0] = k
        if guard.stop(0.5 + k * 0.125, k):
            stopped_at = k
            break
    assert stopped_at == 29 and guard.used == 8.25
    assert guard.used - 1.0 + 2.5 < 10.0  # the reading before did not stop it
    assert guard.used + 0.25 * 5 <= 10.0  # the tokens to the next reading would have fit
    assert all(guard.stop(100.0 + i, 1000) for i in range(3))  # once stopped, always


def test_it_reads_the_meter_at_most_every_interval() -> None:
    count = iter(range(10_000))
    read = Readings(0.0, 0.001, count)
    guard = EnergyGuard(100.0, read, started=0.0, every=0.5)
    assert run(guard, gap=0.125, start=0.0, n=80) is None  # a token every 125 ms for 10 s
    # The first ask after the prompt, the next token's, then every 0.5 s.
    assert read.reads == 2 + 19


def test_the_first_token_is_bounded_by_the_prompts_pass() -> None:
    # The prompt's pass used 9 J: the next token's pass costs at most that much, however long
    # it takes (a large model on a CPU: a token may take longer than the reading interval).
    assert EnergyGuard(17.9, lambda: 9.0, started=0.0).stop(0.9, 0)
    assert not EnergyGuard(18.1, lambda: 9.0, started=0.0).stop(0.9, 0)


def test_after_a_long_prompt_the_first_token_is_bounded_by_what_the_hold_paid_a_token() -> None:
    # An 800-token prompt used 12 J of a 20 J hold paid for 808 tokens (about 0.025 J each):
    # its whole pass would be a far too wide margin for one token; twice the paid 0.025 J is not.
    assert EnergyGuard(20.0, lambda: 12.0, started=0.0).stop(1.0, 0)  # 12 + 12 >= 20
    paid = EnergyGuard(20.0, lambda: 12.0, started=0.0, paid_tokens=808)
    assert not paid.stop(1.0, 0)
    # A short prompt's own pass is the tighter bound still.
    assert EnergyGuard(1.0, lambda: 0.45, started=0.0, paid_tokens=4).stop(0.1, 0) is False
    assert EnergyGuard(0.9, lambda: 0.45, started=0.0, paid_tokens=4).stop(0.1, 0)


def test_slow_tokens_widen_the_margin_to_a_whole_token() -> None:
    # 3 J per token, one token every 0.3 s (longer than the 0.05 s interval): after measuring
    # one, it stops while one more (x2) still fits, never reading past the limit.
    values = iter([0.5, 3.5, 6.5, 9.5, 12.5, 15.5])
    guard = EnergyGuard(14.0, lambda: next(values), started=0.0, every=0.05)
    stopped = run(guard, gap=0.3, start=0.1, n=6)
    assert stopped == 3 and guard.used == 9.5  # 9.5 + 2 x 3 x (1 + 3.3 x 0.05) >= 14
    assert guard.used + 3.0 <= guard.limit  # the next token would still have fit


def test_a_sudden_larger_stretch_widens_the_margin() -> None:
    values = iter([1.0, 1.1, 1.2, 1.3, 4.3, 4.4])
    guard = EnergyGuard(12.0, lambda: next(values), started=0.0, every=0.5)
    # Reads at tokens 0 and 1 (0.1 J/token), then every 0.5 s (one token each here).
    asks = [guard.stop(0.5 * k, k) for k in range(5)]
    assert asks == [False, False, False, False, True]
    assert guard.used == 4.3  # 4.3 + 2 x 3.0 x (1 + 2 tokens/s x 0.5 s) >= 12


def test_a_meter_that_keeps_failing_stops_the_call() -> None:
    # Unguarded, a call whose meter read again at its end was charged past its hold.
    def broken() -> float:
        raise OSError("counter gone")

    guard = EnergyGuard(1.0, broken, started=0.0)
    assert not guard.stop(0.0, 0)
    assert not guard.stop(0.001, 1)  # tried again at the next token, not after an interval
    assert guard.stop(0.002, 2) and guard.stopped


def test_a_failed_reading_is_tried_again_and_the_limit_still_holds() -> None:
    # One transient failure used to end the checks for the rest of the call: the energy then
    # rose to ten times the limit unstopped.
    readings: Iterator[float | OSError] = iter(
        [OSError("busy"), 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0]
    )

    def flaky() -> float:
        value = next(readings)
        if isinstance(value, OSError):
            raise value
        return value

    guard = EnergyGuard(1.0, flaky, started=0.0, every=0.0)
    stopped_at = run(guard, gap=0.01, start=0.0, n=10)
    assert stopped_at is not None and guard.used < 1.0


def test_the_limit_must_be_positive() -> None:
    with pytest.raises(ValueError, match="must be > 0 J"):
        EnergyGuard(0.0, lambda: 0.0, started=0.0)
