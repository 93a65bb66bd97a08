"""Shared test helpers (one place): launchers, comparisons, fakes of the runtime for the loop layer."""
