// The CUDA kernel of entropykit's batched rANS decoder (compiled at first use by NVRTC).
//
// What it is: one warp decodes two chunk streams (two rows of the descriptor table that
// plan.py builds; _layout.py names the columns, passed in as -D macros) in lock step, 32
// symbols per step, one lane per interleaved rANS state (lane = i % 32).
//   u8 mode (BF16 0): the two streams are independent chunks, each writes its own bytes.
//   bf16 mode (BF16 1): stream a is an exponent chunk, stream b the sign_mantissa chunk of
//     the same position; the warp writes (sm >> 7) << 15 | exp << 7 | (sm & 0x7f).
//     CTX: b's tables are chosen per symbol by the class of a's symbol (cmap[exp]).
//   CLS (either mode; in bf16 mode stream a only): a stream whose row has D_GRID >= 0 is
//     classed (the "rans2d" codec):
//     the table of its symbol at row r, column j of rows of D_WIDTH is
//     cmaps[D_GRID + rowmap[r] + colmap[j]] (rowmap holds class * kc; a map at -1 is all
//     0). Each lane keeps its symbol's (row, column), moved 32 symbols on each step, so no
//     step divides; classed tables are read through L1 (a frame's 16 table sets do not
//     fit beside the rings).
// What it is not: a parser. plan.py has checked every structural fact (offsets, lengths,
// alignment, table sums, output sizes); the kernel checks what depends on the coded data
// (start states, words missing, words left over, final states) and writes per stream its
// status (ERR_*: entropykit._status, the CPU kernel's codes) to status. Every global read is
// clamped into its stream's payload or table and every write into its stream's symbols,
// so a hostile payload moves no access outside the buffers.
//
// Step invariant (the CPU kernel's): x in [2^16, 2^32); slot = x & (2^p - 1); s = sym[slot];
// x = f_s * (x >> p) + slot - start_s; a lane whose x fell under 2^16 takes the next 16-bit
// word. The needy lanes take consecutive words in lane order: lane k reads word
// wp + popc(ballot & lanes-below-k), and wp advances by popc(ballot).
//
// Output: symbol i of a stream goes to element D_OUT + i * D_STEP of the output (bytes in u8
// mode, 16-bit elements in bf16 mode), so a byte plane lands straight in a wider tensor.
//
// Speed (docs/gpu.md says why): each step's table reads are random gathers,
// which through L1 cost ~20 cache wavefronts each; so with SMEM (every p <= 12) the block
// copies its table sets into shared memory first (4 KiB of slot -> symbol bytes and 1 KiB of
// f | start << 16 each). plan.py makes every warp of a block use the same tables, so one
// copy serves all WARPS warps (n_slots sets: a's, and b's where b has its own; in CTX
// builds b reads its class tables through L1), and a warp's own shared memory is only its
// two word rings. Each step's word reads wait on the step before, so they must not wait
// on global memory: each stream streams its payload through a ring of RING_WINDOWS
// 64-word windows in shared memory, copied asynchronously (cp.async; at LANES 1 lanes
// 0-15 copy for stream a, 16-31 for b, so each lane's copy groups belong to one stream)
// AHEAD windows ahead of the window being read. Raw chunks go through the same ring (16
// words a step). Raw/coded is fixed per stream, so each combination gets its own loop.
//
// Staged output (VEC builds, no contexts): a pair whose outputs are contiguous (step 1) and
// 16-byte aligned (and, in bf16 mode, whose exponent stream is coded) decodes in rounds of
// 16 steps (512 symbols): each step only drops a coded stream's symbols into the warp's
// staging bytes in shared memory; at the round's end lane k takes symbols 16 k .. 16 k + 15
// and writes them with 16-byte stores (bf16 mode: turned into bf16 values with byte
// permutes first). A raw stream then skips its ring: lane k reads its 16 bytes of the
// round with one 16-byte load, issued a round ahead (u8 mode: a raw chunk is a 16-byte
// copy). This cuts the per-symbol instructions (no per-step narrow store and its address
// math, compose, raw ring read or ring slide), which bound the kernel (docs/gpu.md).
// The last < 512 symbols take a scalar path with the same output places.
//
// Table layout (TABLES, a build option; 1 unless the runtime asks): 0 reads a step's
// tables as two gathers, slot -> symbol byte, then symbol -> f | start << 16; 1 (packed,
// SMEM builds only) stages one word per slot, sym | (f - 1) << 8 | (slot - start) << 20
// (every field fits 12 bits since p <= 12; f - 1 because f may be 2^12), built by the
// block from the same two tables: one gather a step instead of two, and a dependency
// chain one shared-memory load shorter. Tables read through L1 (CTX's b, classed
// streams, p > 12) keep layout 0.
//
// Lanes a thread (LANES, a build option; 1 unless the runtime asks; classed builds keep
// 1): at 2 a pair is decoded by a half-warp (a group of GROUP = 16 threads; a block still
// holds WARPS pairs, in WARPS / 2 warps) and thread g holds lanes g and g + 16 of both
// streams, as states j = 0 and 1. A step of a stream is j = 0 (lanes 0-15) then j = 1
// (16-31), each with its own ballot, so the words still go to the needy lanes in lane
// order: the stream layout is the one the CPU writes. The two states' table reads and
// multiplies do not depend on each other, so one thread has twice the independent chains
// in flight (and the registers for them: 128 a thread at half the threads). The group's
// votes, syncs and reductions take its mask; 8 threads copy each stream's windows, 16
// bytes each.
//
// Warp-uniform control (UNIFORM, a build option; 0 unless the runtime asks): the compiler
// cannot tell that a warp's descriptor values are the same in every lane (the row index
// comes from threadIdx), so it takes the loops and branches they steer as possibly
// divergent and compiles each vote.sync with its fallback for diverged warps (a
// WARPSYNC.COLLECTIVE ... ENDCOLLECTIVE sequence and a reconvergence barrier: about six
// more instructions a step). At LANES 1 UNIFORM takes the warp's index from lane 0 with a
// shuffle, which the compiler knows to be warp-uniform, so everything loaded from its row
// is too. At LANES 2 (U2; whole warps: WARPS even) the two halves' loops are made to run
// in step: round and step counts are the warp's least / greatest (a half past its own end
// steps with no live symbol: no reads, votes bits or writes), the path is the two pairs'
// common one (else the per-step loop that lets each lane take a raw or coded step:
// KIND_EITHER), a ring slide is entered when either half needs it, and votes and syncs
// take the whole warp (the popcounts still mask to the group).
//
// Byte ring cursor (RENORM, a build option; 0 unless the runtime asks): wp and base count
// bytes (WU = 2 a word) and every ring starts at a multiple of its size (the pairs' area
// is padded up to one and each pair's share rounded up to one; the runtime reserves a
// ring more), so a step's word address is (wp + 2 k) & (size - 2) | ring: two
// instructions instead of four (ring_word).
//
#ifndef TABLES
#define TABLES 0
#endif
#ifndef LANES
#define LANES 1
#endif
#ifndef UNIFORM
#define UNIFORM 0
#endif
#ifndef RENORM
#define RENORM 0
#endif
#define WU (RENORM ? 2 : 1)  // units of wp and base a word: RENORM counts bytes
#if LANES != 1 && LANES != 2
#error "LANES must be 1 or 2"
#endif
#if LANES > 1 && CLS
#error "classed builds keep one lane a thread (a lane's row and column are per thread)"
#endif
#define U2 (UNIFORM && LANES > 1)  // both halves of a warp in step (header)
#if U2 && WARPS % 2
#error "UNIFORM at LANES 2 needs whole warps: an even number of pairs a block"
#endif
#define GROUP (32 / LANES)  // threads decoding one pair: a warp, or a half-warp at LANES 2
#define HALF (GROUP / 2)    // threads of a group copying one stream's windows
#define COPY (128 / HALF)   // bytes one of them copies a window: 8, or 16 at LANES 2
#define VEC (!CTX && !CLS)  // staged output: the builds without contexts or classes
// blocks an SM for 32 resident warps' worth of pairs (WARPS pairs a block), so at most 64
// registers a thread at LANES 1 (the staged u8 build would take more and halve the
// resident warps), 128 at LANES 2 (half the threads, each with twice the states)
#define MIN_BLOCKS (32 / WARPS > 1 ? 32 / WARPS : 1)

