"""train.py's main under torchrun, then one line naming the threads still alive in this process.

tests/test_teardown.py runs it: once main has returned, no process group's threads may be left
for the interpreter's finalization to tear down."""

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import train  # noqa: E402

code = train.main(sys.argv[1:])
names = sorted(Path(f"/proc/self/task/{t}/comm").read_text().strip() for t in os.listdir("/proc/self/task"))
line = f"rank {os.environ['RANK']} threads after main: {' '.join(names)}\n"
os.write(1, line.encode())  # one write: the two ranks' lines never interleave
sys.exit(code)
