"""The keys every mode of a bench JSON document carries (bench/test_bench_lanes.py, bench/test_bench_head.py)."""

MODE_KEYS = {"mode", "ms_per_item", "items_per_s", "speedup_vs_full", "label_agreement", "max_abs_logprob_diff", "pct_of_peak",
             "pct_of_shape_peak"}
