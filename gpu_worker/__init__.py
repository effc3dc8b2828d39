"""The GPU worker process: weights, the paged KV store, attention kernels, sampling. It decides nothing."""
