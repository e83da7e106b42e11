// CRC-32 (zlib's) of staged byte ranges, checked on the device (compiled by NVRTC).
//
// What it is: the loader stages field payloads as the file holds them and the host reads
// only their heads; these kernels check the rest. Each row (staged offset, length, seed,
// wanted CRC) is cut into pieces of PIECE bytes, one thread each: ``crc_pieces`` computes
// a piece's raw CRC register (start 0, no final inversion), shifts it past the bytes of
// the row after it (multiplication by x^(8 * after) mod P) and XORs it into the row's
// accumulator; ``crc_finish`` adds the seed's term and writes 1 to the row's status
// where the CRC differs from the wanted one. CRC-32 is affine over GF(2), so the XOR of
// the shifted pieces is the register of the whole row whatever order they land in.
// What it is not: a decoder or a check of what the bytes mean.

#define POLY 0xedb88320u

// x^(2^k) mod P, k = 0..31 (zlib's x2n_table).
__constant__ unsigned X2N[32] = {
    0x40000000u, 0x20000000u, 0x08000000u, 0x00800000u, 0x00008000u, 0xedb88320u,
    0xb1e6b092u, 0xa06a2517u, 0xed627daeu, 0x88d14467u, 0xd7bbfe6au, 0xec447f11u,
    0x8e7ea170u, 0x6427800eu, 0x4d47bae0u, 0x09fe548fu, 0x83852d0fu, 0x30362f1au,
    0x7b5a9cc3u, 0x31fec169u, 0x9fec022au, 0x6c8dedc4u, 0x15d6874du, 0x5fde7a4eu,
    0xbad90e37u, 0x2e4e5eefu, 0x4eaba214u, 0xa8a472c0u, 0x429a969eu, 0x148d302au,
    0xc40ba6d0u, 0xc4e22c3cu};

// a * b mod P, polynomials in zlib's reflected bit order.
__device__ unsigned multmodp(unsigned a, unsigned b) {
    unsigned m = 1u << 31, p = 0;
    for (;;) {
        if (a & m) {
            p ^= b;
            if ((a & (m - 1)) == 0) break;
        }
        m >>= 1;
        b = b & 1 ? (b >> 1) ^ POLY : b >> 1;
    }
    return p;
}

// A register moved past n zero bytes: r * x^(8n) mod P.
__device__ unsigned shift(unsigned r, unsigned long long n) {
    unsigned k = 3;
    while (n) {
        if (n & 1) r = multmodp(X2N[k & 31], r);
        n >>= 1;
        k++;
    }
    return r;
}

__device__ __forceinline__ unsigned step(const unsigned* t, unsigned r, unsigned b) {
    return t[(r ^ b) & 0xff] ^ (r >> 8);
}

// rows: int64[n, 4] (offset in ``staged``, length, seed, wanted CRC); first: int64[n + 1],
// the first piece of each row (first[n]: all pieces); acc: one u32 per row, zeroed.
extern "C" __global__ void crc_pieces(const long long* __restrict__ rows,
                                      const long long* __restrict__ first, int n,
                                      const unsigned char* __restrict__ staged,
                                      unsigned* __restrict__ acc) {
    __shared__ unsigned table[256];
    for (int i = threadIdx.x; i < 256; i += blockDim.x) {
        unsigned c = i;
        for (int k = 0; k < 8; k++) c = c & 1 ? (c >> 1) ^ POLY : c >> 1;
        table[i] = c;
    }
    __syncthreads();
    const long long total = first[n];
    for (long long p = blockIdx.x * (long long)blockDim.x + threadIdx.x; p < total;
         p += (long long)gridDim.x * blockDim.x) {
        int lo = 0, hi = n - 1;  // the row whose pieces hold p: first[row] <= p < first[row+1]
        while (lo < hi) {
            const int mid = (lo + hi + 1) / 2;
            if (first[mid] <= p) lo = mid; else hi = mid - 1;
        }
        const long long* row = rows + 4 * lo;
        const long long at = (p - first[lo]) * PIECE;
        const long long len = min((long long)PIECE, row[1] - at);
        const unsigned char* a = staged + row[0] + at;
        const unsigned char* end = a + len;
        unsigned r = 0;
        while (a < end && ((unsigned long long)a & 15)) r = step(table, r, *a++);
        for (; a + 16 <= end; a += 16) {
            const uint4 w = __ldg(reinterpret_cast<const uint4*>(a));
            const unsigned ws[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
            for (int k = 0; k < 4; k++)
#pragma unroll
                for (int b = 0; b < 4; b++) r = step(table, r, (ws[k] >> (8 * b)) & 0xff);
        }
        while (a < end) r = step(table, r, *a++);
        atomicXor(acc + lo, shift(r, (unsigned long long)(row[1] - at - len)));
    }
}

// status[i] = 1 where row i's CRC (its seed's term added to acc[i]) is not the wanted one.
extern "C" __global__ void crc_finish(const long long* __restrict__ rows, int n,
                                      const unsigned* __restrict__ acc,
                                      int* __restrict__ status) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        const long long* row = rows + 4 * i;
        const unsigned crc = ~(acc[i] ^ shift(~(unsigned)row[2], (unsigned long long)row[1]));
        status[i] = crc != (unsigned)row[3];
    }
}
