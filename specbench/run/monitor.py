"""What a job's runs are watched with: peak memory (the GPU allocator's, or the process's RSS),
the bytes of their models' weights, and optional NVML sampling over a whole job (power, energy,
memory and SM clock; needs the `nvidia-ml-py` distribution, imported as `pynvml`, and a GPU;
without them every reading is None and nothing fails)."""

from __future__ import annotations

import threading

import torch


class PeakMemory:
    """Peak GPU allocator memory, or peak process RSS sampled every ``interval`` s on the CPU:
    the highest over every block it has been entered for."""

    def __init__(self, device, interval: float = 0.02):
        self.device, self.interval = device, interval
        self.peak = 0
        self._stop = threading.Event()
        self._thread = None

    @staticmethod
    def rss() -> int:
        try:
            with open("/proc/self/statm") as f:
                return int(f.read().split()[1]) * 4096
        except OSError:
            return 0

    transient = 0  # GPU: the most the blocks allocated on top of what was allocated when each began

    def __enter__(self):
        self._stop.clear()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base = int(torch.cuda.memory_allocated(self.device))
        else:
            self.peak = max(self.peak, self.rss())

            def loop():
                while not self._stop.wait(self.interval):
                    self.peak = max(self.peak, self.rss())

            self._thread = threading.Thread(target=loop, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            top = int(torch.cuda.max_memory_allocated(self.device))
            self.peak = max(self.peak, top)
            self.transient = max(self.transient, top - self.base)
        else:
            self._stop.set()
            self._thread.join()
            self.peak = max(self.peak, self.rss())


def weight_bytes(modules) -> int:
    """Bytes of the parameters and buffers of ``modules``, each storage once (a draft made of the
    target's own layers adds nothing)."""
    seen, total = set(), 0
    for m in modules:
        for t in list(m.parameters()) + list(m.buffers()):
            key = (t.device, t.untyped_storage().data_ptr())
            if key not in seen:
                seen.add(key)
                total += t.untyped_storage().nbytes()
    return total


def gpu_handle(nv, device):
    """The NVML handle of torch's ``device``, matched by the GPU's UUID: torch numbers only
    the GPUs in CUDA_VISIBLE_DEVICES (as SLURM sets it), NVML numbers every GPU, so an index
    would read another GPU's energy."""
    uuid = str(getattr(torch.cuda.get_device_properties(device), "uuid", "") or "")
    if not uuid:
        raise RuntimeError("no GPU UUID from torch: energy not attributed rather than read from a guessed GPU")
    return nv.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith(("GPU-", "MIG-")) else f"GPU-{uuid}")


class NvmlMonitor:
    """Entered once for a whole job, or once per block of it (a paired job's own units): the
    result covers every block, energy summed, samples pooled."""

    def __init__(self, device=None, index: int | None = None, interval_s: float = 0.05):
        self.interval = interval_s
        self.h = None
        self.nv = None
        self.result: dict | None = None
        self.samples: list[tuple] = []
        self._energy: float | None = 0.0  # joules over the blocks so far; None once a reading failed
        if index is None and (device is None or getattr(device, "type", None) != "cuda"):
            return
        try:
            import pynvml

            pynvml.nvmlInit()
            self.nv = pynvml
            self.h = pynvml.nvmlDeviceGetHandleByIndex(index) if index is not None else gpu_handle(pynvml, device)
        except Exception:  # noqa: BLE001 - NVML is optional: no driver, no library, no GPU
            self.h = None

    def _read(self) -> tuple:
        nv, h = self.nv, self.h
        return (nv.nvmlDeviceGetPowerUsage(h) / 1000.0, nv.nvmlDeviceGetMemoryInfo(h).used,
                nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM))

    def __enter__(self):
        if self.h is None:
            return self
        self._stop = threading.Event()
        try:
            self.e0 = self.nv.nvmlDeviceGetTotalEnergyConsumption(self.h)
        except Exception:  # noqa: BLE001 - older GPUs have no energy counter
            self.e0 = None

        def loop():
            while not self._stop.is_set():
                try:
                    self.samples.append(self._read())
                except Exception:  # noqa: BLE001
                    pass
                self._stop.wait(self.interval)

        self._t = threading.Thread(target=loop, daemon=True)
        self._t.start()
        return self

    def __exit__(self, *exc):
        if self.h is None:
            return
        self._stop.set()
        self._t.join()
        energy = None
        if self.e0 is not None:
            try:
                energy = (self.nv.nvmlDeviceGetTotalEnergyConsumption(self.h) - self.e0) / 1000.0
            except Exception:  # noqa: BLE001
                energy = None
        self._energy = None if energy is None or self._energy is None else self._energy + energy
        s = self.samples
        self.result = {
            "energy_j": self._energy,
            "power_w_mean": sum(x[0] for x in s) / len(s) if s else None,
            "power_w_max": max(x[0] for x in s) if s else None,
            "mem_used_max_bytes": max(x[1] for x in s) if s else None,
            "sm_clock_mhz_mean": sum(x[2] for x in s) / len(s) if s else None,
            "samples": len(s),
        }

    @property
    def energy_j(self):
        return None if self.result is None else self.result["energy_j"]