#define LB 65536u
#define FULL_MASK 0xffffffffu
#define PACKED (TABLES == 1 && SMEM)  // shared table sets hold one word per slot
#define PACKED_B (PACKED && !CTX)      // b's tables are in shared memory (CTX: L1, layout 0)
// bytes of one table set in shared memory: 2^12 packed words, or symbol bytes + infos
#define SMEM_STREAM (PACKED ? 4 * 4096 : 4096 + 1024)
// staging bytes a pair: a round's exponents, then sm bytes
#define STAGE (VEC ? 1024 : 0)
// shared-memory bytes a pair: word rings, staging (RENORM: a multiple of a ring's 2 RING
// bytes, so every ring starts at a multiple of its size)
#define WARP_SMEM ((4 * RING + STAGE + (RENORM ? 2 * RING - 1 : 0)) / (RENORM ? 2 * RING : 1) \
                   * (RENORM ? 2 * RING : 1))

#define RING (64 * RING_WINDOWS)  // words per stream ring: windows of 64 (128 bytes)
#define AHEAD (RING_WINDOWS - 2)   // windows copied ahead of the one being read

struct Stream {
    const unsigned char* bytes;   // the payload's words (coded) or bytes (raw), global
    const unsigned short* ring;   // RING words; window j (words 64 j ..) in slot j % 8
    unsigned ring_addr;           // the ring's shared-memory address, for cp.async
    const unsigned char* sym;     // table 0's slot -> symbol (global)
    const unsigned* info;         // table 0's f | start << 16 per symbol (global)
    int n, n_words, n_bytes, wp, base;  // wp: words consumed; base = 64 * (window of wp)
                                        // (both in bytes at RENORM: WU a word)
    int owner;                    // 0 or HALF: the threads of the group that copy its windows
    unsigned p, x[LANES], x0[LANES];  // state j: the state of lane g + GROUP j
    bool is_raw, coded;
#if CLS
    const unsigned char* grid;    // the frame's context map -> table (cmaps)
    const unsigned char* rmap;    // row classes * kc from the chunk's first row (cmaps)
    const unsigned char* kmap;    // column classes (cmaps)
    unsigned width, col, row, dq, dr;  // the lane's column and row (from rmap); 32 = dq
                                       // rows + dr columns
    bool classed, has_rows, has_cols;
#endif
};

// A thread's place in the group that decodes its pair: g, its index there (it holds lanes
// g + GROUP j of both streams), gm the group's threads in the warp, glt those below it.
struct Me {
    int g;
    unsigned gm, glt;
};

