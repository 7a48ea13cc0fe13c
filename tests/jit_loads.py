"""What a call loads of numba's compiled functions, seen from a fresh process (in the test
process, earlier tests have loaded them already)."""

import subprocess
import sys


def unloaded_after(module: str, names: list[str], imports: str, call: str) -> list[str]:
    """The functions ``names`` of ``module`` (numba dispatchers) that ``call`` leaves unloaded, in a
    fresh Python that ran ``imports`` first (none loaded before ``call``: checked)."""
    script = (f"import {module} as m\n{imports}\n"
              f"calls = [getattr(m, name) for name in {names!r}]\n"
              "assert not any(f.signatures for f in calls), 'loaded before the call'\n"
              f"{call}\n"
              "print(','.join(f.__name__ for f in calls if not f.signatures))\n")
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    return [name for name in run.stdout.strip().split(",") if name]
