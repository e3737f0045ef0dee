"""The controller's `GpuProbe` where NVML refuses readings (no GPU here: a stand-in for the `pynvml` module
raising the real `pynvml` errors). A refused reading is null, or leaves its GPU out, and is warned about
once per GPU and NVML call; it never raises, since `samples()` runs in the node's nursery."""

from __future__ import annotations

from types import SimpleNamespace

import msgspec
import pynvml
import structlog.testing

from engine.controller import GpuProbe
from messages.log.events import GpuReport, GpuSample, event_decoder


class StandInNvml:
    """Three GPUs whose handles are their indices; `failures[(index, call)]` is raised by that call."""

    NVML_TEMPERATURE_GPU = pynvml.NVML_TEMPERATURE_GPU

    def __init__(
        self, failures: dict[tuple[int | None, str], pynvml.NVMLError], init: Exception | None = None
    ) -> None:
        self.failures = failures
        self.init = init
        self.shut_down = False

    def _check(self, index: int | None, call: str) -> None:
        failure = self.failures.get((index, call))
        if failure is not None:
            raise failure

    def nvmlInit(self) -> None:
        if self.init is not None:
            raise self.init

    def nvmlShutdown(self) -> None:
        self.shut_down = True
        self._check(None, "nvmlShutdown")

    def nvmlDeviceGetCount(self) -> int:
        self._check(None, "nvmlDeviceGetCount")
        return 3

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        self._check(index, "nvmlDeviceGetHandleByIndex")
        return index

    def nvmlDeviceGetName(self, handle: int) -> str:
        self._check(handle, "nvmlDeviceGetName")
        return f"Stand-in GPU {handle}"

    def nvmlDeviceGetMemoryInfo(self, handle: int) -> SimpleNamespace:
        self._check(handle, "nvmlDeviceGetMemoryInfo")
        return SimpleNamespace(used=1000 + handle, total=8000)

    def nvmlDeviceGetUtilizationRates(self, handle: int) -> SimpleNamespace:
        self._check(handle, "nvmlDeviceGetUtilizationRates")
        return SimpleNamespace(gpu=40 + handle, memory=5)

    def nvmlDeviceGetTemperature(self, handle: int, sensor: int) -> int:
        assert sensor == pynvml.NVML_TEMPERATURE_GPU
        self._check(handle, "nvmlDeviceGetTemperature")
        return 50 + handle

    def nvmlDeviceGetPowerUsage(self, handle: int) -> int:
        self._check(handle, "nvmlDeviceGetPowerUsage")
        return 300_500 + handle  # milliwatts


def sample(index: int, temperature_c: float | None, power_w: float | None) -> GpuSample:
    return GpuSample(
        index=index,
        name=f"Stand-in GPU {index}",
        utilization_percent=40.0 + index,
        memory_used_bytes=1000 + index,
        memory_total_bytes=8000,
        temperature_c=temperature_c,
        power_w=power_w,
    )


def warning(gpu: int | None, call: str, error: str, effect: str) -> dict[str, object]:
    return {
        "event": "controller.gpu_unreadable",
        "log_level": "warning",
        "gpu": gpu,
        "call": call,
        "error": error,
        "effect": effect,
    }


def test_unreadable_fields_are_null_an_unreadable_gpu_is_left_out_and_each_failure_is_warned_once() -> None:
    nvml = StandInNvml(
        {
            (0, "nvmlDeviceGetPowerUsage"): pynvml.NVMLError_NotSupported(),  # boards without power readings
            (1, "nvmlDeviceGetTemperature"): pynvml.NVMLError_GpuIsLost(),
            (2, "nvmlDeviceGetUtilizationRates"): pynvml.NVMLError_NotSupported(),  # a MIG GPU
        }
    )
    probe = GpuProbe(nvml)
    assert probe.available
    with structlog.testing.capture_logs() as logs:
        reports = [probe.samples() for _ in range(3)]
    expected = [sample(0, 50.0, None), sample(1, None, 300.501)]
    assert reports == [expected] * 3
    assert logs == [
        warning(0, "nvmlDeviceGetPowerUsage", "NVMLError_NotSupported: Not Supported", "power_w null"),
        warning(1, "nvmlDeviceGetTemperature", "NVMLError_GpuIsLost: GPU is lost", "temperature_c null"),
        warning(
            2,
            "nvmlDeviceGetUtilizationRates",
            "NVMLError_NotSupported: Not Supported",
            "device left out of gpu_report",
        ),
    ]
    line = msgspec.json.encode(GpuReport(ts=1.0, gpus=expected))
    assert event_decoder().decode(line) == GpuReport(ts=1.0, gpus=expected)  # the nulls fit the schema


def test_a_lost_gpu_is_left_out_with_one_warning_and_a_failing_count_or_shutdown_does_not_raise() -> None:
    lost = pynvml.NVMLError_GpuIsLost()
    nvml = StandInNvml({(1, "nvmlDeviceGetName"): lost, (None, "nvmlShutdown"): lost})
    probe = GpuProbe(nvml)
    with structlog.testing.capture_logs() as logs:
        assert probe.samples() == [sample(0, 50.0, 300.5), sample(2, 52.0, 300.502)]
        nvml.failures[(None, "nvmlDeviceGetCount")] = lost
        assert probe.samples() == []
        assert probe.samples() == []
        probe.close()
    assert nvml.shut_down and not probe.available
    assert probe.samples() == []
    gone = "NVMLError_GpuIsLost: GPU is lost"
    assert logs == [
        warning(1, "nvmlDeviceGetName", gone, "device left out of gpu_report"),
        warning(None, "nvmlDeviceGetCount", gone, "no gpu_report"),
        warning(None, "nvmlShutdown", gone, "none: the probe is closed"),
    ]


def test_no_nvml_library_turns_the_probe_off_quietly_and_another_init_error_is_warned() -> None:
    with structlog.testing.capture_logs() as logs:
        quiet = GpuProbe(StandInNvml({}, init=pynvml.NVMLError_LibraryNotFound()))
        loud = GpuProbe(StandInNvml({}, init=pynvml.NVMLError_DriverNotLoaded()))
    assert (quiet.available, quiet.samples(), loud.available, loud.samples()) == (False, [], False, [])
    assert logs == [
        warning(None, "nvmlInit", "NVMLError_DriverNotLoaded: Driver Not Loaded", "no gpu_report")
    ]
