"""Structured outputs in the engine core: grammars compiled off the busy loop, one
bitmask row per constrained request per step (manager.py), by xgrammar or llguidance
(backends.py), chosen by spec.py, which the frontend also uses to refuse early."""
