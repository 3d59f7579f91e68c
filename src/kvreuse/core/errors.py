"""Exceptions of the core. Each subclasses the builtin a caller already catches."""

from __future__ import annotations


class ConfigError(ValueError):
    """An invalid `CacheConfig` / `GroupSpec` (spec §4, V1–V7). The message names a fix."""


class StaleLookupError(ValueError):
    """`allocate` got a `LookupResult` from an older epoch: look up again (spec §3)."""


class SharedTierBusyError(RuntimeError):
    """A manager touched a tier it shares while another manager's ops on it were not yet taken
    by that manager's `seal_step()` (kvreuse.core.tiers.shared: one step at a time)."""


class InvariantError(AssertionError):
    """`check_invariants()` found a violated invariant (spec §14). Always a bug."""


class UnknownRequestError(KeyError, ValueError):
    """An operation named a request id the manager does not know (or has forgotten)."""

    def __str__(self) -> str:  # KeyError quotes its argument; keep the message readable
        return str(self.args[0]) if self.args else "unknown request"
