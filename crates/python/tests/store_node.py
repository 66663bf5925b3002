"""A storage node process for the store tests: ``python store_node.py MASTER SIZE``.

Joins the store at MASTER over TCP with a segment of SIZE bytes, prints its endpoint,
and serves until its stdin closes.
"""

import sys

from pagewire import StoreClient


def main() -> None:
    master, size = sys.argv[1], int(sys.argv[2])
    node = StoreClient(master, listen="127.0.0.1:0", transport="tcp", segment_size=size)
    print(f"READY {node.endpoint}", flush=True)
    sys.stdin.read()
    node.close()


if __name__ == "__main__":
    main()
