"""``baton transports``: which transport UCX (inside NIXL) can use for KV pulls between nodes,
RDMA or TCP, read from inside a worker's pod without importing torch or NIXL.

    ports        <sysfs>/class/infiniband/<device>/ports/<n>/: state, link_layer (InfiniBand;
                 Ethernet: RoCE), rate, RoCE v2 GIDs; <device>/device/driver "efa": AWS EFA
    libraries    libibverbs.so.1, librdmacm.so.1 and the mlx5 and EFA providers, opened with
                 ctypes (the image's Debian packages: what ibv_devinfo and UCX's EFA transport
                 use; NIXL's UCX brings its own libibverbs and mlx5 provider)
    environment  every UCX_* and NIXL_* variable (kubectl exec sees the pod's environment)
    verdict      one line; exit status 1 when UCX_TLS asks for an RDMA transport that no
                 active port gives

The worker sets UCX_NET_DEVICES itself when the pod does not: to the network interface of its
address, which leaves every RDMA port out. An RDMA port is used only where UCX_NET_DEVICES
names it (mlx5_0:1) or is "all".
"""

import ctypes
import dataclasses
import json
import resource
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

CAP_IPC_LOCK = 14  # the bit in /proc/<pid>/status's CapEff
# what each kind of port speaks in UCX_TLS: InfiniBand and RoCE (verbs) rc, dc, ud (and "ib",
# all of them); EFA only srd
VERBS, SRD = "rc/dc/ud", "srd"
FAMILY = {"InfiniBand": VERBS, "RoCE": VERBS, "EFA": SRD}
LIBRARIES = {  # name → what it is for
    "libibverbs.so.1": "verbs (ibv_devinfo)",
    "librdmacm.so.1": "RDMA connection manager",
    "libmlx5.so.1": "mlx5 provider (ConnectX: InfiniBand, RoCE)",
    "libefa.so.1": "EFA provider (UCX's srd)",
}
UNSET_HELP = {
    "UCX_TLS": "UCX picks among the transports it finds, TCP included",
    "UCX_NET_DEVICES": "the worker sets it to its address's interface (TCP only)",
    "UCX_IB_GID_INDEX": "UCX picks a RoCE v2 GID",
}


@dataclass(frozen=True)
class Port:
    device: str  # mlx5_0, efa_0
    port: int  # from 1
    state: str  # ACTIVE, DOWN, INIT, ARMED (sysfs "4: ACTIVE")
    kind: str  # InfiniBand, RoCE, EFA, or the link layer sysfs gives
    rate: str = ""  # "400 Gb/sec (4X NDR)"; "" where sysfs has none
    roce_v2_gids: tuple[int, ...] = ()  # GID indices of type RoCE v2 (UCX_IB_GID_INDEX)

    @property
    def name(self) -> str:
        """As UCX_NET_DEVICES spells it."""
        return f"{self.device}:{self.port}"


@dataclass(frozen=True)
class Library:
    name: str
    role: str
    error: str  # "" when it loads


@dataclass(frozen=True)
class Verdict:
    ok: bool  # False: the environment asks for RDMA that this pod cannot give (exit 1)
    transport: str  # "rdma" or "tcp": what UCX uses between nodes
    text: str


@dataclass(frozen=True)
class Report:
    ports: list[Port]
    libraries: list[Library]
    env: dict[str, str]  # every UCX_* and NIXL_* variable set
    ipc_lock: bool  # CAP_IPC_LOCK held (the chart's ipcLock: true)
    memlock_bytes: int | None  # RLIMIT_MEMLOCK; None: unlimited
    verdict: Verdict


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:  # (an unpopulated GID's type reads as EINVAL)
        return ""


def _roce_v2_gids(port: Path) -> tuple[int, ...]:
    types = port / "gid_attrs" / "types"
    found = []
    for entry in sorted(types.iterdir(), key=lambda p: int(p.name)) if types.is_dir() else []:
        gid = _read(port / "gids" / entry.name)
        if _read(entry) == "RoCE v2" and gid.strip("0:"):
            found.append(int(entry.name))
    return tuple(found)


def read_ports(sysfs: Path) -> list[Port]:
    """Every RDMA port under ``sysfs``/class/infiniband, by device then port."""
    root = sysfs / "class" / "infiniband"
    ports = []
    for device in sorted(root.iterdir()) if root.is_dir() else []:
        driver = (device / "device" / "driver").resolve().name
        for port in sorted((device / "ports").glob("*"), key=lambda p: int(p.name)):
            layer = _read(port / "link_layer")
            efa = driver == "efa" or device.name.startswith("efa")
            kind = "EFA" if efa else {"Ethernet": "RoCE"}.get(layer, layer or "unknown")
            state = _read(port / "state").partition(": ")[2] or "unknown"
            gids = _roce_v2_gids(port) if kind == "RoCE" else ()
            ports.append(Port(device.name, int(port.name), state, kind,
                              _read(port / "rate"), gids))  # fmt: skip
    return ports


def _load(name: str) -> str:
    try:
        ctypes.CDLL(name)
    except OSError as e:
        return str(e)
    return ""


def _ipc_lock(proc_status: Path) -> bool:
    for line in _read(proc_status).splitlines():
        if line.startswith("CapEff:"):
            return bool(int(line.split()[1], 16) >> CAP_IPC_LOCK & 1)
    return False


def _family(name: str) -> str | None:
    """The RDMA family one UCX_TLS name asks for (rc_x: rc/dc/ud), None for others (tcp)."""
    if name == SRD:
        return SRD
    return VERBS if name == "ib" or name.split("_")[0] in ("rc", "dc", "ud") else None