// The owner threads copy window j (bytes 128 j .. + 127) into its ring slot, COPY bytes a
// thread, as one cp.async group per thread; bytes past the payload are zero-filled, not
// read (payloads start 16-byte aligned, so every copy's source is aligned to its size).
__device__ __forceinline__ void fetch(const Stream& s, int j, const Me& me) {
    if ((me.g & HALF) == s.owner) {
        const int at = 128 * j + COPY * (me.g & (HALF - 1));
        const int n = min(max(s.n_bytes - at, 0), COPY);
        const unsigned char* src = s.bytes + (n ? at : 0);
        const unsigned dst = s.ring_addr + (j & (RING / 64 - 1)) * 128 +
                             COPY * (me.g & (HALF - 1));
        asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;\n\t"
                     "cp.async.commit_group;" ::"r"(dst), "l"(src), "n"(COPY), "r"(n)
                     : "memory");
    }
}

// The group's threads meet (and see each other's shared-memory writes). U2: the whole
// warp, with a constant mask: a computed one makes the compiler assume divergence and wrap
// every later vote in its fallback for diverged warps.
__device__ __forceinline__ void group_sync(const Me& me) {
#if LANES == 1 || U2
    __syncwarp();
#else
    __syncwarp(me.gm);
#endif
}

// Windows up to (window of base) + 1 have landed in the ring, for every lane to read.
__device__ __forceinline__ void landed(const Stream& s, const Me& me) {
    if ((me.g & HALF) == s.owner) asm volatile("cp.async.wait_group %0;" ::"n"(AHEAD - 1)
                                               : "memory");
    group_sync(me);
}

__device__ __forceinline__ void load_stream(Stream& s, const long long* d,
        const unsigned char* buf, const unsigned char* symt, const unsigned* infot,
        const unsigned char* cmaps, unsigned short* ring, int owner, const Me& me,
        bool ringed = true) {
    long long off = d[D_OFF], len = d[D_LEN];
    s.n = (int)d[D_N];
    s.p = (unsigned)d[D_PREC];
    s.is_raw = d[D_MODE] == 1;
    s.coded = !s.is_raw && s.n > 0;
    // Payloads start 16-byte aligned (plan.py); coded: 32 u32 start states, then u16 words.
#pragma unroll
    for (int j = 0; j < LANES; ++j) {
        s.x0[j] = s.coded ? reinterpret_cast<const unsigned*>(buf + off)[me.g + GROUP * j] : LB;
        s.x[j] = s.x0[j];
    }
    s.bytes = buf + off + (s.is_raw ? 0 : 128);
    s.n_bytes = s.is_raw ? (int)len : s.n > 0 ? (int)(len - 128) : 0;
    s.n_words = (s.n_bytes + 1) / 2;
    s.wp = 0;
    s.base = 0;
    s.ring = ring;
    s.ring_addr = (unsigned)__cvta_generic_to_shared(ring);
    s.owner = owner;
    if (ringed)  // a staged raw stream is read straight from global memory, not its ring
        for (int j = 0; j <= AHEAD; ++j) fetch(s, j, me);
    s.sym = symt + max(d[D_SYM], 0LL);  // plain streams (-1) have no tables, read none
    s.info = infot + max(d[D_INFO], 0LL);
#if CLS
    // plan.py: 1 <= D_WIDTH < 2^31, D_COL < D_WIDTH, and the maps cover every row and
    // column the chunk's symbols touch, so a live symbol's reads stay in them.
    s.classed = d[D_GRID] >= 0;
    s.has_rows = d[D_RMAP] >= 0;
    s.has_cols = d[D_KMAP] >= 0;
    const long long w = max(d[D_WIDTH], 1LL), at = d[D_COL] + me.g;
    s.width = (unsigned)w;
    s.col = (unsigned)(at % w);
    s.row = (unsigned)(at / w);
    s.dq = (unsigned)(32 / w);
    s.dr = (unsigned)(32 % w);
    s.grid = cmaps + max(d[D_GRID], 0LL);
    s.rmap = cmaps + max(d[D_RMAP], 0LL);
    s.kmap = cmaps + max(d[D_KMAP], 0LL);
#endif
}

#if CLS
// A classed stream's tables for its current symbol (table 0 for a lane past the end; a
// stream not classed keeps sym / info), then the lane's place moves on 32 symbols
// (col < width < 2^31, so col + dr does not wrap).
__device__ __forceinline__ void grid_tables(Stream& s, bool live, const unsigned char*& sym,
                                            const unsigned*& info) {
    if (!s.classed) return;
    unsigned ctx = 0;
    if (live && s.has_rows) ctx = s.rmap[s.row];
    if (live && s.has_cols) ctx += s.kmap[s.col];
    const unsigned t = live ? (unsigned)s.grid[ctx] : 0u;
    sym = s.sym + (t << s.p);
    info = s.info + t * 256;
    s.col += s.dr;
    s.row += s.dq;
    if (s.col >= s.width) {
        s.col -= s.width;
        s.row += 1;
    }
}
#endif

