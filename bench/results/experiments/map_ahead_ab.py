"""Does mapping a pool's chunks on a thread of their own (Pool::map_ahead, which tensors_of_index uses) shorten an
open_tensors of the bench's 2 GiB dict? (issue 13)

The owner publishes the dict (291 bf16 tensors, gpuipc.torch.MemPool, three 1 GiB chunks) as open_stages.py does.
Fresh spawned children (torch and CUDA initialised), taking turns:
  ahead    gpuipc.open_tensors as it is: tensors_of_index maps the chunks after the first on a thread meanwhile;
  serial   the same with map_ahead=False: each chunk is mapped when the loop reaches its first block.
Each child makes one broker call first (a stat of the index), so that the broker's wake-up from idle is not part of
either, then times open_tensors, then every tensor's data_ptr() and a stream synchronize, as the weights suite's
consumers do. Prints one JSON line per child, then the medians. Usage: python map_ahead_ab.py [repeats]

Ran at d5df926 (map-ahead-ab-d5df926-h200-20261127.log): on an H200, 3.05 ms (2.47-3.83) ahead against 2.78 ms
(1.83-2.91) serial, medians of eight children each. The next commit took Pool::map_ahead out again, and with it the
map_ahead argument this script passes: run it on d5df926.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _open_owner import patched_open_child, print_medians, serve  # noqa: E402


def serial(_gpuipc):
    orig = _gpuipc.Pool.tensors_of_index

    def without_map_ahead(self, *args, **kwargs):
        return orig(self, *args, map_ahead=False)

    _gpuipc.Pool.tensors_of_index = without_map_ahead


def child(variant, name, q):
    patched_open_child(variant, name, q, "serial", serial)


def main():
    print_medians(serve(child, ("ahead", "serial"), "ahead", 5), ("ahead", "serial"))


if __name__ == "__main__":
    main()
