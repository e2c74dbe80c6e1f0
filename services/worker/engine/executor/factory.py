"""``make_executor``: the executor that ``ParallelConfig.distributed_executor_backend`` names.

    "uni"  UniprocExecutor    the one worker in the core's own process (executor/executor.py)
    "mp"   MultiprocExecutor  one process per tensor-parallel rank (executor/multiproc.py)
    "ray"  RayExecutor        one Ray actor per rank (executor/ray_executor.py)

The choice lives here, above every executor, so that the seam (``executor.py``) imports none of
the executors built on it: ``rank.py`` imports the seam, the concrete executors import
``rank.py``, and only this module, which the engine core imports, sees them all.
"""

from services.worker.engine.config import EngineConfig
from services.worker.engine.executor.executor import Executor, UniprocExecutor


def make_executor(config: EngineConfig, show_progress: bool = True) -> Executor:
    backend = config.parallel.distributed_executor_backend
    if backend == "mp":  # imported only when chosen: zmq, subprocesses
        from services.worker.engine.executor.multiproc import MultiprocExecutor

        return MultiprocExecutor(config, show_progress)
    if backend == "ray":  # ... and Ray, which the other backends never need
        from services.worker.engine.executor.ray_executor import RayExecutor

        return RayExecutor(config, show_progress)
    return UniprocExecutor(config, show_progress)