// After a step: once wp leaves window base / 64, start copying the window AHEAD past the
// new one (over the slot read two windows ago) and wait until the new window and the next
// have landed. A step reads at most 32 words from wp, and wp - base < 64 at its start.
// Staged rounds check only after every second step: from wp - base < 64
// two steps read below base + 128 (windows base / 64 and the next, both landed) and leave
// wp - base < 128, which one slide brings back under 64.
// U2: the halves' wp differ, so the warp enters when either half moves on (a branch the
// compiler sees as uniform) and the other half only waits on copies it has (at most
// AHEAD - 1 in flight already: no wait).
__device__ __forceinline__ void slide(Stream& s, const Me& me) {
#if U2
    const bool move = s.wp - s.base >= 64 * WU;
    if (__any_sync(FULL_MASK, move)) {
        if (move) {
            s.base += 64 * WU;
            fetch(s, s.base / (64 * WU) + AHEAD, me);
        }
        landed(s, me);
    }
#else
    if (s.wp - s.base >= 64 * WU) {
        s.base += 64 * WU;
        fetch(s, s.base / (64 * WU) + AHEAD, me);
        landed(s, me);
    }
#endif
}

// The group's ballot: bit k of the warp's lane k (only the group's bits are meaningful).
__device__ __forceinline__ unsigned group_ballot(bool need, const Me& me) {
    unsigned b;
    // vote.sync itself: every thread of the group is here (the loops are group-uniform).
#if LANES == 1 || UNIFORM  // U2: the whole warp runs every step (both groups' bits)
    asm("{ .reg .pred q; setp.ne.u32 q, %1, 0; vote.sync.ballot.b32 %0, q, 0xffffffff; }"
        : "=r"(b) : "r"((unsigned)need));
#else
    asm("{ .reg .pred q; setp.ne.u32 q, %1, 0; vote.sync.ballot.b32 %0, q, %2; }"
        : "=r"(b) : "r"((unsigned)need), "r"(me.gm));
#endif
    return b;
}

// The ring's word at wp + k words. RENORM: the ring starts at a multiple of its size, so
// the address is (wp + 2 k) & (size - 2) | ring_addr: one LEA and one LOP3, where a word
// cursor takes an add, a shift, a mask and an add.
__device__ __forceinline__ unsigned ring_word(const Stream& s, unsigned k) {
#if RENORM
    unsigned short w;
    // volatile: the ring is written by cp.async, ordered by the wait and sync asm only
    asm volatile("ld.shared.u16 %0, [%1];" : "=h"(w)
                 : "r"(((s.wp + 2 * k) & (2 * RING - 2)) | s.ring_addr));
    return w;
#else
    return s.ring[(s.wp + k) & (RING - 1)];
#endif
}

// One step of a coded stream's lane i % 32 (the thread's state j) with its tables at
// sym/info (PK: sym is the packed table, info unused); returns the symbol of i (LOW: only
// its low byte is the symbol, for callers that keep only that byte: a packed step then
// skips the mask). At LANES 2 a step of the stream is two of these, j = 0 (lanes 0-15)
// then j = 1 (lanes 16-31): the group's ballot bits are those lanes in order, so the
// words go to the needy lanes in lane order as at LANES 1.
template <bool FULL, bool PK = false, bool LOW = false>
__device__ __forceinline__ unsigned rans_step(Stream& s, int j, int i, const Me& me,
        const unsigned char* sym, const unsigned* info, bool coded = true) {
    const bool live = (FULL || i < s.n) && coded;
    const unsigned x = s.x[j];
    const unsigned slot = x & ((1u << s.p) - 1u);
    unsigned c, y;
    if (PK) {  // f * q + slot - start = (f - 1) * q + q + (slot - start)
        const unsigned e = live ? reinterpret_cast<const unsigned*>(sym)[slot] : 0u;
        const unsigned q = x >> s.p;
        c = LOW ? e : e & 0xffu;
        y = ((e >> 8) & 0xfffu) * q + q + (e >> 20);
    } else {
        c = live ? (unsigned)sym[slot] : 0u;
        const unsigned inf = live ? info[c] : 0u;
        y = (inf & 0xffffu) * (x >> s.p) + slot - (inf >> 16);
    }
    const bool need = live && y < LB;
    const unsigned b = group_ballot(need, me);
    // Past the payload the windows hold 0; the final wp > n_words check reports it.
    const unsigned w = ring_word(s, __popc(b & me.glt));
    if (need) y = (y << 16) | w;
    if (live) s.x[j] = y;
    s.wp += WU * __popc(LANES == 1 ? b : b & me.gm);
    return c;
}

// A raw stream's byte of lane k (k < 32) of the step at wp: byte 32 s + k of the payload;
// after the step's lanes the caller moves wp on 16 words (raw_done).
__device__ __forceinline__ unsigned raw_byte(const Stream& s, int k) {
    return reinterpret_cast<const unsigned char*>(s.ring)[(2 / WU * s.wp + k) & (2 * RING - 1)];
}

// A stream's kind in the step loops' templates: coded, raw, or either (U2 only: the
// pairs of a warp's two halves differ, so each lane decides, and a raw lane's coded step
// is a step with no live symbol: no table read, no vote, wp unchanged).
#define KIND_CODED 0
#define KIND_RAW 1
#define KIND_EITHER 2

template <int KIND>
__device__ __forceinline__ void raw_done(Stream& s) {
    if (KIND == KIND_RAW || (KIND == KIND_EITHER && s.is_raw)) s.wp += 16 * WU;
}

template <bool FULL, int KIND, bool PK>
__device__ __forceinline__ unsigned stream_step(Stream& s, int j, int i, const Me& me,
        const unsigned char* sym, const unsigned* info) {
    if (KIND == KIND_RAW) return raw_byte(s, i & 31);
    if (KIND == KIND_EITHER) {
        const unsigned c = rans_step<FULL, PK>(s, j, i, me, sym, info, !s.is_raw);
        return s.is_raw ? raw_byte(s, i & 31) : c;
    }
    return rans_step<FULL, PK>(s, j, i, me, sym, info);
}

