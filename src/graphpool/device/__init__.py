"""Device layer: ``protocol`` (the contract), ``cuda`` (real GPUs, imported lazily)."""
