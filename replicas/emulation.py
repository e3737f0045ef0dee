"""Emulated accelerator speeds, for benchmarks of scaling behaviour on a machine without accelerators.

On a few CPU cores a second replica adds no compute, so what a scaling policy buys is invisible. With
`--emulated-speed prefill_tokens_per_s=…,decode_steps_per_s=…,weights_gb_per_s=…` (each optional; an
absent key leaves that part real) every replica behaves like a separate accelerator of that speed: each
real compute and each weight copy runs for real — outputs stay token-exact — and is then padded with a
sleep to the duration the emulated speed gives. A compute that is already slower than its emulated
duration is not shortened. This is an emulation, documented as such; bench rows that use it say so.

The replicas of one node share the host's cores, which separate accelerators would not: so their
emulated computes run one at a time (`replicas.step.compute.host_cores`), each with every core, its
duration counted from when it was asked for. Run together instead, six replicas' worker threads each
spread every operation over the same two cores, and a compute that alone takes 40 % of its emulated
time took longer than it: the emulation then measured the host's thrashing, and a router that spread
prompts over idle replicas looked worse than one that piled them on one. While the host keeps up (its
real compute per second below one), every compute still ends at its emulated time.

Weight copies may run at a speed per source, as on real hardware, where a peer GPU's weights come over
NVLink or RDMA far faster than host memory comes over PCIe or a checkpoint off an SSD:
`peer_gb_per_s`, `host_gb_per_s`, `disk_gb_per_s`; a source without its own key copies at
`weights_gb_per_s` (or unpadded when that is absent too).
"""

from __future__ import annotations

from typing import Annotated, assert_never

import msgspec

from messages.log.scaling import WeightsSourceName

Speed = Annotated[float, msgspec.Meta(gt=0.0)]


class EmulatedSpeed(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    prefill_tokens_per_s: Speed | None = None
    decode_steps_per_s: Speed | None = None
    weights_gb_per_s: Speed | None = None
    peer_gb_per_s: Speed | None = None
    host_gb_per_s: Speed | None = None
    disk_gb_per_s: Speed | None = None

    def prefill_seconds(self, tokens: int, layers: int, num_layers: int) -> float | None:
        """Emulated time of `tokens` prompt tokens through `layers` of the model's `num_layers` layers."""
        if self.prefill_tokens_per_s is None:
            return None
        return tokens / self.prefill_tokens_per_s * layers / max(1, num_layers)

    def decode_seconds(self) -> float | None:
        return None if self.decode_steps_per_s is None else 1.0 / self.decode_steps_per_s

    def copy_gb_per_s(self, source: WeightsSourceName) -> float | None:
        """The emulated copy speed from `source`: its own key, else `weights_gb_per_s`, else None (real)."""
        match source:
            case "peer":
                own = self.peer_gb_per_s
            case "host":
                own = self.host_gb_per_s
            case "disk":
                own = self.disk_gb_per_s
            case _:
                assert_never(source)
        return self.weights_gb_per_s if own is None else own

    def copy_seconds(self, nbytes: int, source: WeightsSourceName) -> float | None:
        speed = self.copy_gb_per_s(source)
        return None if speed is None else nbytes / (speed * 1e9)


def parse_emulated_speed(text: str) -> EmulatedSpeed:
    """`KEY=VALUE,…` → `EmulatedSpeed`; ValueError naming the bad part."""
    fields: dict[str, float] = {}
    known = EmulatedSpeed.__struct_fields__
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = part.partition("=")
        if not sep or key not in known:
            raise ValueError(
                f"--emulated-speed: {part!r} is not KEY=VALUE with KEY one of {', '.join(known)}"
            )
        try:
            number = float(value)
        except ValueError:
            raise ValueError(f"--emulated-speed: {key} must be a number, got {value!r}") from None
        if not number > 0:
            raise ValueError(f"--emulated-speed: {key} must be > 0, got {value}")
        fields[key] = number
    return msgspec.convert(fields, EmulatedSpeed)
