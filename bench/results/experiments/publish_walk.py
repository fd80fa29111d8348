"""The publisher's walk alone: stream_publisher(by_reference=True) with no reader, publish() of a MemPool dict, in
turns on the same dict: StreamPublisher.update as built ("built": from c937edd on, a version like the last is sent
again without a walk), as built but with nothing recorded to send again ("walk": its inline path for tensors sent
as before), and with update replaced by the loop it had before that path ("general": one _add per tensor).

Run on a GPU machine with torch and the gpuipc wheel on the path:
    python publish_walk.py [layers]    (340: the 16 GiB dict of `gpuipc bench weights`, 3063 tensors; 32: 2 GiB)
"""

import json
import os
import statistics
import sys
import time

from _statedict_spec import spec  # noqa: E402 - this folder, beside the script


def main():
    import torch
    import gpuipc
    import gpuipc.torch as gt
    from gpuipc.streaming import StreamPublisher

    layers = int(sys.argv[1]) if len(sys.argv) > 1 else 340
    torch.cuda.set_device(0)
    name = f"walk{os.getpid()}"
    pool = gt.MemPool(name + ".w", device=0)
    with torch.cuda.use_mem_pool(pool):
        sd = {n: torch.empty(sh, dtype=torch.bfloat16, device="cuda:0") for n, sh in spec(layers)}
    items = list(sd.items())
    built = StreamPublisher.update

    def general(self, named_tensors):  # update before the inline path: _add for every tensor
        self._require()
        for key, t in named_tensors:
            self._add(key, t)

    s = torch.cuda.current_stream()
    out = {"device": torch.cuda.get_device_name(0), "tensors": len(items), "built_ms": [], "walk_ms": [], "general_ms": []}
    with gpuipc.stream_publisher(name, device=0, by_reference=True) as pub:
        pub.publish(items, stream=s)  # the first version describes every tensor
        for turn in range(24):
            way = ("built", "walk", "general")[turn % 3]
            StreamPublisher.update = general if way == "general" else built
            if way == "walk" and hasattr(pub, "_replay"):
                pub._replay = None
            elif way == "built":
                pub.publish(items, stream=s)  # after "general" nothing is recorded: this one records
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            pub.publish(items, stream=s)
            out[f"{way}_ms"].append((time.perf_counter() - t0) * 1e3)
        StreamPublisher.update = built
    gpuipc.Pool.unlink(name + ".w")  # its names outlive this process: the broker would keep its memory
    for way in ("built", "walk", "general"):
        ms = out[f"{way}_ms"]
        out[f"{way}_median_ms"] = statistics.median(ms)
        out[f"{way}_us_per_tensor"] = statistics.median(ms) * 1e3 / len(items)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
