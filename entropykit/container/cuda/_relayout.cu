// Moving staged chunk payloads to where the decoder reads them (compiled by NVRTC).
//
// What it is: the loader stages each stream's bytes as they are in the file (a chunk
// payload may start at any byte), copies them to the device in one transfer, and this
// kernel copies every chunk payload to its 16-byte aligned place in the decoder's payload
// buffer (plan.py's layout), one block per copy row (src offset, dst offset, length).
// What it is not: a decoder; it checks nothing (plan.py made every row fit its buffers).
//
// Each thread writes aligned 32-bit words built from two aligned source words (funnel
// shift by the source's misalignment), so every access is a coalesced 4-byte one. The
// source buffer has 8 spare bytes past its end (the last row may read one word past its
// last byte); the destination rounds a row up to 4 bytes, inside its 16-byte padding.

extern "C" __global__ void relayout(const long long* __restrict__ rows, int n,
                                    const unsigned char* __restrict__ src,
                                    unsigned* __restrict__ dst) {
    for (int k = blockIdx.x; k < n; k += gridDim.x) {
        const long long s = rows[3 * k], d = rows[3 * k + 1], len = rows[3 * k + 2];
        const unsigned mis = (unsigned)(s & 3);
        const unsigned* a = reinterpret_cast<const unsigned*>(src + (s - mis));
        unsigned* b = dst + d / 4;
        const long long words = (len + 3) / 4;
        for (long long i = threadIdx.x; i < words; i += blockDim.x)
            b[i] = __funnelshift_r(a[i], mis ? a[i + 1] : 0u, 8 * mis);
    }
}