struct Pair {
    const unsigned char *sa, *sb;   // slot -> symbol tables of a and b (shared or global)
    const unsigned *ia, *ib;        // their symbol infos
    const unsigned char* cmaps;
    long long cmap_b, out_a, out_b, step_a, step_b;
    void* out;
};

// Lane i % 32 of both streams (the thread's state j of each), its output written.
template <bool FULL, int RAW_A, int RAW_B>
__device__ __forceinline__ void lane_step(Stream& a, Stream& b, Pair& q, int j, int i,
                                          const Me& me) {
    const unsigned char* sa = q.sa;
    const unsigned* ia = q.ia;
#if CLS
    if (RAW_A == KIND_CODED) grid_tables(a, FULL || i < a.n, sa, ia);
#endif
    const unsigned ea = stream_step<FULL, RAW_A, PACKED>(a, j, i, me, sa, ia);
    const unsigned char* sb = q.sb;
    const unsigned* ib = q.ib;
#if CTX
    // Class of a's symbol picks b's tables (cmap_b < 0: a one-table frame in this batch).
    const unsigned cls = (q.cmap_b >= 0 && (FULL || i < b.n)) ? q.cmaps[q.cmap_b + ea] : 0u;
    sb = b.sym + (cls << b.p);
    ib = b.info + cls * 256;
#endif
#if CLS && !BF16  // bf16 mode: b (sign_mantissa) is never classed (plan.py), no registers
    if (RAW_B == KIND_CODED) grid_tables(b, FULL || i < b.n, sb, ib);
#endif
    const unsigned eb = stream_step<FULL, RAW_B, PACKED_B>(b, j, i, me, sb, ib);
#if BF16
    if (FULL || i < a.n)
        reinterpret_cast<unsigned short*>(q.out)[q.out_a + i * q.step_a] =
            (unsigned short)(((eb >> 7) << 15) | (ea << 7) | (eb & 0x7fu));
#else
    unsigned char* o = reinterpret_cast<unsigned char*>(q.out);
    if (FULL || i < a.n) o[q.out_a + i * q.step_a] = (unsigned char)ea;
    if (FULL || i < b.n) o[q.out_b + i * q.step_b] = (unsigned char)eb;
#endif
}

// One step of both streams: symbols i0 + GROUP j of each (i0 = 32 s + g).
template <bool FULL, int RAW_A, int RAW_B>
__device__ __forceinline__ void pair_step(Stream& a, Stream& b, Pair& q, int i0,
                                          const Me& me) {
#pragma unroll
    for (int j = 0; j < LANES; ++j)
        lane_step<FULL, RAW_A, RAW_B>(a, b, q, j, i0 + GROUP * j, me);
    raw_done<RAW_A>(a);
    raw_done<RAW_B>(b);
    // Both streams' steps are branch-free up to here, so their chains can interleave.
    slide(a, me);
    slide(b, me);
}

// U2: a bound both halves of a warp share (the least or the greatest of their pairs'), so
// they loop in step; a half past its own end steps with no live symbol.
__device__ __forceinline__ int warp_min(int v) {
#if U2
    return __reduce_min_sync(FULL_MASK, v);
#else
    return v;
#endif
}

__device__ __forceinline__ int warp_max(int v) {
#if U2
    return __reduce_max_sync(FULL_MASK, v);
#else
    return v;
#endif
}

template <int RAW_A, int RAW_B>
__device__ __forceinline__ void run_pair(Stream& a, Stream& b, Pair& q, const Me& me) {
    const int full = warp_min(min(a.n, b.n) / 32), steps = warp_max((max(a.n, b.n) + 31) / 32);
    int s = 0, i = me.g;
    for (; s + 4 <= full; s += 4, i += 128) {  // whole steps, 4 at a time
        pair_step<true, RAW_A, RAW_B>(a, b, q, i, me);
        pair_step<true, RAW_A, RAW_B>(a, b, q, i + 32, me);
        pair_step<true, RAW_A, RAW_B>(a, b, q, i + 64, me);
        pair_step<true, RAW_A, RAW_B>(a, b, q, i + 96, me);
    }
    for (; s < steps; ++s, i += 32) pair_step<false, RAW_A, RAW_B>(a, b, q, i, me);
}

#if VEC
// A stream's symbol i outside the rounds: a raw stream's byte from global memory (its ring
// is unused in VEC mode), a coded stream's next step.
template <bool RAW, bool PK>
__device__ __forceinline__ unsigned tail_step(Stream& s, int j, int i, const Me& me,
                                              const unsigned char* sym, const unsigned* info) {
    if (RAW) return i < s.n ? (unsigned)__ldg(s.bytes + i) : 0u;
    return rans_step<false, PK>(s, j, i, me, sym, info);
}
#endif

#if VEC && BF16
// Two bf16 values (low half: symbol j, high half: symbol j + 1) from two exponent bytes and
// two sign_mantissa bytes, which sit at byte h and h + 1 of e and m (h = 0 or 2):
// (m >> 7) << 15 | e << 7 | (m & 0x7f) in each 16-bit half (no half spills into the other).
__device__ __forceinline__ unsigned bf16x2(unsigned e, unsigned m, unsigned sel) {
    const unsigned e2 = __byte_perm(e, 0u, sel), m2 = __byte_perm(m, 0u, sel);
    return (e2 << 7) | ((m2 << 8) & 0x80008000u) | (m2 & 0x007f007fu);
}

