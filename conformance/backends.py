"""Which backends this machine and this build can certify.

A backend is available when the build has it and a device of it is present. An absent backend is
"not available" (never "pass"), with the reason."""

from __future__ import annotations

from dataclasses import dataclass, field

KNOWN = ("cpu", "cuda", "vulkan", "metal")
# ggml backend registry names, lowercased, to our names
_REG_NAMES = {"cpu": "cpu", "cuda": "cuda", "vulkan": "vulkan", "metal": "metal", "mtl": "metal"}


@dataclass(frozen=True)
class Backend:
    name: str
    available: bool
    reason: str = ""
    devices: tuple[dict, ...] = field(default_factory=tuple)

    @property
    def offload_devices(self) -> list[int] | None:
        """Device indices to load a model on: [] keeps it on the CPU."""
        if self.name == "cpu":
            return []
        return [d["index"] for d in self.devices]

    @property
    def description(self) -> str:
        return "; ".join(d["description"] for d in self.devices)

    def to_json(self) -> dict:
        return {
            "status": "available" if self.available else "not available",
            "reason": self.reason,
            "device": self.description,
            "devices": [{k: d[k] for k in ("name", "description", "memory_total")} for d in self.devices],
        }


def discover() -> dict[str, Backend]:
    import retro

    found: dict[str, list[dict]] = {}
    for d in retro.devices():
        name = _REG_NAMES.get(d.backend.lower())
        if name:
            found.setdefault(name, []).append(d.__dict__)
    built = set(retro.build_info().get("backends", [])) | {"cpu"}
    out = {}
    for name in KNOWN:
        if found.get(name):
            out[name] = Backend(name, True, devices=tuple(found[name]))
        elif name in built:
            out[name] = Backend(name, False, "compiled into this build, but no device of it is present")
        else:
            out[name] = Backend(name, False, "not compiled into this build")
    return out


def parse_selection(text: str | None) -> list[str]:
    """'cpu', 'cuda,vulkan' or 'all' to backend names; unknown names are an error."""
    if not text:
        return ["cpu"]
    names = [t.strip().lower() for t in text.split(",") if t.strip()]
    if "all" in names:
        return list(KNOWN)
    bad = [n for n in names if n not in KNOWN]
    if bad:
        raise ValueError(f"unknown backend(s) {bad}; known: {', '.join(KNOWN)} or all")
    return list(dict.fromkeys(names))
