"""A stand-in for `rlax <argv>` in backend tests: cheap to start, with controllable outcomes.

``job_program.py exit K``          exits with code K
``job_program.py fail MESSAGE``    ends as an uncaught error does: "RuntimeError: MESSAGE" as the
                                   last line of its stderr, exit code 1
``job_program.py env NAME``        prints NAME=<its value in the environment>
``job_program.py sleep S``         sleeps S seconds, then exits 0
``job_program.py group S [P K]``   prints the variables the node agent sets (worker, host address,
                                   process id/count, coordinator) as NAME=value lines, then
                                   sleeps S seconds and exits 0; the process with
                                   RLAX_PROCESS_ID P exits with code K at once instead
``job_program.py count PATH N S``  a resumable job: continues counting from the last step saved
                                   in PATH (its "checkpoint") up to N, one step every S seconds,
                                   then exits 0; prints "resumed from step K" first
``job_program.py tpu``             sets up JAX's backends (where a TPU VM's libtpu loads) and
                                   prints platform=<the platform JAX chose> and
                                   devices=<its local device count>
"""

import os
import sys
import time

from rlax_tasks.compute.types import (
    COORDINATOR_ADDRESS_ENV,
    HOST_ADDRESS_ENV,
    NUM_PROCESSES_ENV,
    PROCESS_ID_ENV,
    WORKER_ID_ENV,
)

GROUP_VARS = (
    WORKER_ID_ENV,
    HOST_ADDRESS_ENV,
    PROCESS_ID_ENV,
    NUM_PROCESSES_ENV,
    COORDINATOR_ADDRESS_ENV,
)


def main(argv: list[str]) -> int:
    cmd = argv[0]
    if cmd == "exit":
        print(f"exiting with {argv[1]}", file=sys.stderr)
        return int(argv[1])
    if cmd == "fail":
        print(f"Traceback (most recent call last):\nRuntimeError: {argv[1]}", file=sys.stderr)
        return 1
    if cmd == "env":
        print(f"{argv[1]}={os.environ.get(argv[1], '')}")
        return 0
    if cmd == "group":
        for name in GROUP_VARS:
            print(f"{name}={os.environ.get(name, '')}", flush=True)
        if len(argv) > 3 and os.environ.get(PROCESS_ID_ENV) == argv[2]:
            print(f"process {argv[2]} exiting with {argv[3]}", file=sys.stderr)
            return int(argv[3])
        time.sleep(float(argv[1]))
        return 0
    if cmd == "sleep":
        time.sleep(float(argv[1]))
        return 0
    if cmd == "count":
        path, total, step_s = argv[1], int(argv[2]), float(argv[3])
        step = int(open(path).read()) if os.path.exists(path) else 0
        print(f"resumed from step {step}", flush=True)
        while step < total:
            time.sleep(step_s)
            step += 1
            with open(path + ".tmp", "w") as fh:
                fh.write(str(step))
            os.replace(path + ".tmp", path)
        return 0
    if cmd == "tpu":
        import jax

        from rlax_tasks.process.device_check import found_platform

        print(f"platform={found_platform()}", flush=True)
        print(f"devices={jax.local_device_count()}", flush=True)
        return 0
    print(f"unknown command {cmd!r}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
