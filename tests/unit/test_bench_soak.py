"""The soak benchmark's arithmetic (bench/soak.py): the RSS slope after warm-up that decides its
verdict, and the per-window percentiles and rates it reports."""

from __future__ import annotations

import math

import pytest

from bench.soak import after_warmup, collection_means, interpolate, least_squares, rates, rss_slope, verdict, windows


def test_least_squares_recovers_a_line_and_its_error_is_zero() -> None:
    points = [(float(t), 100.0 + 0.002 * t) for t in range(0, 1800, 2)]
    slope, intercept, error = least_squares(points)
    assert slope == pytest.approx(0.002)
    assert intercept == pytest.approx(100.0)
    assert error == pytest.approx(0.0, abs=1e-12)


def test_least_squares_needs_two_distinct_x() -> None:
    with pytest.raises(ValueError):
        least_squares([(1.0, 2.0)])
    with pytest.raises(ValueError):
        least_squares([(1.0, 2.0), (1.0, 3.0)])
    assert math.isnan(least_squares([(0.0, 0.0), (1.0, 1.0)])[2])


def test_slope_is_in_mib_per_ten_minutes_after_the_warm_up_only() -> None:
    # Steep growth for 5 minutes (warm-up), then 0.5 MiB per 10 minutes.
    points = [(float(t), t * 0.1 if t < 300 else 30.0 + (t - 300) * 0.5 / 600) for t in range(0, 1800, 2)]
    slope = rss_slope(points, warmup_s=300)
    assert slope["slope_mib_per_10min"] == pytest.approx(0.5)
    assert slope["samples"] == len(after_warmup(points, 300)) == 750
    assert slope["from_s"] == 300
    # Including the warm-up would call it a leak.
    assert rss_slope(points, warmup_s=0)["slope_mib_per_10min"] > 4


def test_the_verdict_fails_above_the_limit() -> None:
    leak = [(float(t), 120.0 + 1.2 * t / 600 + (0.3 if t % 4 else -0.3)) for t in range(0, 1800, 2)]
    flat = [(float(t), 120.0 + 0.8 * t / 600 + (0.3 if t % 4 else -0.3)) for t in range(0, 1800, 2)]
    assert rss_slope(leak, 0)["slope_mib_per_10min"] == pytest.approx(1.2, abs=0.01)
    assert verdict(rss_slope(leak, 0)["slope_mib_per_10min"], 1.0) == "not met"
    assert verdict(rss_slope(flat, 0)["slope_mib_per_10min"], 1.0) == "met"
    assert verdict(-3.0, 1.0) == "met"  # a falling RSS is no leak


def test_windows_give_nearest_rank_percentiles_per_window() -> None:
    # 20 scrapes per 100 s window: 1..20 ms in the first, 101..120 in the second, none in the third.
    samples = [(t * 5.0, 1.0 + t) for t in range(20)] + [(100 + t * 5.0, 101.0 + t) for t in range(20)]
    out = windows(samples, 100.0, 300.0)
    assert [w["n"] for w in out] == [20, 20, 0]
    assert out[0]["p50"] == 10.5 and out[0]["p95"] == 19.0  # rank round(0.95 * 19) = 18 -> 19
    assert out[1]["p95"] == 119.0
    assert out[2]["p50"] is None and out[2]["p95"] is None
    # A partial last window, and a sample exactly at the end, are kept.
    out = windows([(0.0, 1.0), (250.0, 2.0)], 100.0, 250.0)
    assert [(w["from_s"], w["to_s"], w["n"]) for w in out] == [(0, 100, 1), (100, 200, 0), (200, 250, 1)]


def test_rates_of_a_counter_per_window() -> None:
    counter = [(t * 30.0, 200.0 * t * 30.0) for t in range(11)]  # 200/s, sampled every 30 s
    out = rates(counter, 120.0, 300.0)
    assert [r["per_s"] for r in out] == [pytest.approx(200.0)] * 3
    assert rates([(0.0, 0.0)], 60.0, 60.0)[0]["per_s"] is None
    # Samples sparser than the windows: interpolated at the window ends; a window the samples do
    # not reach has no rate.
    sparse = [(0.0, 0.0), (100.0, 1000.0), (200.0, 1500.0)]
    out = rates(sparse, 50.0, 250.0)
    assert [r["per_s"] for r in out] == [10.0, 10.0, 5.0, 5.0, None]


def test_interpolate_inside_the_samples_only() -> None:
    counter = [(0.0, 0.0), (10.0, 100.0)]
    assert interpolate(counter, 2.5) == 25.0
    with pytest.raises(ValueError):
        interpolate(counter, 11.0)


def test_collection_means_from_the_first_and_last_stats_that_have_them() -> None:
    stats = [
        {"t": 0.0},  # read before any collection was recorded
        {"t": 30.0, "prometheus_collections": 7.0, "prometheus_wall_s": 0.4, "prometheus_cpu_s": 0.2},
        {"t": 60.0, "prometheus_collections": 17.0, "prometheus_wall_s": 0.9, "prometheus_cpu_s": 0.5},
    ]
    means = collection_means(stats)
    assert means["prometheus_wall"] == pytest.approx(50.0) and means["prometheus_cpu"] == pytest.approx(30.0)
    assert means["otlp_wall"] is None


def test_the_png_goes_beside_the_json_unless_told_otherwise() -> None:
    from pathlib import Path

    from bench.soak import plot_path

    assert plot_path(Path("bench/results/soak/soak.json"), None) == Path("bench/results/soak/soak.png")
    assert plot_path(Path("bench/results/soak/soak.json"), Path("/tmp/x.png")) == Path("/tmp/x.png")
    assert plot_path(Path("bench/results/soak/soak.json"), None, no_plot=True) is None
    assert plot_path(None, None) is None
