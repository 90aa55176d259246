"""Optional NVML sampling over a whole job: power, energy, memory and SM clock. Needs the
`nvidia-ml-py` distribution (imported as `pynvml`) and a GPU; without them every reading is
None and nothing fails."""

from __future__ import annotations

import threading


def gpu_handle(nv, device):
    """The NVML handle of torch's ``device``, matched by the GPU's UUID: torch numbers only
    the GPUs in CUDA_VISIBLE_DEVICES (as SLURM sets it), NVML numbers every GPU, so an index
    would read another GPU's energy."""
    import torch

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
