"""The controller's loops (seed 004): the reject-KV lock loop and the periodic reporters.

Reject loop (architecture §6): every `reject_period` it looks at the `Decode` replicas' used KV blocks and
locks (reason `controller`) a replica whose used blocks exceed `lock_ratio` × the mean of the other
decode replicas' *and* `lock_capacity_fraction` of its own capacity; it unlocks it when either falls
below `(1 − unlock_hysteresis)` of its threshold. It never touches the `manual` reason, so a manual lock
survives the loop. Reporters log every `report_period`: each replica's state and blocks, the bytes that
moved between replicas, and — when NVML finds a GPU — GPU metrics.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final, final

import structlog
import trio

from engine.config import ControllerConfig
from messages.commands import Lock, ReplicaCommand, Unlock
from messages.log.events import BlocksReport, Flow, FlowReport, GpuReport, GpuSample
from replicas.fabric import Fabric
from replicas.inbox import CommandRefused, new_command_id
from replicas.ports import Directory, EventSink, PeerReplica
from replicas.states import ReplicaState

_log = structlog.get_logger("engine.controller")
REMOTE_COMMAND_TIMEOUT: Final = 5.0


@final
@dataclass(frozen=True, slots=True)
class _Decoder:
    """A decode replica as the reject loop sees it (this node's, or another's last report)."""

    name: str
    used: int
    capacity: int
    lock_reasons: frozenset[str]
    tell: Callable[[ReplicaCommand], None]


@final
class Controller:
    """Runs the loops of the module docstring until cancelled, over the replicas of `directory` (read
    through their snapshots, commanded with `Lock` / `Unlock`) and the bytes `fabric` counted."""

    def __init__(
        self,
        directory: Directory,
        fabric: Fabric,
        log: EventSink,
        config: ControllerConfig,
        *,
        decides: Callable[[], bool] = lambda: True,
    ) -> None:
        self._directory = directory
        self._fabric = fabric
        self._log = log
        self.config = config
        # False while another node of the cluster leads (or this one cannot reach etcd).
        self.decides = decides
        self._asking: set[str] = set()
        self._nursery: trio.Nursery | None = None
        self._flow_seen: dict[tuple[str, str, str], int] = {}
        self.gpus = GpuProbe()

    async def run(self) -> None:
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
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
        """One pass of the reject-KV loop (in a cluster: on the leader only, over every node's replicas,
        the others' as they last reported them)."""
        if not self.decides():
            return
        decoders = []
        for replica in self._directory.local():
            snap = replica.snapshot()
            if snap.state is ReplicaState.DECODE:
                lock = frozenset(snap.lock_reasons)
                decoders.append(_Decoder(snap.name, snap.cached_blocks, snap.kv_blocks, lock, replica.tell))
        for peer in self._directory.remote():
            snap = peer.snapshot()
            if snap.state is ReplicaState.DECODE:
                lock = frozenset(snap.lock_reasons)
                decoders.append(
                    _Decoder(snap.name, snap.cached_blocks, snap.kv_blocks, lock, self._remote_tell(peer))
                )
        if len(decoders) < 2:
            for decoder in decoders:
                self._set(decoder, False)
            return
        ratio, fraction = self.config.lock_ratio, self.config.lock_capacity_fraction
        keep = 1.0 - self.config.unlock_hysteresis
        for decoder in decoders:
            others = [d.used for d in decoders if d is not decoder]
            mean_others = sum(others) / len(others)
            mine, capacity = decoder.used, decoder.capacity
            if "controller" not in decoder.lock_reasons:
                self._set(decoder, mine > ratio * mean_others and mine > fraction * capacity)
            else:
                self._set(
                    decoder, not (mine < keep * ratio * mean_others or mine < keep * fraction * capacity)
                )

    def _remote_tell(self, peer: PeerReplica) -> Callable[[ReplicaCommand], None]:
        def tell(command: ReplicaCommand) -> None:
            if peer.name in self._asking or self._nursery is None:
                return  # the previous command to it is still on its way
            self._asking.add(peer.name)
            self._nursery.start_soon(self._ask_remote, peer, command)

        return tell

    async def _ask_remote(self, peer: PeerReplica, command: ReplicaCommand) -> None:
        try:
            await peer.ask(command, timeout=REMOTE_COMMAND_TIMEOUT)
        except CommandRefused as exc:
            _log.warning("controller.remote_command_refused", replica=peer.name, error=str(exc))
        finally:
            self._asking.discard(peer.name)

    @staticmethod
    def _set(decoder: _Decoder, lock: bool) -> None:
        has = "controller" in decoder.lock_reasons
        if lock and not has:
            decoder.tell(Lock(command_id=new_command_id(), reason="controller"))
        elif has and not lock:
            decoder.tell(Unlock(command_id=new_command_id(), reason="controller"))

    def report(self) -> None:
        log = self._log
        log.emit(
            BlocksReport(
                replicas=[r.snapshot().blocks() for r in self._directory.local()]
                # The leader of a cluster reports every node's replicas (the others' as last reported).
                + ([peer.snapshot().blocks() for peer in self._directory.remote()] if self.decides() else [])
            )
        )
        flows = []
        for key, total in self._fabric.bytes_between.items():
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
    machines: `NVMLError_LibraryNotFound`) the probe is off and `samples()` is always empty.

    A reading NVML refuses (an `NVMLError`: `NotSupported` for utilisation on a MIG GPU or power on some
    boards, `GpuIsLost`, ...) never raises out of `samples()`, which runs in the node's nursery: an
    unreadable `temperature_c` or `power_w` is null; a device whose name, memory or utilisation cannot be
    read is left out of that `gpu_report` (those fields are not nullable in the log schema, and retyping
    them would break readers). Each (device, NVML call) failure is logged once, not every period, as
    the diagnostic `controller.gpu_unreadable` (a `diagnostic` event of the node's log). `nvml` stands in
    for the `pynvml` module in tests."""

    def __init__(self, nvml: Any = None) -> None:
        import pynvml

        self._nvml: Any = pynvml if nvml is None else nvml
        self._nvml_error: type[Exception] = pynvml.NVMLError  # the real class, whatever `nvml` is
        self._warned: set[tuple[int | None, str]] = set()
        try:
            self._nvml.nvmlInit()
            self.available = True
        except self._nvml_error as exc:
            self.available = False
            if not isinstance(exc, pynvml.NVMLError_LibraryNotFound):  # that one just means a CPU machine
                self._warn(None, "nvmlInit", exc, "no gpu_report")

    def samples(self) -> list[GpuSample]:
        if not self.available:
            return []
        count = self._read(None, "no gpu_report", "nvmlDeviceGetCount")
        if count is None:
            return []
        return [sample for index in range(count) if (sample := self._sample(index)) is not None]

    def _sample(self, index: int) -> GpuSample | None:
        left_out = "device left out of gpu_report"
        handle = self._read(index, left_out, "nvmlDeviceGetHandleByIndex", index)
        if handle is None:
            return None
        required = []
        # Stop at the first required field that fails: a lost GPU fails every call, and one warning says it.
        for call in ("nvmlDeviceGetName", "nvmlDeviceGetMemoryInfo", "nvmlDeviceGetUtilizationRates"):
            value = self._read(index, left_out, call, handle)
            if value is None:
                return None
            required.append(value)
        name, memory, utilization = required
        temperature = self._read(
            index, "temperature_c null", "nvmlDeviceGetTemperature", handle, self._nvml.NVML_TEMPERATURE_GPU
        )
        power_mw = self._read(index, "power_w null", "nvmlDeviceGetPowerUsage", handle)
        return GpuSample(
            index=index,
            name=str(name),
            utilization_percent=float(utilization.gpu),
            memory_used_bytes=int(memory.used),
            memory_total_bytes=int(memory.total),
            temperature_c=None if temperature is None else float(temperature),
            power_w=None if power_mw is None else power_mw / 1000.0,
        )

    def _read(self, index: int | None, effect: str, call: str, *args: object) -> Any:
        """`nvml.<call>(*args)`, or None (warned once per device and call) where NVML raises."""
        try:
            return getattr(self._nvml, call)(*args)
        except self._nvml_error as exc:
            self._warn(index, call, exc, effect)
            return None

    def _warn(self, index: int | None, call: str, exc: Exception, effect: str) -> None:
        if (index, call) in self._warned:
            return
        self._warned.add((index, call))
        _log.warning(
            "controller.gpu_unreadable",
            gpu=index,
            call=call,
            error=f"{type(exc).__name__}: {exc}",
            effect=effect,
        )

    def close(self) -> None:
        if self.available:
            self.available = False
            # Runs in `Controller.run`'s `finally`, as the node stops: an NVML error here must not turn
            # that into a crash; it is logged instead.
            self._read(None, "none: the probe is closed", "nvmlShutdown")