// Eight bf16 values (16 bytes) from 8 exponent and 8 sign_mantissa bytes.
__device__ __forceinline__ uint4 bf16x8(unsigned e0, unsigned e1, unsigned m0, unsigned m1) {
    return make_uint4(bf16x2(e0, m0, 0x4140u), bf16x2(e0, m0, 0x4342u),
                      bf16x2(e1, m1, 0x4140u), bf16x2(e1, m1, 0x4342u));
}

// The staged pair loop (see the header): a coded exponent stream a, b coded or raw (RAW_B),
// out = this pair's first output element, 16-byte aligned; stage = the pair's 1 KiB.
// Lane k of a round (k = g + GROUP j: the thread's state j) stages symbols 32 s + k and
// writes symbols 16 k .. 16 k + 15.
template <bool RAW_B>
__device__ __forceinline__ void run_vec(Stream& a, Stream& b, Pair& q, const Me& me,
                                        unsigned char* stage) {
    unsigned short* out = reinterpret_cast<unsigned short*>(q.out) + q.out_a;
    const int rounds = warp_min(a.n >> 9);  // a.n == b.n (plan.py pairs equal lengths)
    int i = me.g;
    const uint4* smv = reinterpret_cast<const uint4*>(b.bytes);  // raw: 16-byte aligned
    uint4 m[LANES];
#pragma unroll
    for (int j = 0; j < LANES; ++j)  // round 0's sm bytes (rounds >= 1 here)
        m[j] = RAW_B ? __ldg(smv + me.g + GROUP * j) : make_uint4(0u, 0u, 0u, 0u);
    for (int r = 0; r < rounds; ++r) {
        uint4 next[LANES];
#pragma unroll
        for (int j = 0; j < LANES; ++j)
            next[j] = RAW_B && r + 1 < rounds ? __ldg(smv + 32 * (r + 1) + me.g + GROUP * j)
                                              : m[j];
#pragma unroll
        for (int k = 0; k < 16; ++k, i += 32) {
#pragma unroll
            for (int j = 0; j < LANES; ++j) {
                const int at = 32 * k + me.g + GROUP * j;
                stage[at] = (unsigned char)rans_step<true, PACKED, true>(
                    a, j, i + GROUP * j, me, q.sa, q.ia);
                if (!RAW_B)
                    stage[512 + at] = (unsigned char)rans_step<true, PACKED_B, true>(
                        b, j, i + GROUP * j, me, q.sb, q.ib);
            }
            if (k & 1) {
                slide(a, me);
                if (!RAW_B) slide(b, me);
            }
        }
        group_sync(me);
        uint4 e[LANES];
#pragma unroll
        for (int j = 0; j < LANES; ++j) {
            e[j] = reinterpret_cast<const uint4*>(stage)[me.g + GROUP * j];
            if (!RAW_B) m[j] = reinterpret_cast<const uint4*>(stage + 512)[me.g + GROUP * j];
        }
        group_sync(me);  // every lane has its bytes before the next round overwrites them
#pragma unroll
        for (int j = 0; j < LANES; ++j) {
            uint4* dst = reinterpret_cast<uint4*>(out + 512 * r + 16 * (me.g + GROUP * j));
            dst[0] = bf16x8(e[j].x, e[j].y, m[j].x, m[j].y);
            dst[1] = bf16x8(e[j].z, e[j].w, m[j].z, m[j].w);
            m[j] = next[j];
        }
    }
    // The last < 512 symbols one step at a time (b raw: its bytes straight from global).
    const int steps = warp_max((a.n + 31) >> 5);
    for (int s = rounds << 4; s < steps; ++s, i += 32) {
#pragma unroll
        for (int j = 0; j < LANES; ++j) {
            const int ij = i + GROUP * j;
            const unsigned ea = tail_step<false, PACKED>(a, j, ij, me, q.sa, q.ia);
            const unsigned eb = tail_step<RAW_B, PACKED_B>(b, j, ij, me, q.sb, q.ib);
            if (ij < a.n)
                out[ij] = (unsigned short)(((eb >> 7) << 15) | (ea << 7) | (eb & 0x7fu));
        }
        slide(a, me);
        if (!RAW_B) slide(b, me);
    }
}
#endif

