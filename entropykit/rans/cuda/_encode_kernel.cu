// Static 32-lane rANS encoder of one frame's chunks, the CPU encoder's bytes
// (rans/kernels.py: encode_chunk), and the chunks' CRC-32 and payload gather.
//
// rans_encode: one warp per chunk. Lane j owns symbols j, j + 32, ... of its chunk and
// encodes them backwards, step by step, as the CPU encoder does; within a step the CPU
// emits lanes 31..0 in turn, so a lane's word is the (words so far + emitting lanes
// above it)-th from the end of the chunk's slot: one ballot places every word of a step.
// Slot c (chunk bytes at c * chunk) receives the payload at its end: start[c] is where it
// begins in the slot, or -1 where the coded chunk would not be smaller than the CPU's
// buffer of one byte per symbol (the frame stores the chunk raw). Tables: encode_tables'
// uint64 pairs per (table, symbol); CTX builds take each symbol's table from
// cmap[ctx[i]] (checked by the host: every entry below the table count).
//
// chunk_crc: one thread per chunk, zlib's CRC-32 of its symbols, byte by byte.
// gather: one block per chunk, its payload (coded from its slot, or its raw symbols)
// copied to its offset in the frame's payload area.

#ifndef CTX
#define CTX 0
#endif

#define LANES 32
#define STATE_BYTES 128
#define RANS_L 65536u

extern "C" __global__ void rans_encode(
    const unsigned char* __restrict__ sym, const unsigned char* __restrict__ ctx,
    const long long* __restrict__ cmap, const unsigned long long* __restrict__ tab,
    long long n, int chunk, int n_chunks, int precision,
    unsigned char* __restrict__ slots, long long* __restrict__ start) {
    const int lane = threadIdx.x & 31;
    const long long c = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (c >= n_chunks) return;
    const long long first = c * chunk;
    const int m = (int)min((long long)chunk, n - first);
    unsigned char* out = slots + first;
    unsigned int x = RANS_L;
    long long words = 0;  // emitted so far (the same in every lane)
    const int full = m - m % LANES;
    // The partial last step first (lanes below m % 32), then whole steps, backwards.
    for (int base = (m % LANES) ? full : full - LANES; base >= 0; base -= LANES) {
        const int i = base + lane;
        const bool live = i < m;
        unsigned long long r0 = 0, r1 = 0;
        if (live) {
            int k = 0;
#if CTX
            k = (int)cmap[ctx[first + i]];
#endif
            const unsigned long long* t = tab + 2 * (256 * (long long)k + sym[first + i]);
            r0 = t[0];
            r1 = t[1];
        }
        unsigned long long xs = x;
        const bool emit = live && xs > (r0 >> 32);
        const unsigned int ballot = __ballot_sync(0xffffffffu, emit);
        if (emit) {
            const long long idx = words + __popc(lane == 31 ? 0u : ballot >> (lane + 1));
            const long long pos = m - 2 * (idx + 1);
            if (pos >= STATE_BYTES) {  // else the chunk is stored raw: nothing is kept
                out[pos] = (unsigned char)(xs & 0xFF);
                out[pos + 1] = (unsigned char)((xs >> 8) & 0xFF);
            }
            xs >>= 16;
        }
        words += __popc(ballot);
        if (live) {
            const unsigned long long f = r1 & 0xFFFFull;
            const unsigned long long q =
                (xs + ((xs * (r0 & 0xFFFFFFFFull)) >> 32)) >> (r1 >> 32);
            const unsigned long long s0 = (r1 >> 16) & 0xFFFFull;
            x = (unsigned int)((q << precision) + (xs - q * f) + s0);
        }
    }
    const long long at = m - 2 * words - STATE_BYTES;
    if (at < 0) {
        if (lane == 0) start[c] = -1;
        return;
    }
    const long long o = at + 4 * lane;
    out[o] = (unsigned char)(x & 0xFF);
    out[o + 1] = (unsigned char)((x >> 8) & 0xFF);
    out[o + 2] = (unsigned char)((x >> 16) & 0xFF);
    out[o + 3] = (unsigned char)(x >> 24);
    if (lane == 0) start[c] = at;
}

extern "C" __global__ void chunk_crc(
    const unsigned char* __restrict__ sym, const unsigned int* __restrict__ table,
    long long n, int chunk, int n_chunks, unsigned int* __restrict__ crcs) {
    const long long c = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= n_chunks) return;
    const long long first = c * chunk;
    const long long last = min(first + chunk, n);
    unsigned int crc = 0xFFFFFFFFu;
    for (long long i = first; i < last; ++i) crc = table[(crc ^ sym[i]) & 0xFF] ^ (crc >> 8);
    crcs[c] = ~crc;
}

extern "C" __global__ void gather(
    const unsigned char* __restrict__ sym, const unsigned char* __restrict__ slots,
    const long long* __restrict__ start, const long long* __restrict__ offset,
    long long n, int chunk, unsigned char* __restrict__ dst) {
    const long long c = blockIdx.x;
    const long long first = c * chunk;
    const long long m = min((long long)chunk, n - first);
    const long long s = start[c];
    const unsigned char* src = s < 0 ? sym + first : slots + first + s;
    const long long len = s < 0 ? m : m - s;
    unsigned char* d = dst + offset[c];
    for (long long i = threadIdx.x; i < len; i += blockDim.x) d[i] = src[i];
}
