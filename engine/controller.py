"""The controller's loops (seed 004): the reject-KV lock loop and the periodic reporters.

Reject loop (DESIGN §6): every `reject_period` it looks at the `Decode` replicas' used KV blocks and
locks (reason `controller`) a replica whose used blocks exceed `lock_ratio` × the mean of the other
decode replicas' *and* `lock_capacity_fraction` of its own capacity; it unlocks it when either falls
below `(1 − unlock_hysteresis)` of its threshold. It never touches the `manual` reason, so a manual lock
survives the loop. Reporters log every `report_period`: each replica's state and blocks, the bytes that
moved between replicas, and — when NVML finds a GPU — GPU metrics.
"""

from __future__ import annotations

from typing import final

import trio

from engine.config import ControllerConfig
from messages.commands import Lock, Unlock
from messages.events import BlocksReport, Flow, FlowReport, GpuReport, GpuSample, ReplicaBlocks
from replicas.actor import Replica
from replicas.inbox import new_command_id
from replicas.services import ReplicaServices
from replicas.states import ReplicaState


@final
class Controller:
    """Runs the loops of the module docstring until cancelled."""

    def __init__(self, services: ReplicaServices, config: ControllerConfig) -> None:
        self.services = services
        self.config = config
        self._flow_seen: dict[tuple[str, str, str], int] = {}
        self.gpus = GpuProbe()

    async def run(self) -> None:
        try:
            async with trio.open_nursery() as nursery:
                if self.config.reject_loop:
                    nursery.start_soon(self._every, self.config.reject_period, self.reject_pass)
                nursery.start_soon(self._every, self.config.report_period, self.report)
        finally:
            self.gpus.close()

    @staticmethod
    async def _every(period: float, step: object) -> None:
        assert callable(step)
        while True:
            await trio.sleep(period)
            step()

    def reject_pass(self) -> None:
        """One pass of the reject-KV loop."""
        decoders = [r for r in self.services.replicas.values() if r.state is ReplicaState.DECODE]
        if len(decoders) < 2:
            for replica in decoders:
                self._set(replica, False)
            return
        used = {r.name: r.pools.kv_usage()[0] for r in decoders}
        ratio, fraction = self.config.lock_ratio, self.config.lock_capacity_fraction
        keep = 1.0 - self.config.unlock_hysteresis
        for replica in decoders:
            others = [used[r.name] for r in decoders if r is not replica]
            mean_others = sum(others) / len(others)
            mine = used[replica.name]
            capacity = replica.pools.kv_usage()[1]
            locked = "controller" in replica.lock_reasons
            if not locked:
                self._set(replica, mine > ratio * mean_others and mine > fraction * capacity)
            else:
                self._set(
                    replica, not (mine < keep * ratio * mean_others or mine < keep * fraction * capacity)
                )

    @staticmethod
    def _set(replica: Replica, lock: bool) -> None:
        has = "controller" in replica.lock_reasons
        if lock and not has:
            replica.tell(Lock(command_id=new_command_id(), reason="controller"))
        elif has and not lock:
            replica.tell(Unlock(command_id=new_command_id(), reason="controller"))

    def report(self) -> None:
        log = self.services.log
        log.emit(
            BlocksReport(
                replicas=[
                    ReplicaBlocks(
                        replica=r.name,
                        state=r.state.value,
                        used_blocks=r.pools.used_blocks(),
                        cached_blocks=r.pools.kv_usage()[0],
                        total_blocks=r.pools.total_blocks(),
                        locked=r.locked,
                    )
                    for r in self.services.replicas.values()
                ]
            )
        )
        flows = []
        for key, total in self.services.fabric.bytes_between.items():
            delta = total - self._flow_seen.get(key, 0)
            if delta:
                source, destination, kind = key
                flows.append(Flow(source=source, destination=destination, kind=kind, bytes=delta))  # type: ignore[arg-type]
                self._flow_seen[key] = total
        if flows:
            log.emit(FlowReport(interval_s=self.config.report_period, flows=flows))
        gpus = self.gpus.samples()
        if gpus:
            log.emit(GpuReport(gpus=gpus))


@final
class GpuProbe:
    """NVML readings of every GPU. NVML is initialised once; without a GPU or the NVML library (CPU
    machines: `NVMLError_LibraryNotFound`) the probe is off and `samples()` is always empty."""

    def __init__(self) -> None:
        import pynvml

        self._nvml = pynvml
        try:
            pynvml.nvmlInit()
            self.available = True
        except pynvml.NVMLError:
            self.available = False

    def samples(self) -> list[GpuSample]:
        if not self.available:
            return []
        nvml = self._nvml
        samples = []
        for index in range(nvml.nvmlDeviceGetCount()):
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            memory = nvml.nvmlDeviceGetMemoryInfo(handle)
            samples.append(
                GpuSample(
                    index=index,
                    name=str(nvml.nvmlDeviceGetName(handle)),
                    utilization_percent=float(nvml.nvmlDeviceGetUtilizationRates(handle).gpu),
                    memory_used_bytes=int(memory.used),
                    memory_total_bytes=int(memory.total),
                    temperature_c=float(nvml.nvmlDeviceGetTemperature(handle, nvml.NVML_TEMPERATURE_GPU)),
                    power_w=nvml.nvmlDeviceGetPowerUsage(handle) / 1000.0,
                )
            )
        return samples

    def close(self) -> None:
        if self.available:
            self._nvml.nvmlShutdown()
            self.available = False
