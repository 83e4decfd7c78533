"""benchmarks.realistic_pair's flags for pairs small enough for a test: the plain Qwen3.5 pair's
shapes, and the Zipf pair's (it needs two full-attention layers, so eight layers)."""

QWEN_SMALL = ["--hidden", "128", "--layers", "4", "--vocab", "12288", "--intermediate", "256",
              "--heads", "2", "--kv-heads", "1", "--head-dim", "64", "--linear-key-heads", "2",
              "--linear-value-heads", "2", "--linear-key-dim", "32", "--linear-value-dim", "32"]
ZIPF_SMALL = [*QWEN_SMALL[:2], "--layers", "8", *QWEN_SMALL[4:]]
