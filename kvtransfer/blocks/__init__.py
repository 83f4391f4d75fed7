"""Block data: the cache layout both sides share, packing and unpacking frames, staging buffers."""
