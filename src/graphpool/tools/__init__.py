"""Tools over the public API: benchmarks and other command-line helpers."""
