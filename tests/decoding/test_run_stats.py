"""RunStats' spread of round times within a run (what tools/simulate_chooser.py's noise
models): exact arithmetic on given round times."""

import math
import statistics

from mlx_mtp.decoding.stats import RunStats


def test_round_spread_is_the_sd_of_log_round_times_per_width():
    stats = RunStats()
    walls = {3: [0.0150, 0.0162, 0.0149, 0.0171], 6: [0.0200, 0.0210], 1: [0.0140]}
    for w, ts in walls.items():
        for i, t in enumerate(ts):
            stats.record_round(w - 1, min(i, w - 1), t)
    spread = stats.round_spread_by_width()
    assert sorted(spread) == [3, 6]  # width 1 timed once: no spread
    for w in (3, 6):
        assert spread[w]["rounds"] == len(walls[w])
        want = statistics.stdev(math.log(t) for t in walls[w])
        assert abs(spread[w]["log_sd"] - want) < 1e-12
    assert stats.to_dict()["round_spread_by_width"] == {
        "3": spread[3], "6": spread[6]}


def test_equal_round_times_have_no_spread_and_a_zero_time_is_not_counted():
    stats = RunStats()
    for _ in range(3):
        stats.record_round(1, 1, 0.01)
    stats.record_round(1, 0, 0.0)  # a clock that did not move: no log to take
    assert stats.round_spread_by_width() == {2: {"rounds": 3, "log_sd": 0.0}}
    assert stats.rounds == 4


def test_pipelined_steps_count_in_the_run_but_not_in_the_spread():
    stats = RunStats()
    for t in (0.0138, 0.0140, 0.0011):  # read-to-read times of pipelined steps: no own time
        stats.record_round(0, 0, t, own_time=False)
    stats.record_round(0, 0, 0.0150)
    stats.record_round(0, 0, 0.0160)
    assert stats.rounds == 5 and stats.block_sizes == {1: 5}
    assert abs(stats.rounds_s - (0.0138 + 0.0140 + 0.0011 + 0.0150 + 0.0160)) < 1e-15
    spread = stats.round_spread_by_width()
    assert spread[1]["rounds"] == 2
    assert abs(spread[1]["log_sd"] - statistics.stdev([math.log(0.015), math.log(0.016)])) < 1e-12
