"""``baton serve FLAGS`` run and stopped from this process, for tests and benchmarks."""

import contextlib
from collections.abc import Iterator

from baton.cli import build_parser
from baton.launcher import Cluster, free_port
from baton.service_cli import cluster_spec


@contextlib.contextmanager
def serving(*flags: str, supervise: bool = True) -> Iterator[Cluster]:
    """The whole cluster, ready, on a free port unless FLAGS name one, its dead services
    restarted as ``baton serve`` restarts them (from a thread; ``supervise=False``: not at
    all); stopped on exit."""
    port = [] if "--port" in flags else ["--port", str(free_port())]
    cluster = Cluster(cluster_spec(build_parser().parse_args(["serve", *flags, *port])))
    try:
        cluster.start()
        if supervise:
            cluster.supervise_in_background()
        yield cluster
    finally:
        cluster.stop()
