"""What a tier below the pool is: its `TierSpec` (name, capacity, medium) and what it admits
per group kind (`Admission`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum

from kvreuse.core.errors import ConfigError

DEVICE_MEDIUM = "GPU"  # what the device pool's events say (vLLM's value)


class Admission(StrEnum):
    ON_EVICTION = "on_eviction"  # a keyed block the level above evicts is copied here
    WRITE_THROUGH = "write_through"  # copied here when published, and on eviction if missing
    NEVER = "never"  # the kind's blocks skip this tier


@dataclass(frozen=True, slots=True)
class TierSpec:
    """One tier: a name (metrics and reports show it), its capacity in blocks of the pool's
    size, what it admits per group kind (kinds not named take `default`), and the `medium` its
    KV events name (vLLM's field; the name in capitals unless given: vLLM's own offloading
    connector says "CPU" for host memory, the device is "GPU")."""

    name: str
    num_blocks: int
    admission: Mapping[str, Admission] = field(default_factory=dict)
    default: Admission = Admission.ON_EVICTION
    medium: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ConfigError(
                f"a tier needs a name (got {self.name!r}); e.g. TierSpec('host', 4096)"
            )
        n = self.num_blocks
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ConfigError(f"tier {self.name!r}: num_blocks must be an integer ≥ 1 (got {n!r})")
        for kind, rule in self.admission.items():
            if not isinstance(rule, Admission):
                allowed = ", ".join(a.value for a in Admission)
                raise ConfigError(
                    f"tier {self.name!r}: admission of {kind!r} is {rule!r}; allowed: {allowed}"
                )
        if not self.medium:
            object.__setattr__(self, "medium", self.name.upper())
        if not isinstance(self.medium, str) or self.medium.upper() == DEVICE_MEDIUM:
            raise ConfigError(
                f"tier {self.name!r}: medium {self.medium!r} is not allowed: {DEVICE_MEDIUM!r} "
                "names the device pool itself; e.g. 'CPU' for host memory"
            )

    def admits(self, kind: str) -> bool:
        return self.admission.get(kind, self.default) is not Admission.NEVER

    def writes_through(self, kind: str) -> bool:
        return self.admission.get(kind, self.default) is Admission.WRITE_THROUGH

    def any_write_through(self) -> bool:
        rules = (*self.admission.values(), self.default)
        return Admission.WRITE_THROUGH in rules
