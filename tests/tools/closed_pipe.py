#!/usr/bin/env python3
"""closed_pipe.py STATUS PATTERN DIR -- COMMAND...: COMMAND with its standard output a pipe whose
reader has gone (closed before it starts: the write fails every time, not only when a reader
happens to exit first), and SIGPIPE at its default action, as a shell leaves it. Passes when
COMMAND exits with STATUS, its stderr contains PATTERN, and DIR (where its other outputs go) holds
no temporary file (a name with '.tmp' in it) afterwards.
"""
import os
import subprocess
import sys


def main(argv):
    if len(argv) < 5 or argv[3] != "--":
        print(__doc__, file=sys.stderr)
        return 2
    want, pattern, directory, command = int(argv[0]), argv[1], argv[2], argv[4:]
    read_end, write_end = os.pipe()
    os.close(read_end)
    # restore_signals (the default) puts SIGPIPE back to its default action in the child.
    run = subprocess.run(command, stdout=write_end, stderr=subprocess.PIPE, timeout=280, check=False)
    os.close(write_end)
    err = run.stderr.decode(errors="replace")
    sys.stderr.write(err)
    left = sorted(name for name in os.listdir(directory) if ".tmp" in name)
    if run.returncode != want:
        print(f"closed_pipe.py: exit status {run.returncode}, expected {want}: {' '.join(command)}", file=sys.stderr)
        return 1
    if pattern not in err:
        print(f"closed_pipe.py: stderr lacks '{pattern}'", file=sys.stderr)
        return 1
    if left:
        print(f"closed_pipe.py: temporary files left in {directory}: {', '.join(left)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