#if VEC && !BF16
// The staged pair loop of u8 mode (see the header): two chunks with their own outputs,
// each coded (staged) or raw (copied 16 bytes a lane); stage = the pair's 1 KiB.
template <bool RAW_A, bool RAW_B>
__device__ __forceinline__ void run_vec(Stream& a, Stream& b, Pair& q, const Me& me,
                                        unsigned char* stage) {
    unsigned char* oa = reinterpret_cast<unsigned char*>(q.out) + q.out_a;
    unsigned char* ob = reinterpret_cast<unsigned char*>(q.out) + q.out_b;
    const uint4* rawa = reinterpret_cast<const uint4*>(a.bytes);  // raw: 16-byte aligned
    const uint4* rawb = reinterpret_cast<const uint4*>(b.bytes);
    const int rounds = warp_min(min(a.n, b.n) >> 9);
    int i = me.g;
    for (int r = 0; r < rounds; ++r) {
        uint4 va[LANES], vb[LANES];
#pragma unroll
        for (int j = 0; j < LANES; ++j) {
            const int k = 32 * r + me.g + GROUP * j;
            va[j] = RAW_A ? __ldg(rawa + k) : make_uint4(0u, 0u, 0u, 0u);
            vb[j] = RAW_B ? __ldg(rawb + k) : make_uint4(0u, 0u, 0u, 0u);
        }
        if (!RAW_A || !RAW_B) {
#pragma unroll
            for (int k = 0; k < 16; ++k, i += 32) {
#pragma unroll
                for (int j = 0; j < LANES; ++j) {
                    const int at = 32 * k + me.g + GROUP * j;
                    if (!RAW_A)
                        stage[at] = (unsigned char)rans_step<true, PACKED, true>(
                            a, j, i + GROUP * j, me, q.sa, q.ia);
                    if (!RAW_B)
                        stage[512 + at] = (unsigned char)rans_step<true, PACKED_B, true>(
                            b, j, i + GROUP * j, me, q.sb, q.ib);
                }
                if (k & 1) {
                    if (!RAW_A) slide(a, me);
                    if (!RAW_B) slide(b, me);
                }
            }
            group_sync(me);
#pragma unroll
            for (int j = 0; j < LANES; ++j) {
                const int k = me.g + GROUP * j;
                if (!RAW_A) va[j] = reinterpret_cast<const uint4*>(stage)[k];
                if (!RAW_B) vb[j] = reinterpret_cast<const uint4*>(stage + 512)[k];
            }
            group_sync(me);  // every lane has its bytes before the next round overwrites
        } else {
            i += 512;
        }
#pragma unroll
        for (int j = 0; j < LANES; ++j) {
            reinterpret_cast<uint4*>(oa + 512 * r)[me.g + GROUP * j] = va[j];
            reinterpret_cast<uint4*>(ob + 512 * r)[me.g + GROUP * j] = vb[j];
        }
    }
    const int steps = warp_max((max(a.n, b.n) + 31) >> 5);
    for (int s = rounds << 4; s < steps; ++s, i += 32) {
#pragma unroll
        for (int j = 0; j < LANES; ++j) {
            const int ij = i + GROUP * j;
            const unsigned ea = tail_step<RAW_A, PACKED>(a, j, ij, me, q.sa, q.ia);
            const unsigned eb = tail_step<RAW_B, PACKED_B>(b, j, ij, me, q.sb, q.ib);
            if (ij < a.n) oa[ij] = (unsigned char)ea;
            if (ij < b.n) ob[ij] = (unsigned char)eb;
        }
        if (!RAW_A) slide(a, me);
        if (!RAW_B) slide(b, me);
    }
}
#endif

__device__ __forceinline__ int status_of(const Stream& s, const Me& me) {
    unsigned x0 = s.x0[0];
    bool off = s.x[0] != LB;
#pragma unroll
    for (int j = 1; j < LANES; ++j) {
        x0 = min(x0, s.x0[j]);
        off = off || s.x[j] != LB;
    }
    const unsigned x0min = __reduce_min_sync(me.gm, x0);
    const bool final_bad = __any_sync(me.gm, off);
    if (!s.coded) return 0;
    if (x0min < LB) return ERR_STATE;
    if (s.wp / WU > s.n_words) return ERR_TRUNCATED;
    if (s.wp / WU < s.n_words) return ERR_TRAILING;
    return final_bad ? ERR_FINAL : 0;
}

#if SMEM
// The whole block copies one table set (2^p <= 4096 symbol bytes, 256 infos) to dst, or
// (PACKED) writes its 2^p packed slot words. plan.py builds the tables from a validated
// frequency table, so slot j's symbol c has f >= 1 and start <= j < start + f <= 2^p.
__device__ __forceinline__ void stage(unsigned char* dst, const unsigned char* sym,
                                      const unsigned* info, int p) {
    unsigned* d32 = reinterpret_cast<unsigned*>(dst);
#if PACKED
    for (int j = threadIdx.x; j < (1 << p); j += blockDim.x) {
        const unsigned c = __ldg(sym + j), inf = __ldg(info + c);
        d32[j] = c | ((inf & 0xffffu) - 1u) << 8 | (j - (inf >> 16)) << 20;
    }
#else
    const unsigned* src = reinterpret_cast<const unsigned*>(sym);  // 256-byte aligned
    for (int j = threadIdx.x; j < (1 << p) / 4; j += blockDim.x) d32[j] = src[j];
    for (int j = threadIdx.x; j < 256; j += blockDim.x) d32[1024 + j] = info[j];
#endif
}
#endif

