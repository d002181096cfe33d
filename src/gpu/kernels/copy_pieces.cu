// The piece copy of kvxfer's GPU paths: many (dst, src, len) copies between
// device memory (or to and from pinned host memory: the staging buffers) in
// one launch, a thread block per table entry. The driver
// charges a few microseconds per cuMemcpyAsync (and per entry of
// cuMemcpyBatchAsync), which caps a KV cache's 16 KiB fragments far below
// the memory's speed; one launch does not.
//
// Compiled to PTX by ci/gen-copy-ptx.py (NVRTC), which writes
// copy_pieces.ptx beside this file; the library embeds that PTX and the
// driver compiles it for the GPU on first use.

struct Piece {
    unsigned long long dst;
    unsigned long long src;
    unsigned long long len;
};

extern "C" __global__ void kvxfer_copy_pieces(const Piece *table, unsigned int n) {
    for (unsigned int i = blockIdx.x; i < n; i += gridDim.x) {
        const Piece p = table[i];
        char *d = reinterpret_cast<char *>(p.dst);
        const char *s = reinterpret_cast<const char *>(p.src);
        unsigned long long head = 0;
        if (((p.dst | p.src) & 15) == 0) {
            const unsigned long long vecs = p.len >> 4;
            uint4 *dv = reinterpret_cast<uint4 *>(d);
            const uint4 *sv = reinterpret_cast<const uint4 *>(s);
            for (unsigned long long k = threadIdx.x; k < vecs; k += blockDim.x)
                dv[k] = sv[k];
            head = vecs << 4;
        }
        for (unsigned long long k = head + threadIdx.x; k < p.len; k += blockDim.x)
            d[k] = s[k];
    }
}
