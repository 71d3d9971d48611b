"""Imported by the warm template the correctness matrix's workers fork from: every zoo model traced once, so no
worker traces or loads a graph (tests/trace_cache.py)."""

import trace_cache

trace_cache.preload()