extern "C" __global__ void __launch_bounds__(WARPS * GROUP, MIN_BLOCKS)
rans_decode(const long long* __restrict__ desc, int* __restrict__ status,
            const unsigned char* __restrict__ buf, const unsigned char* __restrict__ symt,
            const unsigned* __restrict__ infot, const unsigned char* __restrict__ cmaps,
            void* __restrict__ out, int n_pairs, int n_slots) {
    const int lane = threadIdx.x & 31;
    // a block: WARPS pairs; UNIFORM at LANES 1: the warp's index taken from its lane 0 (a
    // shuffle), which the compiler then knows to be warp-uniform (header)
    const int pair = blockIdx.x * WARPS + (UNIFORM && LANES == 1
        ? __shfl_sync(FULL_MASK, (int)(threadIdx.x >> 5), 0) : (int)(threadIdx.x / GROUP));
    extern __shared__ __align__(16) unsigned char smem[];
#if SMEM
    // The block's table sets, from its first pair (plan.py: all its pairs share them).
    const long long* d0 = desc + (long long)blockIdx.x * WARPS * 2 * N_COLS;
    const long long sym_a = d0[D_SYM], sym_b = d0[N_COLS + D_SYM];
    const bool own_b = !CTX && sym_b >= 0 && sym_b != sym_a;
    unsigned char* ta = smem;
    unsigned char* tb = own_b && sym_a >= 0 ? smem + SMEM_STREAM : smem;
    if (sym_a >= 0) stage(ta, symt + sym_a, infot + d0[D_INFO], (int)d0[D_PREC]);
    if (own_b) stage(tb, symt + sym_b, infot + d0[N_COLS + D_INFO], (int)d0[N_COLS + D_PREC]);
    __syncthreads();  // the only block-wide barrier: warps may leave after it
#endif
    if (pair >= n_pairs) return;
    unsigned lt;
    asm("mov.u32 %0, %%lanemask_lt;" : "=r"(lt));
    Me me;
    me.g = lane & (GROUP - 1);
    me.gm = LANES == 1 ? FULL_MASK : 0xffffu << (lane & 16);
    me.glt = lt & me.gm;
    const long long* d = desc + (long long)pair * 2 * N_COLS;
    unsigned char* pairs = smem + (SMEM ? n_slots * SMEM_STREAM : 0);
#if RENORM  // the pairs' area from a multiple of a ring's size (the runtime leaves room)
    pairs += (0u - (unsigned)__cvta_generic_to_shared(pairs)) & (2 * RING - 1);
#endif
    unsigned char* mine = pairs + (threadIdx.x / GROUP) * WARP_SMEM;
    // Staged output (header): warp-uniform, from the rows and the outputs' addresses.
    const unsigned long long at = reinterpret_cast<unsigned long long>(out);
#if VEC && BF16
    bool vec = d[D_MODE] == 0 && d[D_N] >= 512 && d[D_STEP] == 1 &&
        ((at + 2ull * d[D_OUT]) & 15) == 0;
#elif VEC
    bool vec = min(d[D_N], d[N_COLS + D_N]) >= 512 && d[D_STEP] == 1 &&
        d[N_COLS + D_STEP] == 1 && ((at + d[D_OUT]) & 15) == 0 &&
        ((at + d[N_COLS + D_OUT]) & 15) == 0;
#else
    bool vec = at != at;  // false (at is used)
#endif
    bool raw_a = d[D_MODE] == 1, raw_b = d[N_COLS + D_MODE] == 1, either = false;
#if U2
    {  // one path for the warp: its two pairs' common one, else the per-step loop for either
        const int kind = (int)vec | (int)raw_a << 1 | (int)raw_b << 2;
        const int lo = __reduce_min_sync(FULL_MASK, kind);
        either = lo != __reduce_max_sync(FULL_MASK, kind);
        vec = !either && (lo & 1);
        raw_a = lo & 2;
        raw_b = lo & 4;
    }
#endif
    Stream a, b;
    load_stream(a, d, buf, symt, infot, cmaps, reinterpret_cast<unsigned short*>(mine), 0,
                me, !(vec && d[D_MODE] == 1));
    load_stream(b, d + N_COLS, buf, symt, infot, cmaps,
                reinterpret_cast<unsigned short*>(mine + 2 * RING), HALF, me,
                !(vec && d[N_COLS + D_MODE] == 1));
    Pair q;
    q.cmaps = cmaps;
    q.cmap_b = d[N_COLS + D_CMAP];
    q.out_a = d[D_OUT];
    q.out_b = d[N_COLS + D_OUT];
    q.step_a = d[D_STEP];
    q.step_b = d[N_COLS + D_STEP];
    q.out = out;
#if SMEM
    q.sa = ta;
    q.ia = reinterpret_cast<const unsigned*>(ta + 4096);  // unused when PACKED
    q.sb = CTX ? b.sym : tb;
    q.ib = CTX ? b.info : reinterpret_cast<const unsigned*>(tb + 4096);
#else
    q.sa = a.sym;
    q.sb = b.sym;
    q.ia = a.info;
    q.ib = b.info;
#endif
    // Windows 0 and 1 of both rings in place before any lane reads them.
    // (Each thread waits on its own stream's copies: the first HALF issued only a's.)
    asm volatile("cp.async.wait_group %0;" ::"n"(AHEAD - 1) : "memory");
    group_sync(me);
#if VEC && BF16
    if (vec) {
        if (raw_b) run_vec<true>(a, b, q, me, mine + 4 * RING);
        else run_vec<false>(a, b, q, me, mine + 4 * RING);
    } else
#elif VEC
    if (vec) {
        unsigned char* stage = mine + 4 * RING;
        if (raw_a) {
            if (raw_b) run_vec<true, true>(a, b, q, me, stage);
            else run_vec<true, false>(a, b, q, me, stage);
        } else {
            if (raw_b) run_vec<false, true>(a, b, q, me, stage);
            else run_vec<false, false>(a, b, q, me, stage);
        }
    } else
#endif
#if U2
    if (either) run_pair<KIND_EITHER, KIND_EITHER>(a, b, q, me); else
#endif
    if (raw_a) {
        if (raw_b) run_pair<KIND_RAW, KIND_RAW>(a, b, q, me);
        else run_pair<KIND_RAW, KIND_CODED>(a, b, q, me);
    } else {
        if (raw_b) run_pair<KIND_CODED, KIND_RAW>(a, b, q, me);
        else run_pair<KIND_CODED, KIND_CODED>(a, b, q, me);
    }
    const int code_a = status_of(a, me), code_b = status_of(b, me);
    if (me.g == 0) {
        status[2 * pair] = code_a;
        status[2 * pair + 1] = code_b;
    }
}
