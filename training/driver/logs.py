"""What happened on which host: the run's log and the hosts' warnings.

`RunLog` writes each host's start line and each distinct warning a host sent
(`training.host.warnings`), labelled with its host, to the console once and to `run.log`.
"""

from __future__ import annotations

from datetime import datetime
from pathlib import Path

from rich.console import Console

RUN_LOG = "run.log"


def describe_host(identity: dict) -> str:
    placed = zip(identity["local_devices"], identity["mesh_coordinates"], strict=True)
    devices = ", ".join(f"{device} at ({data},{model})" for device, (data, model) in placed)
    rows = identity["rows"]
    # A Ray actor's node; none for the host in the driver's own process (cluster=inprocess).
    node_id = identity["node_id"]
    node = f"{identity['node_ip']}, node {node_id[:12]}, " if node_id else ""
    return (
        f"host {identity['host']} on {identity['hostname']} ({node}pid {identity['pid']}): "
        f"devices {devices} of the (data,model) mesh; batch rows {rows[0]}:{rows[1]}"
        f"{_gpus(identity)}"
    )


def _gpus(identity: dict) -> str:
    """The host's GPUs by nvidia-smi index (its devices count from 0 among them)."""
    gpus = identity.get("gpus") or []
    if not gpus:
        return ""
    named = ", ".join(f"{g['index']} {g['name']} ({g['memory_mib'] / 1024:.0f} GiB)" for g in gpus)
    return f"; GPUs {named}"


class RunLog:
    """The run's log: lines on the driver's console and, with a timestamp, in `run.log`."""

    def __init__(self, run_dir: Path, console: Console):
        run_dir.mkdir(parents=True, exist_ok=True)
        self.path = run_dir / RUN_LOG
        self.console = console
        self._file = self.path.open("a")
        self._first_host: dict[str, int] = {}  # warning message -> the host that sent it first
        self._warned: set[tuple[str, int]] = set()

    def line(self, text: str, show: bool = True) -> None:
        stamp = datetime.now().isoformat(sep=" ", timespec="milliseconds")
        self._file.write(f"{stamp} {text}\n".replace("\n", "\n    ").rstrip(" "))
        self._file.flush()
        if show:
            self.console.print(text, highlight=False, markup=False, soft_wrap=True)

    def host_started(self, identity: dict) -> None:
        self.line(describe_host(identity))

    def host_warning(self, host: int, message: str) -> None:
        """Show each distinct warning once; a repeat from another host goes to the file only."""
        if (message, host) in self._warned:
            return
        self._warned.add((message, host))
        first = self._first_host.setdefault(message, host)
        if first == host:
            self.line(f"warning from host {host}: {message}")
        else:
            self.line(f"warning from host {host} (as host {first}): {message}", show=False)

    def host_output(self, host: int, line: str) -> None:
        """A line a host printed that Ray does not stream here, labelled with its host."""
        self.line(f"(host {host}) {line}")

    def close(self) -> None:
        self._file.close()
