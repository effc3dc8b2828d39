"""The one-shot all-reduce's launch shape on two GPUs: programs per SM and warps, plain sum and the fused norm, at the
decode's sizes (rows x 4096 bf16), each in a CUDA graph of 50 calls."""

import os
import tempfile

import torch
import torch.multiprocessing as mp


def rank_main(rank, tmp):
    import torch.distributed as dist

    from benchmarks.tensor_parallel import _graphed_us
    from gpu_worker import all_reduce_kernels as K
    from gpu_worker.parallel import init_tensor_parallel

    tp = init_tensor_parallel(rank, 2, os.path.join(tmp, "store"), "cuda", peer_max_bytes=16 * 2**20)
    dev = torch.device("cuda", rank)
    base = tp.peer.state
    sms = base.programs
    # Experimental states: 4 MiB slots (2 parities x 2 ranks = 16 MiB of the 64 MiB allocated), flags carved past them.
    slot = 4 * 2**20
    base.memory[2 * 2 * slot : 2 * 2 * slot + 4 * 2**16].zero_()  # one 64 KiB flag region per grid size
    torch.cuda.synchronize()
    dist.barrier()
    hidden = 4096
    states = {}
    for rows in (8, 64, 256, 512):
        x = torch.randn(rows, hidden, dtype=torch.bfloat16, device=dev)
        ref = x.clone()
        dist.all_reduce(ref)
        weight, residual = torch.randn(hidden, dtype=x.dtype, device=dev), torch.randn_like(x)
        for mult in (1, 2, 4):
            if mult not in states:
                flags = base.buffer_bases + 2 * 2 * slot + mult.bit_length() * 2**16  # 1, 2, 4 -> regions 1, 2, 3
                states[mult] = K.PeerState(rank, 2, base.buffer_bases, flags, sms * mult, slot)
            st = states[mult]
            for warps in (4, 8, 16):
                for chunk in (2048, 4096, 8192):

                    def plain(st=st, warps=warps, chunk=chunk):
                        out = torch.empty_like(x)
                        K._sum_kernel[(st.programs,)](
                            x,
                            out,
                            st.buffer_bases,
                            st.flag_bases,
                            st.epochs,
                            x.numel(),
                            st.slot_bytes // 2,
                            CHUNK=chunk,
                            num_warps=warps,
                            RANK=rank,
                            WORLD=2,
                            PROGRAMS=st.programs,
                        )
                        return out

                    ok = torch.equal(plain(), ref)
                    us = _graphed_us(plain, 50)
                    if rank == 0:
                        print(
                            f"rows {rows:4d} plain  programs {st.programs:4d} warps {warps:2d} chunk {chunk:5d}: {us:6.2f} us ok={ok}",
                            flush=True,
                        )
                # fused: patch the launch's warps through the state's method (enable_fp_fusion False as the engine)
                out = torch.empty_like(x)
                res = residual.clone()

                def fused(st=st, warps=warps, res=res, out=out):
                    K._sum_add_rms_norm_kernel[(st.programs,)](
                        x,
                        res,
                        out,
                        None,
                        weight,
                        st.buffer_bases,
                        st.flag_bases,
                        st.epochs,
                        rows,
                        st.slot_bytes // 2,
                        1e-5,
                        x.stride(0),
                        res.stride(0),
                        out.stride(0),
                        448.0,
                        1 / 448.0,
                        1e-12,
                        N=hidden,
                        N_PAD=hidden,
                        OFFSET=0.0,
                        SCALE_IN_FP32=False,
                        QUANTIZE=False,
                        num_warps=warps,
                        enable_fp_fusion=False,
                        RANK=rank,
                        WORLD=2,
                        PROGRAMS=st.programs,
                    )

                us = _graphed_us(fused, 50)
                if rank == 0:
                    print(f"rows {rows:4d} fused  programs {st.programs:4d} warps {warps:2d}: {us:6.2f} us", flush=True)
        torch.cuda.synchronize()
        dist.barrier()
    dist.barrier()
    os._exit(0)


if __name__ == "__main__":
    tmp = tempfile.mkdtemp()
    mp.spawn(rank_main, args=(tmp,), nprocs=2)
