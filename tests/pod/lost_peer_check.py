"""One process of a 2-process job (``tests/pod/test_lost_host.py``): joins through the project's
``distributed.initialize`` with a short heartbeat timeout, then meets its peer at a barrier again and again;
process 1 SIGKILLs itself after the first few (a host that dies without notice).

    python tests/pod/lost_peer_check.py PROCESS_ID PORT HEARTBEAT_TIMEOUT_S
"""

import os
import signal
import sys
import time

from jax.experimental import multihost_utils

from trace_jax.parallel.distributed import DistributedConfig, initialize


def main(process_id: int, port: int, heartbeat_timeout_s: int) -> None:
    config = DistributedConfig(
        mode="explicit",
        coordinator_address=f"127.0.0.1:{port}",
        num_processes=2,
        process_id=process_id,
        heartbeat_timeout_s=heartbeat_timeout_s,
    )
    initialize(config)
    for i in range(10_000):
        multihost_utils.sync_global_devices(f"step {i}")
        if i == 3:
            print(f"process {process_id}: past barrier 3", flush=True)
            if process_id == 1:
                os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(0.1)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))