def _asked(tls: str) -> tuple[list[str], bool]:
    """The RDMA transports UCX_TLS names, and whether it lets UCX use TCP. Unset, "all" or an
    exclusion list ("^...") names none: UCX picks among those it finds."""
    names = [n.strip() for n in tls.split(",") if n.strip()]
    if not names or names == ["all"] or tls.startswith("^"):
        return [], "tcp" not in tls.lstrip("^").split(",")
    return [n for n in names if _family(n)], "tcp" in names


def _not_selected(active: list[Port], net_devices: str | None) -> tuple[list[Port], str]:
    """The active ports that UCX_NET_DEVICES lets UCX use, and why the others are left out."""
    names = ", ".join(p.name for p in active)
    if net_devices is None:
        return [], (
            "UCX_NET_DEVICES is unset (the worker sets it to the interface of its "
            f"address, leaving out {names})"
        )
    entries = [e.strip() for e in net_devices.split(",")]
    if entries == ["all"]:
        return active, ""
    if net_devices.startswith("^"):
        kept = [p for p in active if p.name not in net_devices[1:].split(",")]
    else:
        kept = [p for p in active if p.name in entries]
    return kept, f"UCX_NET_DEVICES={net_devices} names none of the active RDMA ports ({names})"


def verdict(ports: list[Port], env: Mapping[str, str]) -> Verdict:
    """What UCX will use between nodes, given the ports and the environment."""
    tls = env.get("UCX_TLS", "")
    asked, tcp = _asked(tls)
    families = {_family(n) for n in asked} or {VERBS, SRD}
    active = [p for p in ports if p.state == "ACTIVE" and p.kind in FAMILY]
    selected, why = _not_selected(active, env.get("UCX_NET_DEVICES")) if active else ([], "")
    usable = ", ".join(f"{p.name} ({p.kind})" for p in selected if FAMILY[p.kind] in families)
    if usable and asked:
        return Verdict(True, "rdma", f"RDMA: UCX_TLS={tls} can use {usable}")
    if usable:
        return Verdict(True, "rdma", f"RDMA: UCX can use {usable} (UCX_TLS names no RDMA "
                       "transport: where RDMA fails it falls back to TCP silently)")  # fmt: skip
    if not active:
        seen = ", ".join(f"{p.name}: {p.kind} {p.state}" for p in ports)
        why = "no active RDMA port" + (f" ({seen})" if seen else " in this pod")
    elif selected:  # ports of the other family only
        other = ", ".join(f"{p.name} ({p.kind}: {FAMILY[p.kind]})" for p in selected)
        why = f"the active RDMA ports speak another transport: {other}"
    if not asked:
        return Verdict(True, "tcp", f"TCP: {why}")
    fallback = ("UCX would fall back to TCP" if tcp else
                "UCX finds no transport to another node (KV pulls between nodes fail)")  # fmt: skip
    return Verdict(False, "tcp", f"UCX_TLS asks for {','.join(asked)} but {why}: {fallback}")


def gather(sysfs: Path, env: Mapping[str, str], proc_status: Path = Path("/proc/self/status"),
           load: Callable[[str], str] = _load) -> Report:  # fmt: skip
    """Read this pod's RDMA ports, libraries, environment and memory locking; ``load`` opens a
    library and returns its error ("" when it loads)."""
    ports = read_ports(sysfs)
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return Report(
        ports=ports,
        libraries=[Library(name, role, load(name)) for name, role in LIBRARIES.items()],
        env={k: v for k, v in sorted(env.items()) if k.startswith(("UCX_", "NIXL_"))},
        ipc_lock=_ipc_lock(proc_status),
        memlock_bytes=None if soft == resource.RLIM_INFINITY else soft,
        verdict=verdict(ports, env),
    )


def render(report: Report, sysfs: Path) -> str:
    lines = [f"RDMA ports ({sysfs / 'class' / 'infiniband'}):"]
    for p in report.ports:
        gids = f", RoCE v2 GIDs {list(p.roce_v2_gids)}" if p.roce_v2_gids else ""
        lines.append(f"  {p.name:<12} {p.state:<8} {p.kind}{gids}  {p.rate}".rstrip())
    lines += ["  (none)"] if not report.ports else []
    lines.append("libraries:")
    for lib in report.libraries:
        status = f"missing  {lib.role}: {lib.error}" if lib.error else f"loads    {lib.role}"
        lines.append(f"  {lib.name:<17} {status}")
    memlock = report.memlock_bytes
    limit = "unlimited" if memlock is None else f"{memlock / 2**20:g} MiB"
    lines.append(f"memory locking: IPC_LOCK {'held' if report.ipc_lock else 'not held'}, "
                 f"memlock limit {limit}")  # fmt: skip
    lines.append("environment:")
    for name, why in UNSET_HELP.items():
        lines.append(f"  {name}={report.env[name]}" if name in report.env
                     else f"  {name} unset: {why}")  # fmt: skip
    lines += [f"  {k}={v}" for k, v in report.env.items() if k not in UNSET_HELP]
    lines.append(f"verdict: {report.verdict.text}")
    return "\n".join(lines)


def run(sysfs: Path, env: Mapping[str, str], as_json: bool) -> int:
    """Print the report; the exit status: 1 when the verdict is not ok."""
    report = gather(sysfs, env)
    if as_json:
        print(json.dumps(dataclasses.asdict(report), indent=2))
    else:
        print(render(report, sysfs))
    return 0 if report.verdict.ok else 1
