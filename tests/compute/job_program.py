"""A stand-in for `rlax <argv>` in backend tests: cheap to start, with controllable outcomes.

``job_program.py exit K``          exits with code K
``job_program.py env NAME``        prints NAME=<its value in the environment>
``job_program.py sleep S``         sleeps S seconds, then exits 0
``job_program.py count PATH N S``  a resumable job: continues counting from the last step saved
                                   in PATH (its "checkpoint") up to N, one step every S seconds,
                                   then exits 0; prints "resumed from step K" first
"""

import os
import sys
import time


def main(argv: list[str]) -> int:
    cmd = argv[0]
    if cmd == "exit":
        print(f"exiting with {argv[1]}", file=sys.stderr)
        return int(argv[1])
    if cmd == "env":
        print(f"{argv[1]}={os.environ.get(argv[1], '')}")
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
    print(f"unknown command {cmd!r}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
