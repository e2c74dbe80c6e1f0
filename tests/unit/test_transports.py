"""``baton transports`` on fake sysfs trees: an InfiniBand port, a RoCE port, an EFA device, a
port that is down, none; each verdict and its exit status."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from baton.cli import main
from baton.transports import Port, gather, read_ports, render, run, verdict


def add_port(sysfs: Path, device: str, *, state: str = "4: ACTIVE", layer: str = "InfiniBand",
             driver: str = "mlx5_core", roce_v2_gids: tuple[int, ...] = ()) -> None:  # fmt: skip
    """One device with port 1, as the kernel lays it out (the driver a symlink)."""
    dev = sysfs / "class" / "infiniband" / device
    port = dev / "ports" / "1"
    port.mkdir(parents=True)
    (port / "state").write_text(state + "\n")
    (port / "link_layer").write_text(layer + "\n")
    (port / "rate").write_text("400 Gb/sec (4X NDR)\n")
    for index in range(4):  # RoCE v1 and v2 GIDs of the link-local and an IPv4 address
        (port / "gids").mkdir(exist_ok=True)
        (port / "gid_attrs" / "types").mkdir(parents=True, exist_ok=True)
        gid = "0000:0000:0000:0000:0000:ffff:0a00:0001" if index in roce_v2_gids else "fe80::1"
        (port / "gids" / str(index)).write_text(gid + "\n")
        kind = "RoCE v2" if index in roce_v2_gids else "IB/RoCE v1"
        (port / "gid_attrs" / "types" / str(index)).write_text(kind + "\n")
    drivers = sysfs / "bus" / "pci" / "drivers" / driver
    drivers.mkdir(parents=True, exist_ok=True)
    (dev / "device").mkdir()
    (dev / "device" / "driver").symlink_to(drivers)


@pytest.fixture
def sysfs(tmp_path: Path) -> Path:
    (tmp_path / "class").mkdir()
    return tmp_path


def test_ports_are_read_with_their_kind(sysfs: Path) -> None:
    add_port(sysfs, "mlx5_0")
    add_port(sysfs, "mlx5_1", state="1: DOWN", layer="Ethernet", roce_v2_gids=(3,))
    add_port(sysfs, "efa_0", layer="Unspecified", driver="efa")
    assert read_ports(sysfs) == [
        Port("efa_0", 1, "ACTIVE", "EFA", "400 Gb/sec (4X NDR)"),
        Port("mlx5_0", 1, "ACTIVE", "InfiniBand", "400 Gb/sec (4X NDR)"),
        Port("mlx5_1", 1, "DOWN", "RoCE", "400 Gb/sec (4X NDR)", roce_v2_gids=(3,)),
    ]
    assert read_ports(sysfs / "nothing") == []


IB = {"device": "mlx5_0"}
ROCE = {"device": "mlx5_0", "layer": "Ethernet", "roce_v2_gids": (3,)}
EFA = {"device": "efa_0", "layer": "Unspecified", "driver": "efa"}
DOWN = {"device": "mlx5_0", "state": "1: DOWN"}
RC = {"UCX_TLS": "rc,cuda_copy,cuda_ipc", "UCX_NET_DEVICES": "mlx5_0:1"}

CASES = [  # (port or None, environment, exit status, transport, what the verdict says)
    (IB, RC, 0, "rdma", "RDMA: UCX_TLS=rc,cuda_copy,cuda_ipc can use mlx5_0:1 (InfiniBand)"),
    (ROCE, RC, 0, "rdma", "RDMA: UCX_TLS=rc,cuda_copy,cuda_ipc can use mlx5_0:1 (RoCE)"),
    (EFA, {"UCX_TLS": "srd", "UCX_NET_DEVICES": "efa_0:1"}, 0, "rdma", "can use efa_0:1 (EFA)"),
    (IB, {"UCX_NET_DEVICES": "all"}, 0, "rdma", "falls back to TCP silently"),
    (None, {}, 0, "tcp", "TCP: no active RDMA port in this pod"),
    (IB, {"UCX_NET_DEVICES": "eth0"}, 0, "tcp", "UCX_NET_DEVICES=eth0 names none of"),
    (None, {"UCX_TLS": "rc,tcp"}, 1, "tcp",
     "UCX_TLS asks for rc but no active RDMA port in this pod: UCX would fall back to TCP"),
    (DOWN, RC, 1, "tcp", "no active RDMA port (mlx5_0:1: InfiniBand DOWN): UCX finds no "
     "transport to another node (KV pulls between nodes fail)"),
    (IB, {"UCX_TLS": "rc_x"}, 1, "tcp", "UCX_NET_DEVICES is unset (the worker sets it"),
    (IB, {**RC, "UCX_NET_DEVICES": "eth0"}, 1, "tcp", "eth0 names none of the active RDMA"),
    (EFA, {**RC, "UCX_NET_DEVICES": "efa_0:1"}, 1, "tcp",
     "asks for rc but the active RDMA ports speak another transport: efa_0:1 (EFA: srd)"),
    (IB, {"UCX_TLS": "srd", "UCX_NET_DEVICES": "all"}, 1, "tcp", "mlx5_0:1 (InfiniBand: rc/dc/ud)"),
]  # fmt: skip


@pytest.mark.parametrize(("port", "env", "status", "transport", "text"), CASES)
def test_verdicts_and_exit_status(
    sysfs: Path, capsys: pytest.CaptureFixture[str], port: dict | None, env: dict[str, str],
    status: int, transport: str, text: str,
) -> None:  # fmt: skip
    if port is not None:
        add_port(sysfs, **port)
    found = verdict(read_ports(sysfs), env)
    assert (found.ok, found.transport) == (status == 0, transport)
    assert text in found.text, found.text
    assert run(sysfs, env, as_json=False) == status
    assert capsys.readouterr().out.splitlines()[-1] == f"verdict: {found.text}"


def test_the_report_names_libraries_memory_locking_and_the_environment(
    sysfs: Path, tmp_path: Path,
) -> None:  # fmt: skip
    add_port(sysfs, "mlx5_0", layer="Ethernet", roce_v2_gids=(3,))
    status = tmp_path / "status"
    status.write_text("Name:\tbaton\nCapEff:\t0000000000004000\n")  # CAP_IPC_LOCK alone
    env = {**RC, "NIXL_LOG_LEVEL": "INFO", "PATH": "/bin"}
    report = gather(sysfs, env, proc_status=status, load=lambda name: "" if "mlx5" in name
                    else f"{name}: cannot open shared object file")  # fmt: skip
    assert report.ipc_lock
    assert report.env == {"NIXL_LOG_LEVEL": "INFO", **RC}
    assert [lib.name for lib in report.libraries if not lib.error] == ["libmlx5.so.1"]
    text = render(report, sysfs)
    assert "mlx5_0:1     ACTIVE   RoCE, RoCE v2 GIDs [3]  400 Gb/sec (4X NDR)" in text
    assert "libefa.so.1       missing  EFA provider (UCX's srd): libefa.so.1: cannot" in text
    assert "UCX_IB_GID_INDEX unset: UCX picks a RoCE v2 GID" in text
    assert "  NIXL_LOG_LEVEL=INFO" in text
    status.write_text("CapEff:\t00000000a80425fb\n")  # a container's default capabilities
    assert not gather(sysfs, env, proc_status=status).ipc_lock


def test_the_command_prints_json_and_exits_with_the_verdict(
    sysfs: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    add_port(sysfs, "efa_0", layer="Unspecified", driver="efa")
    monkeypatch.setenv("UCX_TLS", "rc")
    monkeypatch.setenv("UCX_NET_DEVICES", "efa_0:1")
    with pytest.raises(SystemExit) as exited:
        main(["transports", "--sysfs", str(sysfs), "--json"])
    assert exited.value.code == 1
    out = json.loads(capsys.readouterr().out)
    assert out["ports"][0]["kind"] == "EFA" and out["verdict"]["ok"] is False
    monkeypatch.setenv("UCX_TLS", "srd")
    with pytest.raises(SystemExit) as exited:
        main(["transports", "--sysfs", str(sysfs)])
    assert exited.value.code == 0
    assert capsys.readouterr().out.endswith("verdict: RDMA: UCX_TLS=srd can use efa_0:1 (EFA)\n")


def test_the_command_imports_neither_torch_nor_nixl(sysfs: Path) -> None:
    code = (
        "import sys\nfrom baton.cli import main\n"
        f"try:\n    main(['transports', '--sysfs', {str(sysfs)!r}])\nexcept SystemExit:\n    pass\n"
        "print(sorted(m for m in ('torch', 'nixl', 'nixl_cu13') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.splitlines()[-1] == "[]", out.stdout
