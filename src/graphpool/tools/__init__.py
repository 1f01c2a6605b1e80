"""graphpool's tools: the command line (``python -m graphpool``), its demo, benchmarks and
snapshot pictures, and the allocation traces the benchmarks replay.

They use the library (the public API and, for the benchmarks, the policy) and nothing in
the library uses them: importing graphpool imports none of these modules.
"""
