"""`python -m threefold.kernels`: build (or find cached) every kernel target this CPU runs.

`make test` runs it first, so the builds (about a minute each on 2 cores) happen once, up
front and with progress, rather than inside the first test that needs them (where a
subprocess under a timeout, such as the CLI tests', would pay for them).
"""

from __future__ import annotations

import sys
import time

from threefold.kernels import available_targets, build_kernels


def main() -> int:
    targets = available_targets()
    if not targets:
        print("kernels: no native build on this platform; the torch path runs")
        return 0
    for i, target in enumerate(targets, 1):
        start = time.perf_counter()
        print(f"kernels: [{i}/{len(targets)}] {target} ...", end=" ", flush=True)
        try:
            module = build_kernels(target)
        except Exception as exc:  # noqa: BLE001 -- report and go on: the tests say what is missing
            print(f"failed ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})")
            continue
        print(f"{module.build_isa()} in {time.perf_counter() - start:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
