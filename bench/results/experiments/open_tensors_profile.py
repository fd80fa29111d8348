import cProfile, io, os, pstats, sys, time
import multiprocessing as mp

from _statedict_spec import spec as _spec  # noqa: E402


def spec():
    return _spec(32)

def child(name, q):
    import torch
    torch.cuda.init(); torch.zeros(1, device="cuda:0"); torch.cuda.synchronize()
    t = time.perf_counter(); import gpuipc; ti = time.perf_counter() - t
    out = {"import_ms": ti * 1e3}
    for k in range(3):
        t = time.perf_counter(); d = gpuipc.open_tensors(name, device=0); out[f"open{k}_ms"] = (time.perf_counter() - t) * 1e3; del d
    pr = cProfile.Profile(); pr.enable(); d = gpuipc.open_tensors(name, device=0); pr.disable(); del d
    s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(25); out["tottime"] = s.getvalue()
    s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("cumtime").print_stats(25); out["cumtime"] = s.getvalue()
    q.put(out)

if __name__ == "__main__":
    import torch, gpuipc, gpuipc.torch as gt
    name = f"prof{os.getpid()}"
    pool = gt.MemPool(name + ".weights", device=0)
    with torch.cuda.use_mem_pool(pool):
        sd = {n: torch.ones(sh, dtype=torch.bfloat16, device="cuda:0") for n, sh in spec()}
    torch.cuda.synchronize()
    for versions in (None, 1):
        nm = f"{name}{versions}"
        pub = gpuipc.share_tensors(nm, sd) if versions is None else gpuipc.publish_tensors(nm, sd, versions=1)
        ctx = mp.get_context("spawn"); q = ctx.Queue(); p = ctx.Process(target=child, args=(nm, q)); p.start()
        r = q.get(timeout=120); p.join(30)
        print(f"==== versions={versions}", {k: v for k, v in r.items() if not isinstance(v, str)})
        print(r["tottime"]); print(r["cumtime"])
        pub.close()
