"""Does asking the broker for a pool's chunks in one round trip (Pool::map_chunks, which open_tensors calls before
it resolves the storages) shorten an open_tensors of the bench's 2 GiB dict? (issue 13)

The owner publishes the dict (291 bf16 tensors, gpuipc.torch.MemPool, three 1 GiB chunks) as open_stages.py does.
Fresh spawned children (torch and CUDA initialised), taking turns:
  batched  gpuipc.open_tensors as it is: the three chunks' Opens go to the broker together, then each is imported;
  serial   the same with map_chunks made a no-op: each chunk is opened (one broker round trip) when the resolve
           loop reaches its first block, as before.
Each child times one open as _open_owner.timed_open does. Prints one JSON line per child, then the medians.
Usage: python map_chunks_ab.py [repeats] [layers: 32 the 2 GiB dict, 340 the 16 GiB one]
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _open_owner import patched_open_child, print_medians, serve  # noqa: E402


def serial(_gpuipc):
    _gpuipc.Pool.map_chunks = lambda self, raw: None


def child(variant, name, q):
    patched_open_child(variant, name, q, "serial", serial)


def main():
    print_medians(serve(child, ("batched", "serial"), "mapchunks", 8), ("batched", "serial"))


if __name__ == "__main__":
    main()
