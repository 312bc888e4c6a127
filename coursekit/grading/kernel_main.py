"""The kernel's entry point (sandboxed or not):
``python -m coursekit.grading.kernel_main [--nproc N] -f CONNECTION_FILE``.

Sets the limits that only make sense inside the sandbox (the number of tasks, counted
per user namespace), then starts ipykernel exactly like ``ipykernel_launcher`` does.
"""

from __future__ import annotations

import resource
import sys


def main() -> None:
    args = sys.argv[1:]
    if len(args) >= 2 and args[0] == "--nproc":
        n = int(args[1])
        args = args[2:]
        try:
            resource.setrlimit(resource.RLIMIT_NPROC, (n, n))
        except (ValueError, OSError):  # pragma: no cover - a hard limit already lower
            pass
    sys.argv = [sys.argv[0], *args]
    if sys.path and sys.path[0] == "":  # like ipykernel_launcher: not the cwd
        del sys.path[0]
    from ipykernel import kernelapp

    kernelapp.launch_new_instance()


if __name__ == "__main__":
    main()
