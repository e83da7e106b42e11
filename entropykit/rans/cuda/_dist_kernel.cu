// CUDA kernels of per-symbol-distribution rANS (entropykit/rans/dist_kernels.py on a GPU),
// compiled at first use by NVRTC, one build per value format (NKEYS, MANT, BIAS, NONFINITE,
// ES come in as -D macros from rans.distribution.FORMATS) and table placement (SMEM); WARPS
// and the TAIL_* constants come from dist.py too (dist._build_options).
//
// What it is: dist_encode and dist_decode, one warp per chunk of the frame and one lane per
// interleaved rANS lane (value i of a chunk is on lane i % 32), many chunks a launch (the
// decoder's warps, with DYN_CHUNKS, take chunks from a counter until none is left); the
// integer CDF of dist_kernels.py ported line for line (every probability is integer
// arithmetic; floats only pick where the decoder's exact search starts); the chunk's CRC-32
// (zlib's) computed by the warp; dist_gather, which packs the encoder's per-chunk payloads
// and directory into the frame. What it is not: the frame parser or the frame header
// (dist.py, on the host: it has validated every offset and length the decoder gets).
//
// Word order (the CPU kernels'): a group of 32 values is one step of top bytes, then (16-bit
// formats) one step of low bytes; the decoder reads words forwards, lanes 0..31 in a step,
// each lane that needs a word taking the next one: lane q reads word
// wp + popc(ballot & lanes below q). The encoder runs the same order backwards, writing
// downwards: lane q's word lands at pos - 2 (1 + popc(ballot & lanes above q)).
//
// Untrusted frames: every payload read is checked against the chunk's payload (a lane that
// needs a word past the end is ERR_TRUNCATED), and each chunk reports the CPU kernel's error
// code, or ERR_CRC / ERR_RAW, or ERR_PARAM with the index of an invalid (mu, sigma) (which
// takes precedence, as on the CPU, which checks every (mu, sigma) before decoding).

#define LANES 32
#define LB 65536u
#define FULL 0xffffffffu
#define ONE (1LL << 31)
#define ONE_BITS 31
#define Z_GRID_BITS 6
#define Z_MAX 32
#define Z_FRAC 16
#define MU_BITS 16
#define R_SHIFT 32
#define D_BIG (1LL << 40)
#define MU32 (1 << 29)  // offset32's range of mu_u
#define SAT32 (1 << 30)  // offset32's saturated |floor(B / u)|
#define WEIGHT_ONE 65536
#define INV_POINTS 4096
#define ZTAIL (INV_POINTS + 1)                // a zinv row: the uniform points, then tails
#define ZROW (ZTAIL + 2 * (TAIL_POINTS + 1))  // (dist.model_arrays)
#define SHAPE_W ((2 * Z_MAX << Z_GRID_BITS) + 2)  // 4097 entries + one padding entry
#define EMP_W 257
// A shape row's last word (padding: smooth_with reads it only at z = +Z_MAX, with weight 0,
// and fwd_steps never) holds, in shared memory, the model's weight w (block_model, params):
// a shared read in place of a global one whose latency the guess would wait for
#define W_AT (SHAPE_W - 1)
#define SMEM_PARAMS (SMEM && ES)  // w and the reciprocals from shared memory (16-bit formats)
#define HALF (NKEYS / 2)
#define BYTES (NKEYS > 256 ? 2 : 1)
#define CRC_POLY 0xedb88320u
#define DEFAULT_P 16  // distribution.DEFAULT_PRECISION: decode_chunk's build for it (P)

// What differs between 16-bit formats (ES > 0: a top and a low stage) and 8-bit ones (one
// stage); docs/gpu.md says why each is chosen so.
#define DYN_CHUNKS (ES == 0)  // the decoder's warps take chunks from a counter (next_chunk)
// the top stage's guess rounds for values with an empirical term (w > 0), and without
constexpr int GUESS_ROUNDS = ES ? 0 : 1;
constexpr int PURE_ROUNDS = 1;
// a 16-bit format's low stage: its guess rounds, and its first guess takes E at the slot's
// linear place (fast_guess), then FWD_STEPS forward Newton steps (fwd_steps)
constexpr int LOW_ROUNDS = ES ? 0 : 1;
constexpr bool LOW_E_START = ES != 0;
constexpr int FWD_STEPS = ES ? 2 : 0;
// a missed guess is searched by the whole warp (warp_search), else by its lane alone: the
// top stage always, a 16-bit format's low stage by its lane
constexpr bool WARP_SEARCH = ES == 0;
constexpr bool WARP_SEARCH_TOP = true;

// Status codes (ERR_*) come from the build's prologue (entropykit._status.cuda_prologue).
#define MODE_CODED 0
#define MODE_RAW 1

typedef long long i64;
typedef unsigned long long u64;

#define KEY_TABLE (ES == 0 && SMEM)  // clamped_offset's key table (8-bit formats)

// A 16-bit format's decoder reads its inverse shapes (zinv, guesses only) from shared memory
// after the model blocks where the launch's dynamic shared memory holds them (dist.smem_bytes
// gives them room in one-shape launches: two shapes' rows would leave too few blocks an
// SM). block_model sees the room from the size; guess_key reads them through a generic
// pointer, shared or global, so that one build serves both.
#define ZINV_SMEM (ES > 0 && SMEM)

// One value's quantized parameters (dist_kernels.Val, without ue which only feeds cb), and
// mu_u as clamped_offset() takes it: mu32 = mu_u where |mu_u| < MU32 (big = false, every
// value of realistic data: |mu| < 2^13 sigma), else offset() in 64 bits (big = true), from
// mu_u that big_offset() rebuilds from mu's bits (mub) and cb.
struct Val {
    i64 rr;
    unsigned mub;
    int dl, cb, m, w, mu32;
    bool big;
#if KEY_TABLE
    float ksc;  // clamped_offset's scale: 2^(1 - cb), the exponent clamped to [-126, 64]
#endif
};

// The sigma reciprocals (dist_kernels.reciprocals: R, then dl) in shared memory for 16-bit
// formats (SMEM_PARAMS, block_model), as w in W_AT: params reads them at the start of a
// value's dependency chain. 8-bit formats use them later in the chain, where the global
// reads' latency is hidden, and keep those.
#if SMEM_PARAMS
__shared__ i64 rtab_s[512];
#endif

// The slots a top-stage symbol of the flat ends holds, as reciprocals 1 / r0 and 1 / r1
// (top_bounds), of a model with weight w, E(1) = e1 and E(255) = e255.
__device__ __forceinline__ float2 top_ends(int w, unsigned e1, unsigned e255, int p) {
    const float rate = (float)w * ((float)((1 << p) - 256) * (1.0f / ONE / WEIGHT_ONE));
    return make_float2(__fdividef(1.0f, 1.0f + rate * (float)e1),
                       __fdividef(1.0f, 1.0f + rate * (float)(0x80000000u - e255)));  // 1 - E
}

#if SMEM_PARAMS
#define TOP_END_MODELS 8  // (shared-memory tables hold 5 models at most: dist._SMEM_LIMIT)
__shared__ float2 top_end_s[TOP_END_MODELS];  // block_model's top_ends of each model
#endif

// Model tables: shapes (M x SHAPE_W) and emps (M x 257) in shared memory with SMEM (one
// block a model: shape_row, emp_row), else read through L1; inverse-shape floats (guesses
// only) through L1, or from shared memory (ZINV_SMEM).
struct Model {
    const unsigned* shapes;
    const unsigned* emps;
    unsigned sh_s, em_s;  // SMEM: their shared-window addresses (shape_w / emp_w)
    unsigned kb_s;        // KEY_TABLE: key_bound's
    const int* weights;
    const float* zinv;
    const i64* rtab;
};

// Word i of the shapes / emps tables. With SMEM, an ld.shared from a 32-bit address
// held in a register: through the C++ pointer, Hopper rebuilds the shared window's base (S2UR
// of the CTA's id in its cluster, then 3 uniform instructions) before most table reads. Not
// volatile (the compiler may merge or speculate reads: the tables are constant once filled).
__device__ __forceinline__ unsigned smem_word(unsigned addr) {
    unsigned r;
    asm("ld.shared.u32 %0, [%1];" : "=r"(r) : "r"(addr));
    return r;
}

// Word i of a model table: its shared-window address s with SMEM, else its pointer t.
__device__ __forceinline__ unsigned table_w(const unsigned* t, unsigned s, int i) {
#if SMEM
    return smem_word(s + 4 * (unsigned)i);
#else
    return t[i];
#endif
}

__device__ __forceinline__ unsigned shape_w(const Model& md, int i) {
    return table_w(md.shapes, md.sh_s, i);
}

__device__ __forceinline__ unsigned emp_w(const Model& md, int i) {
#if SMEM
    return table_w(md.shapes, md.sh_s, i);  // one block a model (shape_row)
#else
    return table_w(md.emps, md.em_s, i);
#endif
}

// Where model m's rows start in shape_w's and emp_w's index. With SMEM, one block of shared
// memory a model, its shape row and then its empirical row, both read from one base
// address: the empirical rows' own base (models x SHAPE_W words in) was rebuilt from the
// kernel parameter before most of their reads (LDC + IMAD).
#if SMEM
#define MODEL_W (SHAPE_W + EMP_W)
__device__ __forceinline__ int shape_row(int m) { return m * MODEL_W; }
__device__ __forceinline__ int emp_row(int m) { return m * MODEL_W + SHAPE_W; }
#else
__device__ __forceinline__ int shape_row(int m) { return m * SHAPE_W; }
__device__ __forceinline__ int emp_row(int m) { return m * EMP_W; }
#endif

__device__ __forceinline__ bool param_ok(unsigned mub, unsigned sgb) {
    // finite mu, finite sigma > 0, mu's exponent field < sigma's + 34: dist_kernels._invalid.
    const int em = (mub >> 23) & 0xFF, es = (sgb >> 23) & 0xFF;
    return !((sgb >> 31) || es == 0xFF || sgb == 0 || em == 0xFF || em - max(es, 1) >= 34);
}

// mu_u = round(mu / 2^ue) in 64 bits (dist_kernels._params): mu's significand mm shifted
// by sh = max(em, 1) - 150 - ue, right shifts rounding half up in magnitude.
__device__ __forceinline__ i64 mu_units(unsigned mub, int ue) {
    const int em = (mub >> 23) & 0xFF;
    i64 mm = mub & 0x7FFFFF;
    if (em > 0) mm |= 1 << 23;
    const int sh = max(em, 1) - 150 - ue;
    i64 mu_u;
    if (sh >= 0) mu_u = mm << min(sh, 36);
    else if (sh < -40) mu_u = 0;
    else mu_u = (mm + (1LL << (-sh - 1))) >> -sh;
    return (mub >> 31) ? -mu_u : mu_u;
}

__device__ __forceinline__ Val params(unsigned mub, unsigned sgb, int m, const Model& md) {
    int e = (sgb >> 23) & 0xFF;
    const int em = (mub >> 23) & 0xFF;
    int r;
    if (e == 0) {  // subnormal sigma: the smallest normal one
        e = 1;
        r = 0;
    } else {
        r = ((sgb & 0x7FFFFF) + (1 << 14)) >> 15;
        if (r == 256) {
            r = 0;
            e += 1;
            if (e == 0xFF) { e = 0xFE; r = 255; }
        }
    }
    const int ue = e - 127 - MU_BITS;
    // mu_units() in 32 bits where it is below MU32: mm < 2^24, so 0 <= sh <= 5 leaves
    // mm 2^sh < 2^29 = MU32, and sh >= 6 (big) gives >= 2^29 (mm >= 2^23: a subnormal mu
    // has sh = -149 - ue <= -7, as ue >= -142); for sh < 0 the sum is < 2^25, and -sh >= 25
    // rounds to 0 (mm + 2^(-sh - 1) < 2^-sh), as it does clamped to 25 (test_gpu_dist_logic).
    const unsigned mm = (mub & 0x7FFFFF) | (em ? 1u << 23 : 0u);
    const int sh = max(em, 1) - 150 - ue, rs = min(-sh, 25);
    const unsigned mag = sh >= 0 ? mm << min(sh, 5) : (mm + (1u << (rs - 1))) >> rs;
    Val v;
    v.mub = mub;
    v.big = sh >= 6;
    v.mu32 = (mub >> 31) ? -(int)mag : (int)mag;  // read only when !big
#if SMEM_PARAMS
    v.rr = rtab_s[r];
    v.dl = (int)rtab_s[256 + r];  // < 2^22 (dist_kernels.reciprocals)
#else
    v.rr = __ldg(md.rtab + r);
    v.dl = (int)__ldg(md.rtab + 256 + r);
#endif
    v.cb = BIAS + MANT + 1 + ue;
#if KEY_TABLE
    v.ksc = __int_as_float((min(max(1 - v.cb, -126), 64) + 127) << 23);
#endif
    v.m = m;
#if SMEM_PARAMS
    v.w = (int)shape_w(md, shape_row(m) + W_AT);  // (block_model put it there)
#else
    v.w = md.weights[m];
#endif
    return v;
}

// D(k) = floor(B(k) / u) - mu_u for 0 < k < NKEYS (dist_kernels._offset): B = +-mid 2^sh
// with mid = 2 (implicit bit | mantissa) + 1 odd and < 2^(MANT + 2); left shifts of mid
// stop at 50 and right ones leave 0 from 31 on, as the CPU's clamped shifts do.
__device__ __forceinline__ i64 offset(int k, i64 mu_u, int cb) {
    const int y = k - HALF;
    if (y == 0) return -mu_u;
    const int a = abs(y) - 1;
    if (a + 1 >= NONFINITE) return y > 0 ? D_BIG : -D_BIG;
    const int neg = y < 0;
    const int e1 = max(a >> MANT, 1);
    const int mid = 2 * a + 1 - ((e1 - 1) << (MANT + 1));
    const int sh = e1 - cb;
    const i64 t = sh >= 0 ? ((i64)mid << min(sh, 50)) - neg
                          : (i64)((mid - neg) >> min(-sh, 31));
    return (t ^ -(i64)neg) - mu_u;
}

// offset() clamped to +-dl, out of line: only big mu (|mu| >~ 2^13 sigma) takes it, and
// inlined copies of its 64-bit shifts would lengthen the hot code (instruction fetch stalls).
__device__ __noinline__ int big_offset(int k, unsigned mub, int cb, int dl) {
    const i64 mu_u = mu_units(mub, cb - (BIAS + MANT + 1));  // cb = BIAS + MANT + 1 + ue
    return (int)min(max(offset(k, mu_u, cb), (i64)-dl), (i64)dl);
}

// offset(k, v) clamped to +-dl, in 32-bit words where |mu_u| < MU32 (!v.big). floor(B / u)
// = floor(+-mid 2^sh) is one float product, exact (mid < 2^(MANT + 2) < 2^24; sh clamped to
// [-126, 64]: below, +-mid 2^sh lies strictly between -1 and 1 either way, above, it is
// >= 2^64 either way), floored and saturated by the conversion, then clamped to +-SAT32.
// Where |floor(B / u)| >= SAT32 the true D and this one both exceed dl in magnitude
// (>= 2^30 - 2^29 > 2^22 > dl) with B's sign, so both clamp to the same end; a non-finite
// neighbour (D_BIG) is +-SAT32 here, clamped alike; no sum leaves int32 (|d| < 2^30 +
// 2^29). The 64-bit offset() runs only for big mu (|mu| >~ 2^13 sigma), which realistic
// data never has (tests/test_gpu_dist_logic.py checks this port on every key of many
// values, big and not).
// Branch-free: key HALF (+0, B = 0) multiplies 0, and a non-finite key (D_BIG) is the clamp's
// end on its side.
// KEY_TABLE (8-bit formats with their tables in shared memory): +-mid 2^(e1 - 1) of every key
// k = 0..NKEYS is a float in a shared table (key_bound; +-inf for non-finite keys, 0 for key
// HALF), times 2^s with s = 1 - cb clamped to [-126, 64]. Unclamped, the product is the one
// above, and normal (e1 - cb >= 1 - cb >= -126); s = -126 leaves it in [2^-126, 1) in
// magnitude (mid 2^(e1 - 1) < 2^36 for 8-bit formats), where the true +-mid 2^(e1 - cb) is
// too (e1 - cb < e1 - 127), so both floor to 0 or -1 alike; s = 64 puts both >= 2^64 (no
// float overflow: < 2^100); +-inf floors to the saturated ends, clamped to +-dl as D_BIG is.
#if KEY_TABLE
__shared__ float key_bound[NKEYS + 1];

__device__ __forceinline__ float key_boundary(int k) {  // key_bound[k] (block_model fills it)
    const int y = k - HALF, a = abs(y) - 1, e1 = max(a >> MANT, 1);
    const int mid = 2 * a + 1 - ((e1 - 1) << (MANT + 1));
    if (abs(y) >= NONFINITE) return __int_as_float(y < 0 ? 0xff800000 : 0x7f800000);  // -+inf
    return (float)(y < 0 ? -mid : y > 0 ? mid : 0) * __int_as_float((e1 - 1 + 127) << 23);
}
#endif

__device__ __forceinline__ int clamped_offset(int k, const Val& v, const Model& md) {
    if (v.big) return big_offset(k, v.mub, v.cb, v.dl);
#if KEY_TABLE
    const float scale = v.ksc;
    const float kb = __uint_as_float(smem_word(md.kb_s + 4 * (unsigned)k));
    const int fl = __float2int_rd(kb * scale);
    return min(max(min(max(fl, -SAT32), SAT32) - v.mu32, -v.dl), v.dl);
#else
    const int y = k - HALF;
    const int a = abs(y) - 1;
    const int e1 = max(a >> MANT, 1);
    const int mid = 2 * a + 1 - ((e1 - 1) << (MANT + 1));
    const float scale = __int_as_float((min(max(e1 - v.cb, -126), 64) + 127) << 23);
    const int fl = __float2int_rd((float)(y < 0 ? -mid : y > 0 ? mid : 0) * scale);
    const int d = min(max(fl, -SAT32), SAT32) - v.mu32;
    return abs(y) >= NONFINITE ? (y < 0 ? -v.dl : v.dl) : min(max(d, -v.dl), v.dl);
#endif
}

// k's place in its empirical bucket as a 32-bit fraction: E's interpolation weight.
__device__ __forceinline__ unsigned low_bits(int k) {
    return (unsigned)(k & ((1 << ES) - 1)) << (ES ? 32 - ES : 0);
}

// S(k) given E(k) = e and D = clamped_offset(k, v) (dist_kernels._smooth_with): mass of
// all keys below k in units of 2^-31, in 32-bit words where the CPU's int64 values fit them:
// |D| <= dl < 2^22 after the clamp, |zf| <= Z_MAX 2^22, tables rise (CoderModel checks
// them), so each interpolation's product shifted right is a high word (__umulhi) and S <=
// 2^31. Branch-free: for 0 <= k <= NKEYS every read is in its table (the ends' D is +-dl),
// and the ends are selected last.
__device__ __forceinline__ unsigned smooth_with(int k, unsigned e, int d, const Val& v,
                                                const Model& md) {
    const int zf = (int)(((i64)d * v.rr) >> R_SHIFT);
    const unsigned ix = (unsigned)((zf >> Z_FRAC) + (Z_MAX << Z_GRID_BITS));
    const int sh = shape_row(v.m) + (int)ix;
    const unsigned t0 = shape_w(md, sh);
    unsigned s = t0 + __umulhi(shape_w(md, sh + 1) - t0,
                               (unsigned)(zf & ((1 << Z_FRAC) - 1)) << 16);
    if (v.w)
        s = (unsigned)(((u64)s * (unsigned)(WEIGHT_ONE - v.w) + (u64)e * (unsigned)v.w) >> 16);
    return k <= 0 ? 0u : k >= NKEYS ? (unsigned)ONE : s;
}

// E(k) of the value's model (smooth()'s empirical term), in units of 2^-31.
__device__ __forceinline__ unsigned emp_at(int k, const Val& v, const Model& md) {
    const int b = emp_row(v.m) + (min(max(k, 0), NKEYS - 1) >> ES);
    const unsigned e = emp_w(md, b);
    return ES ? e + __umulhi(emp_w(md, b + 1) - e, low_bits(k)) : e;
}

// S(k) for 0 <= k <= NKEYS (dist_kernels._smooth_cdf).
__device__ __forceinline__ unsigned smooth(int k, const Val& v, const Model& md) {
    return smooth_with(k, v.w ? emp_at(k, v, md) : 0u, clamped_offset(k, v, md), v, md);
}

// clamped_offset(j 2^ES, v) where a key step of the top stage is two binades (bf16: ES = MANT
// + 1): for 1 <= m = |j - HALF / 2^ES| <= 127, |y| = m 2^ES, so e1 = (m 2^ES - 1) >> MANT =
// 2m - 1 and mid = 2^(ES + 1) - 1 for every j; no key but the ends (m = 128, S selected) is
// non-finite (NONFINITE > HALF - 2^ES); m = 0 is key HALF (+0, B = 0).
#define TOP_BINADES (ES == MANT + 1 && NONFINITE > HALF - (1 << ES))
// +-mid 2^(e1 - cb) is built as float bits: mid = 2^(ES + 1) - 1 is 1.1..1b 2^ES (ES + 1
// ones), so the float has exponent field f = ES + 127 + e1 - cb and mantissa bits 1..1 0..0.
// f clamped to [1, TOP_FMAX]: a true f < 1 puts |B / u| below 2^-125, where it floors to 0
// or -1 by its sign as the clamped one (a normal float: no flush to zero) does; f >
// TOP_FMAX puts |floor(B / u)| at 2^30 - 2^21 or more, and so |D| above 2^29 - 2^21 > dl
// (|mu_u| < MU32 = 2^29 here), as the clamped one's: both clamp to the same end. In range,
// |floor(B / u)| < 2^30, so no clamp before subtracting mu_u (clamped_offset's SAT32).
#define TOP_FMAX (127 + 29)
__device__ __forceinline__ int top_offset(int j, const Val& v, const Model& md) {
    if (!TOP_BINADES || v.big) return clamped_offset(j << ES, v, md);
    const int y = j - (HALF >> ES);  // e1 = 2 |y| - 1
    const int f = 2 * (int)__sad(j, HALF >> ES, 0) + (ES + 126) - v.cb;
    const unsigned bits = ((unsigned)min(max(f, 1), TOP_FMAX) << 23)
                          | (((1u << ES) - 1) << (23 - ES)) | ((unsigned)y & 0x80000000u);
    // key HALF (+0): B = 0, the float +0 (a select, not a branch around the conversion)
    const int fl = __float2int_rd(__uint_as_float(y ? bits : 0u));
    return min(max(fl - v.mu32, -v.dl), v.dl);
}

// A stage of the decoder: keys b + j 2^sh (j = 0..256), mass S_b .. S_b + T. The top stage
// (a 16-bit format's top byte, an 8-bit format's only stage: TOP) is b = 0, S_b = 0, T = ONE,
// sh = ES, its keys E's bucket starts, where E = em[k >> ES] (low_bits(k) = 0). A 16-bit
// format's low stage (sh = 0) is one empirical bucket j = b >> ES, where E is linear: E(b +
// i) = em[j] + floor((em[j + 1] - em[j]) i / 2^ES) for i = 0..2^ES (i = 2^ES: em[j + 1], the
// next bucket's start), e0 and de below; rq = spread / T as stage_cdf's float quotient takes it.
struct Stage {
    int b;
    unsigned sb, t, e0, de;
    float rq;
};

template <bool TOP>
__device__ __forceinline__ unsigned stage_s(int j, const Stage& st, const Val& v,
                                            const Model& md) {
    if (TOP) {
        return smooth_with(j << ES, v.w ? emp_w(md, emp_row(v.m) + j) : 0u, top_offset(j, v, md),
                           v, md);
    }
    return smooth_with(st.b + j, st.e0 + (unsigned)(((u64)st.de * (unsigned)j) >> ES),
                       clamped_offset(st.b + j, v, md), v, md);
}

// cdf(j) of a stage with mass S_b .. S_b + T (dist_kernels._stage_cdf). S never falls for
// a value the coder accepts (see the decoder), so 0 <= S_j - S_b <= T and q = floor(spread
// (S_j - S_b) / T) <= spread < 2^16. For 0 < T < 2^31 float products put spread (S_j - S_b)
// / T within 2^-5 of its value (relative errors: d, T, the approximate reciprocal's 2 ulps
// and two products, <= 2^-21 of < 2^16), so the nearest integer is q or q + 1, the remainder
// is in [-T, T) (which int32 holds: its low 32 bits are exact) and one compare makes it q.
// rq = spread / T in float (stage_rq).
__device__ __forceinline__ float stage_rq(unsigned t, int spread) {
    return (float)spread * __fdividef(1.0f, (float)t);
}

__device__ __forceinline__ int stage_cdf(int j, unsigned sj, unsigned sb, unsigned t,
                                         int spread, float rq) {
    if (t == ONE) return j + (int)__umulhi(2u * spread, sj - sb);  // (spread d) >> 31
    if (t == 0) return j * ((spread + 256) >> 8);
    const unsigned d = sj - sb;
    const int q = __float2int_rn((float)d * rq);
    const int r = (int)((unsigned)spread * d - (unsigned)q * t);  // in [-T, T)
    return j + q - (r < 0);
}

template <bool TOP>
__device__ __forceinline__ int stage_c(int j, unsigned sj, const Stage& st, int spread) {
    if (TOP) return j + (int)__umulhi(2u * spread, sj);
    return stage_cdf(j, sj, st.sb, st.t, spread, st.rq);
}

__device__ __forceinline__ int key_of(unsigned bits) {
    return (bits & HALF) ? bits ^ (NKEYS - 1) : bits ^ HALF;
}

__device__ __forceinline__ unsigned bits_of(int key) {
    return key >= HALF ? key ^ HALF : key ^ (NKEYS - 1);
}

// ---- CRC-32 (zlib's) of a chunk, by the whole warp ---------------------------------------

// a * b modulo the CRC polynomial, bit-reflected (zlib's multmodp, fixed 32 rounds).
__device__ __forceinline__ unsigned multmodp(unsigned a, unsigned b) {
    unsigned p = 0;
#pragma unroll
    for (int i = 31; i >= 0; --i) {
        if (a & (1u << i)) p ^= b;
        b = (b & 1) ? (b >> 1) ^ CRC_POLY : b >> 1;
    }
    return p;
}

// Lane k takes crc32 of its slice (4-byte aligned, in order), shifted over the bytes after
// it (crc(A B) = crc(A) x^(8 |B|) + crc(B), zlib's crc32_combine); the warp XORs them.
// xpow[i] = x^(2^i) mod P. p must be 4-byte aligned.
__device__ unsigned warp_crc(const unsigned char* p, int nbytes, int lane, const unsigned* tab,
                             const unsigned* xpow) {
    const int seg = ((nbytes + LANES - 1) / LANES + 3) & ~3;
    const int lo = min(lane * seg, nbytes), hi = min(lo + seg, nbytes);
    unsigned c = FULL;
    int i = lo;
    for (; i + 4 <= hi; i += 4) {
        c ^= *reinterpret_cast<const unsigned*>(p + i);
        c = tab[c & 255] ^ (c >> 8);
        c = tab[c & 255] ^ (c >> 8);
        c = tab[c & 255] ^ (c >> 8);
        c = tab[c & 255] ^ (c >> 8);
    }
    for (; i < hi; ++i) c = tab[(c ^ p[i]) & 255] ^ (c >> 8);
    c = ~c;
    unsigned after = (unsigned)(nbytes - hi), k = 3;  // x^(8 after) = prod x^(2^(3 + bit))
    for (; after; after >>= 1, ++k)
        if (after & 1) c = multmodp(__ldg(xpow + (k & 31)), c);
#pragma unroll
    for (int o = 16; o; o >>= 1) c ^= __shfl_xor_sync(FULL, c, o);
    return c;
}

__device__ __forceinline__ void crc_table(unsigned* tab) {
    for (int i = threadIdx.x; i < 256; i += blockDim.x) {
        unsigned c = i;
        for (int b = 0; b < 8; ++b) c = (c & 1) ? (c >> 1) ^ CRC_POLY : c >> 1;
        tab[i] = c;
    }
}

// Block prologue: CRC table, and (SMEM) the model tables into shared memory.
// The chunk this warp codes: chunk c of chunk_size values, values [first, first + cn).
struct WarpChunk { int c; i64 first; int cn; };

__device__ __forceinline__ WarpChunk chunk_at(int c, i64 n, int chunk_size) {
    const i64 first = (i64)c * chunk_size;
    return {c, first, (int)min((i64)chunk_size, n - first)};
}

__device__ __forceinline__ WarpChunk warp_chunk(i64 n, int chunk_size) {
    return chunk_at(blockIdx.x * WARPS + (threadIdx.x >> 5), n, chunk_size);
}

// The decoder's next chunk for this warp (DYN_CHUNKS): taken from a counter shared by the
// launch (zeroed by dist.py), so a warp that finishes early takes more work; a block's
// warp slots stay filled until the last chunks (static assignment, one chunk a warp, left
// them to the slowest chunk of each block). Which warp decodes a chunk changes nothing in
// the output or the status (both indexed by chunk). 16-bit formats keep one chunk a warp:
// at their 64-register cap the loop over chunks spills.
// The warp's chunk is kept in shared memory (ChunkQueue) and re-read where needed: a value
// in a register would stay live through the whole group loop, which is at its register cap.
struct ChunkQueue {
    int* ctr;           // chunks taken: status[2 n_chunks] (dist.py zeroes it)
    int chunk[WARPS];   // each warp's current chunk
};

__device__ __forceinline__ int warp_chunk_id(const ChunkQueue& q) {
#if DYN_CHUNKS
    return ((const volatile int*)q.chunk)[threadIdx.x >> 5];
#else
    return blockIdx.x * WARPS + (int)(threadIdx.x >> 5);
#endif
}

__device__ __forceinline__ int next_chunk(ChunkQueue& q, int n_chunks, int lane) {
#if DYN_CHUNKS
    int c = 0;
    // the counter's address is re-read from shared memory too (set by the block)
    if (lane == 0) c = atomicAdd(*(int* const volatile*)&q.ctr, 1);
    c = __shfl_sync(FULL, c, 0);
    if (lane == 0) ((volatile int*)q.chunk)[threadIdx.x >> 5] = c;
    __syncwarp();
    return c;
#else
    return n_chunks;  // one chunk a warp
#endif
}

__device__ __forceinline__ int first_chunk(ChunkQueue& q, int lane) {
#if DYN_CHUNKS
    return next_chunk(q, 0, lane);
#else
    return warp_chunk_id(q);
#endif
}

__device__ __forceinline__ Model block_model(unsigned* tab, const unsigned* shapes,
        const unsigned* emps, int models, const int* weights, const float* zinv,
        const i64* rtab, int p, bool guesses = false) {
    crc_table(tab);
#if SMEM_PARAMS
    for (int i = threadIdx.x; i < 512; i += blockDim.x) rtab_s[i] = rtab[i];
    for (int m = threadIdx.x; m < min(models, TOP_END_MODELS); m += blockDim.x)
        top_end_s[m] = top_ends(weights[m], emps[m * EMP_W + 1], emps[m * EMP_W + 255], p);
#endif
    Model md;
#if SMEM
    extern __shared__ unsigned smem[];
    for (int m = 0; m < models; ++m) {  // one block a model (shape_row, emp_row)
        for (int i = threadIdx.x; i < SHAPE_W; i += blockDim.x)
            smem[shape_row(m) + i] = SMEM_PARAMS && i == W_AT ? (unsigned)weights[m]
                                                              : shapes[m * SHAPE_W + i];
        for (int i = threadIdx.x; i < EMP_W; i += blockDim.x)
            smem[emp_row(m) + i] = emps[m * EMP_W + i];
    }
    md.shapes = md.emps = smem;
#if ZINV_SMEM
    // the decoder's inverse rows after the model blocks, if the launch gave them room
    unsigned dyn;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dyn));
    if (guesses && dyn >= (unsigned)models * (MODEL_W + ZROW) * 4u) {
        float* zs = (float*)(smem + models * MODEL_W);
        for (int i = threadIdx.x; i < models * ZROW; i += blockDim.x) zs[i] = zinv[i];
        zinv = zs;
    }
#endif
#if KEY_TABLE
    for (int k = threadIdx.x; k <= NKEYS; k += blockDim.x) key_bound[k] = key_boundary(k);
#endif
#else
    md.shapes = shapes;
    md.emps = emps;
#endif
    md.weights = weights;
    md.zinv = zinv;
    md.rtab = rtab;
    __syncthreads();
#if SMEM
    // held in a register, not rebuilt at each read; after the barrier (volatile: it stays
    // there), so no table read (smem_word) can be placed before the tables are filled
    unsigned a = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("" : "+r"(a));
    md.sh_s = a;
    md.em_s = a;  // (emp_w reads through sh_s)
#endif
#if KEY_TABLE
    unsigned kb = (unsigned)__cvta_generic_to_shared(key_bound);  // likewise
    asm volatile("" : "+r"(kb));
    md.kb_s = kb;
#endif
    return md;
}

// First value index in [from, to) of the chunk whose (mu, sigma) is invalid, or -1 (warp).
__device__ int first_bad(const unsigned* mu, const unsigned* sg, i64 first, int from, int to,
                         int lane) {
    for (int g0 = from; g0 < to; g0 += LANES) {
        const i64 i = first + g0 + lane;
        const bool bad = g0 + lane < to && !param_ok(mu[i], sg[i]);
        const unsigned bal = __ballot_sync(FULL, bad);
        if (bal) return g0 + __ffs(bal) - 1;
    }
    return -1;
}

// ---- encoder ---------------------------------------------------------------------------

// Push [c0, c1) onto x (dist_kernels._enc_step, int64 state as there). All lanes call it,
// live or not; the words land below pos in lane order.
__device__ __forceinline__ void enc_step(i64& x, bool live, i64 c0, i64 c1, int p, int lane,
                                         unsigned char* out, int& pos) {
    const i64 fr = c1 - c0;
    const bool emit = live && x >= (i64)((u64)fr << (32 - p));
    const unsigned b = __ballot_sync(FULL, emit);
    if (emit) {
        const unsigned above = lane == 31 ? 0u : b & (FULL << (lane + 1));
        const int at = pos - 2 * (1 + __popc(above));
        out[at] = x & 0xFF;
        out[at + 1] = (x >> 8) & 0xFF;
        x >>= 16;
    }
    pos -= 2 * __popc(b);
    if (live) {  // 32-bit division whenever the operands allow (always, for monotone S)
        const u64 q = ((u64)x >> 32 == 0 && (u64)fr >> 32 == 0)
                          ? (u64)((unsigned)x / (unsigned)fr) : (u64)x / (u64)fr;
        x = (i64)((q << p) + ((u64)x - q * (u64)fr) + (u64)c0);
    }
}

// res per chunk (i64 x 4): mode (0 coded, 1 raw, ERR_PARAM), payload start within the
// chunk's scratch (or the invalid value's index in the chunk), payload length, CRC-32.
// The chunk's scratch is scratch[c * chunk_size * BYTES ...][: its bytes] (as big as raw:
// a payload that would not be smaller is not kept, exactly as dist_kernels decides).
extern "C" __global__ void __launch_bounds__(WARPS * 32, 1) dist_encode(
        const unsigned char* vals, const unsigned* mu, const unsigned* sg,
        const unsigned short* midx, int mshift, int m0, i64 n, int chunk_size, int n_chunks,
        int p, const unsigned* shapes, const unsigned* emps, int models, const int* weights,
        const float* zinv, const i64* rtab, const unsigned* xpow, unsigned char* scratch,
        i64* res) {
    __shared__ unsigned tab[256];
    const Model md = block_model(tab, shapes, emps, models, weights, zinv, rtab, p);
    const int lane = threadIdx.x & 31;
    const WarpChunk wc = warp_chunk(n, chunk_size);
    if (wc.c >= n_chunks) return;
    const int c = wc.c, cn = wc.cn, nbytes = cn * BYTES;
    const i64 first = wc.first;
    unsigned char* out = scratch + first * BYTES;
    const unsigned char* src = vals + first * BYTES;
    const int spread = (1 << p) - 256;
    i64* r = res + 4 * (i64)c;
    i64 x = LB;
    int pos = nbytes;
    i64 mode = MODE_CODED;
    int unchecked = cn;  // values [unchecked, cn) have valid (mu, sigma)
    for (int g0 = (cn - 1) & -LANES; g0 >= 0; g0 -= LANES) {  // groups, last first
        const int m = min(LANES, cn - g0);
        if (pos - 4 * m < 4 * LANES) { mode = MODE_RAW; break; }  // room for the group's words
        const bool live = lane < m;
        const i64 i = first + g0 + lane;
        i64 t0 = 0, t1 = 1, l0 = 0, l1 = 1;
        bool ok = true;
        if (live) {
            const unsigned mub = mu[i], sgb = sg[i];
            ok = param_ok(mub, sgb);
            if (ok) {
                const Val v = params(mub, sgb, midx ? midx[i >> mshift] : m0, md);
                const int key = key_of(BYTES == 2 ? ((const unsigned short*)vals)[i] : vals[i]);
                const int j = key >> ES, b = j << ES;
                const unsigned s0 = smooth(b, v, md), s1 = smooth(b + (1 << ES), v, md);
                t0 = stage_cdf(j, s0, 0, ONE, spread, 0.0f);
                t1 = stage_cdf(j + 1, s1, 0, ONE, spread, 0.0f);
                if (ES) {
                    const int lo = key - b;
                    const float rq = stage_rq(s1 - s0, spread);
                    l0 = stage_cdf(lo, smooth(key, v, md), s0, s1 - s0, spread, rq);
                    l1 = stage_cdf(lo + 1, smooth(key + 1, v, md), s0, s1 - s0, spread, rq);
                }
            }
        }
        if (__ballot_sync(FULL, !ok)) { mode = ERR_PARAM; unchecked = g0 + m; break; }
        unchecked = g0;
        if (ES) enc_step(x, live, l0, l1, p, lane, out, pos);  // low bytes are read last
        enc_step(x, live, t0, t1, p, lane, out, pos);
    }
    // Every (mu, sigma) is checked, as the CPU checks them all first: the lowest bad index.
    const int where = first_bad(mu, sg, first, 0, unchecked, lane);
    if (where >= 0) mode = ERR_PARAM;
    if (mode == MODE_CODED) {
        pos -= 4 * LANES;
        const int at = pos + 4 * lane;
        out[at] = x & 0xFF;
        out[at + 1] = (x >> 8) & 0xFF;
        out[at + 2] = (x >> 16) & 0xFF;
        out[at + 3] = x >> 24;
    }
    const unsigned crc = warp_crc(src, nbytes, lane, tab, xpow);
    if (lane == 0) {
        r[0] = mode;
        r[1] = mode == MODE_CODED ? pos : where;
        r[2] = mode == MODE_CODED ? nbytes - pos : nbytes;
        r[3] = crc;
    }
}

// Copy each chunk's payload to frame + base + dst[c] and write its directory entry
// (u32 length at 28 + 4c, u32 CRC at 28 + 4 nc + 4c, u8 mode at 28 + 8 nc + c). One block
// a chunk (grid-stride); modes are 0 or 1 here (dist.py raised on ERR_PARAM before).
extern "C" __global__ void dist_gather(const unsigned char* scratch, const unsigned char* vals,
        const i64* res, const i64* dst, i64 chunk_bytes, int n_chunks, i64 base,
        unsigned char* frame) {
    for (int c = blockIdx.x; c < n_chunks; c += gridDim.x) {
        const i64* r = res + 4 * (i64)c;
        const i64 len = r[2];
        const unsigned char* s = r[0] == MODE_RAW ? vals + c * chunk_bytes
                                                  : scratch + c * chunk_bytes + r[1];
        unsigned char* d = frame + base + dst[c];
        for (i64 k = threadIdx.x; k < len; k += blockDim.x) d[k] = s[k];
        if (threadIdx.x < 4) {
            frame[28 + 4 * (i64)c + threadIdx.x] = (unsigned char)(len >> (8 * threadIdx.x));
            frame[28 + 4 * (i64)n_chunks + 4 * c + threadIdx.x] =
                (unsigned char)(r[3] >> (8 * threadIdx.x));
        }
        if (threadIdx.x == 0) frame[28 + 8 * (i64)n_chunks + c] = (unsigned char)r[0];
    }
}

// The decoder's chunk table from a frame's directory, on the device (dist.py reads only the
// 28-byte header on the host): per chunk the payload offset, length, mode and CRC-32, and
// distribution.parse's two directory facts in facts[0..2] (the byte where the payloads end,
// the first chunk of unknown mode or -1, its mode). A directory that fails them (end !=
// size, or a mode > MODE_RAW) gives a table of empty coded chunks: the decoder then reads
// no payload byte (ERR_ODD), and the host raises parse's error from the facts before any
// chunk's. Where it passes, chunk c spans [base + sum of lengths before c, + its length),
// inside the frame. Also zeroes the decoder's status (2 nc + 1 ints). One block of
// DIR_THREADS: each thread sums a run of lengths, a block-wide scan of those sums gives
// each run's start.
#define DIR_THREADS 1024

__device__ __forceinline__ i64 le32(const unsigned char* p) {
    return (i64)(p[0] | (p[1] << 8) | (p[2] << 16) | ((unsigned)p[3] << 24));
}

extern "C" __global__ void __launch_bounds__(DIR_THREADS) dist_directory(
        const unsigned char* frame, i64 size, int nc, i64* table, i64* facts, int* status) {
    __shared__ i64 part[DIR_THREADS];
    __shared__ int bad;
    const int t = threadIdx.x;
    const int per = (nc + DIR_THREADS - 1) / DIR_THREADS;
    const int lo = min(t * per, nc), hi = min(lo + per, nc);
    const unsigned char* lens = frame + 28;
    const unsigned char* crcs = lens + 4 * (i64)nc;
    const unsigned char* modes = lens + 8 * (i64)nc;
    if (t == 0) bad = nc;
    for (int i = t; i < 2 * nc + 1; i += DIR_THREADS) status[i] = 0;
    __syncthreads();
    i64 sum = 0;
    for (int c = lo; c < hi; ++c) {
        sum += le32(lens + 4 * c);
        if (modes[c] > MODE_RAW) atomicMin(&bad, c);
    }
    part[t] = sum;
    __syncthreads();
    for (int s = 1; s < DIR_THREADS; s <<= 1) {  // inclusive scan of the runs' sums
        const i64 v = t >= s ? part[t - s] : 0;
        __syncthreads();
        part[t] += v;
        __syncthreads();
    }
    const i64 base = 28 + 9 * (i64)nc, end = base + part[DIR_THREADS - 1];
    const bool ok = end == size && bad == nc;
    i64 off = base + part[t] - sum;
    for (int c = lo; c < hi; ++c) {
        const i64 len = le32(lens + 4 * c);
        i64* row = table + 4 * (i64)c;
        row[0] = ok ? off : 0;
        row[1] = ok ? len : 0;
        row[2] = ok ? modes[c] : MODE_CODED;
        row[3] = ok ? le32(crcs + 4 * c) : 0;
        off += len;
    }
    if (t == 0) {
        facts[0] = end;
        facts[1] = bad < nc ? bad : -1;
        facts[2] = bad < nc ? modes[bad] : 0;
    }
}

// ---- decoder ---------------------------------------------------------------------------

// Which symbol a slot decodes to. Every value the coder accepts (param_ok: mu's exponent
// field < sigma's + 34) has |mu_u| < 2^50 <= 2^(MANT + 48): then the shifts in offset() are
// exact or saturate beyond the clamp +-dl, so S is non-decreasing in k, every stage CDF
// strictly increases (frequencies >= 1), and exactly one symbol holds the slot, so any
// guess and any bracketing search find the CPU's symbol (tests/test_gpu_dist_logic.py:
// every accepted value is regular). The decoder guesses its own way, in float32, better
// than the CPU does, and searches from the guessed symbol.

// Where a guess landed, for the Newton step (fast_guess): the fraction g it inverted
// (clamped), the unrounded key kf (value coordinates: key k's value at kf = k), dz/dg of
// the inverse there, and the value step between keys there.
struct Lin {
    float g, kf, dzdg, ulp;
};

// A key near CDF fraction g: the inverse shape (INV_POINTS intervals) interpolated, then
// mu + sigma z rounded to the nearest format value (dist_kernels._nearest_key).
__device__ __forceinline__ int guess_key(float g, float mu, float sg, const float* zinv,
                                         Lin* lin = nullptr) {
    const float gc = fminf(fmaxf(g, 0.0f), 1.0f);
    float t = gc * INV_POINTS;
    int i = min((int)t, INV_POINTS - 1);
    float dtdg = INV_POINTS;  // table steps per unit of g
    // The end intervals (mass below or above g < 2^-TAIL_FROM): the row's tail points,
    // TAIL_STEPS a binade of that mass (dist.tail_inverse).
    if (t < 1.0f || t > INV_POINTS - 1) {
        const bool up = t > 1.0f;
        const float q = fmaxf(up ? 1.0f - gc : gc, 1e-12f);
        t = fminf(fmaxf((-__log2f(q) - TAIL_FROM) * TAIL_STEPS, 0.0f), TAIL_POINTS - 0.01f);
        i = min((int)t, TAIL_POINTS - 1);
        zinv += ZTAIL + (up ? TAIL_POINTS + 1 : 0);
        dtdg = __fdividef(up ? TAIL_STEPS / 0.6931472f : -TAIL_STEPS / 0.6931472f, q);
    }
#if ZINV_SMEM
    const float z0 = zinv[i], z1 = zinv[i + 1];  // shared or global (block_model)
#else
    const float z0 = __ldg(zinv + i), z1 = __ldg(zinv + i + 1);
#endif
    const unsigned b = __float_as_uint(mu + sg * (z0 + (z1 - z0) * (t - (float)i)));
    const unsigned a = b & 0x7FFFFFFF;
    const int ex = (int)(a >> 23) - 127 + BIAS;  // the format's exponent field
    // |value| in key steps, unrounded: within the format's binades the float's bits are
    // linear in it ((float) a drops < 2^-8 of a key step), among its subnormals (ex < 1)
    // |value| 2^(MANT + BIAS - 1) (two factors: bf16's 2^133 is no float); rounded to the
    // nearest key, NaN / inf as the largest finite one.
    const float maghat = ex >= 1
        ? fminf((float)a * (1.0f / (1 << (23 - MANT))) - (float)((127 - BIAS) << MANT),
                (float)(NONFINITE - 1))
        : __uint_as_float(a) * (float)(1 << MANT) * __int_as_float((BIAS + 126) << 23);
    const int mag = __float2int_rn(maghat);
    if (lin) {
        // 2^(exponent - MANT) as float bits, floored at the smallest normal float
        const int fe = ex >= 1 ? (int)((b >> 23) & 0xFF) : 127 - BIAS + 1;
        lin->g = gc;
        lin->kf = (b >> 31) ? (float)(HALF - 1) - maghat : (float)HALF + maghat;
        lin->dzdg = (z1 - z0) * dtdg;
        lin->ulp = __int_as_float(max(fe - MANT, 1) << 23);
    }
    return (b >> 31) ? HALF - 1 - mag : HALF + mag;
}

// Key k's value and (*ulp) the value step there, as float32 (guesses only; NaN / inf keys
// read as the largest finite magnitude). Format subnormals scale by 2^(1 - BIAS) after
// 2^-MANT, so that no factor is a float32 subnormal (bf16's 2^-133 is).
__device__ __forceinline__ float key_value(int k, float* ulp) {
    const int y = k - HALF;
    const int a = min(y < 0 ? -y - 1 : y, NONFINITE - 1);
    const int e1 = a >> MANT;
    *ulp = __int_as_float((max(e1, 1) + 127 - BIAS) << 23) * (1.0f / (1 << MANT));
    const float v = e1 ? __int_as_float(((e1 + 127 - BIAS) << 23)
                                        | ((a & ((1 << MANT) - 1)) << (23 - MANT)))
                       : (float)a * (1.0f / (1 << MANT)) * __int_as_float((128 - BIAS) << 23);
    return y < 0 ? -v : v;
}

// FWD_STEPS Newton steps on a 16-bit format's low stage (sh = 0), from key k: solve
// c(u) = slot + 1/2 in the boundary coordinate u (key k spans [k, k + 1)), with
// c(u) = u - b + (S(u) - S_b) / unit and S = (1 - w) F + w E evaluated forwards: F from the
// shape's own CDF points at z = (x(u) - mu) / sigma (the points S interpolates, so no error
// of the inverse table's interpolation), E linear over the stage (the stage is one
// empirical bucket), both taken relative to S_b in exact integers first (near S = 1 a float
// S has only 2^-24 of resolution, ~1/spread of a small stage's mass). Started at key k's
// value (u = k + 1/2); x moves with u by the step there. c rises with slope >= 1, so a
// step is finite; it is clamped all the same, and any key is a valid start for the checks.
// They replace the low stage's guess rounds (a miss costs the whole warp). Not for the
// 8-bit formats' only stage: a key there spans ~1 sigma, too curved for one linearization.
__device__ __forceinline__ int fwd_steps(int k, int slot, const Stage& st, float unit,
        float mu, float sg, const Val& v, const Model& md) {
    const int b = st.b;
    const unsigned sb = st.sb;
    float ulp;
    float x = key_value(min(max(k, 0), NKEYS - 1), &ulp);
    float u = (float)k + 0.5f;
    const float rs = __fdividef(1.0f, unit);  // slots per unit of S
    const float zs = __fdividef((float)(1 << Z_GRID_BITS), sg);  // shape points per value
    const float wf = (float)v.w * (1.0f / WEIGHT_ONE);
    const int shp = shape_row(v.m);
    const float e0 = (float)(int)(st.e0 - sb);
    const float de = (float)st.de * (1.0f / (1 << ES));  // per key
    const float target = (float)slot + 0.5f;
#pragma unroll
    for (int i = 0; i < FWD_STEPS; ++i) {
        const float zf = fminf(fmaxf((x - mu) * zs + (float)(Z_MAX << Z_GRID_BITS), 0.0f),
                               (float)(2 * Z_MAX << Z_GRID_BITS) - 0.01f);
        const int ix = (int)zf;
        const unsigned t0 = shape_w(md, shp + ix), t1 = shape_w(md, shp + ix + 1);
        const float dt = (float)(t1 - t0);
        float rel = (1.0f - wf) * ((float)(int)(t0 - sb) + dt * (zf - (float)ix));
        float dsl = (1.0f - wf) * dt * zs * ulp;  // dS/du
        if (v.w) {
            rel += wf * (e0 + de * (u - (float)b));
            dsl += wf * de;
        }
        const float c = u - (float)b + rel * rs;
        const float d =
            fminf(fmaxf(__fdividef(target - c, 1.0f + dsl * rs), -512.0f), 512.0f);
        u += d;
        x += d * ulp;
    }
    return __float2int_rd(u);
}

// Bounds of a 16-bit format's low-stage symbol from cdf(j) = j + floor(spread
// (S(b + j) - S_b) / T) with S(b + j) - S_b >= w (E(b + j) - E(b)) / 2^16, E linear in the
// stage (one empirical bucket), F not falling: with a = spread we / (256 T) slots a key from
// E alone (we = floor(w de / 2^16), E's share of T), cdf(j) >= j (1 + a) and cdf(j + 1) <=
// j + 1 + spread - (255 - j) a, so the slot's symbol lies in ((slot - 1 - spread + 255 a) /
// (1 + a), (slot + 1/2) / (1 + a)]. They bind where F is flat over the stage's end the slot
// is in: a stage of NaN / inf / 0 / subnormal keys with an empirical term (S linear: a ~
// 255, the slot's symbol slot >> (p - 8)), a Gaussian tail whose slot lies beyond F's mass
// (the j term alone: a = 0, symbol <= slot), where the forward steps approach it slowly
// from the steep side. A guess only (rounding aside): the exact CDFs check it.
__device__ __forceinline__ int low_bounds(int j, int slot, const Stage& st, const Val& v,
                                          int p) {
    const unsigned we = __umulhi(st.de, (unsigned)v.w << 16);  // floor(de w / 2^16)
    const float a = (float)we * st.rq * (1.0f / 256);  // st.rq = spread / T
    const float r = __fdividef(1.0f, 1.0f + a);
    const int hi = __float2int_rd(((float)slot + 0.5f) * r);
    const int lo = __float2int_rd(((float)(slot + 255 - (1 << p)) + 255.0f * a) * r) + 1;
    return min(max(min(max(j, lo), hi), 0), 255);
}

// The top stage's flat ends: where F is 0 or 1 (NaN / inf / the largest
// values), S = w E only, and E rises about linearly there (uniform counts), so cdf(j) ~
// j r0 from the bottom, with r0 = 1 + spread w E(1) / 2^47 slots a symbol, and ~ 2^p - (256
// - j) r1 from the top (r1 from 1 - E(255)): the slot's symbol is at most (slot + 1/2) / r0
// and at least 255 - (2^p - slot - 1/2) / r1. Where they bind, the float guess (F's
// inverse) cannot see the symbol; elsewhere they are far from it. A guess only: the exact
// CDFs check it.
__device__ __forceinline__ int top_bounds(int j, int slot, const Val& v, const Model& md,
                                          int p) {
#if SMEM_PARAMS
    const float2 r = top_end_s[min(v.m, TOP_END_MODELS - 1)];
#else
    const int em = emp_row(v.m);
    const float2 r = top_ends(v.w, emp_w(md, em + 1), emp_w(md, em + 255), p);
#endif
    const float s5 = (float)slot + 0.5f;
    const int hi = __float2int_rd(s5 * r.x);
    const int lo = 255 - __float2int_rd(((float)(1 << p) - s5) * r.y);
    return min(max(j, lo), hi);
}

// The guess: the target S* from slot = j + spread (S_j - S_b) / T and
// F* = (2^16 S* - w E(k)) / (2^16 - w), inverted through the shape, with j and k from the
// previous guess (the first one inverts slot / 2^p alone). GUESS_ROUNDS = 1 takes j and E
// from that first guess only; but with w > 0 its key is off by many keys wherever w E is
// far from w F (a small share of empirical mass can move it ~100 keys), so j is off as
// much and the target by ~j T / spread: about one symbol where keys are dense. A further
// round from the last round's key refines j and E, and a miss stalls its whole warp.
// Then one Newton step in keys from the last inversion: S linear through its point (F's
// slope from the inverse's dz/dg there, E's from its bucket) and the symbol's own term
// j(k) of the slot (slot ~ j + spread (S_j - S_b) / T: where S is flat the j term decides,
// and the fixed-point rounds ignore its slope). Without an empirical term (w = 0) a round
// only refines j, which the step does too: such a value runs PURE_ROUNDS in the top stage,
// whatever GUESS_ROUNDS. A 16-bit format's low stage runs LOW_ROUNDS in place of
// GUESS_ROUNDS (PURE_ROUNDS at most at w = 0), then FWD_STEPS (fwd_steps); with
// LOW_E_START its first guess takes E too.
// A 16-bit format's low stage takes E from its bucket (Stage: e0, de; E at the key clamped
// into the stage, exact for keys in it, and a guess's key outside it misses anyway).
// The guessed symbol is then clamped into the bounds of flat stretches: low_bounds
// (a 16-bit format's low stage), top_bounds (a 16-bit format's top stage with w > 0).
template <bool TOP>
__device__ __forceinline__ int fast_guess(int slot, const Stage& st, float mu, float sg,
        const float* zinv, const Val& v, const Model& md, int p) {
    constexpr int sh = TOP ? ES : 0;
    const int b = TOP ? 0 : st.b;
    const unsigned sb = TOP ? 0u : st.sb, t = TOP ? (unsigned)ONE : st.t;
    const float ft = (float)t, fsb = (float)sb;
    Lin lin;
    // the slot's fraction of the stage: the first target S_b + gs T (the top stage's is gs)
    const float gs = ((float)slot + 0.5f) * (1.0f / (1 << p));
    float g0 = TOP ? gs : (fsb + gs * ft) * (1.0f / ONE);
    if (!TOP && LOW_E_START && v.w) {
        // E from the stage's bucket at the key where S linear in the key would put the slot
        // (gs of the way), as a round takes E at the last guess's key: LOW_ROUNDS = 0
        const float e = (float)st.e0 + (float)st.de * gs;
        g0 = (g0 * WEIGHT_ONE - (float)v.w * e * (1.0f / ONE))
             * __fdividef(1.0f, (float)(WEIGHT_ONE - v.w));
    }
    int k = guess_key(g0, mu, sg, zinv, &lin);
    const float unit = __fdividef(ft, (float)((1 << p) - 256));
    // rounds with an empirical term, and without (w = 0: at most LOW_ROUNDS in a low stage)
    constexpr int emp_rounds = TOP ? GUESS_ROUNDS : LOW_ROUNDS;
    constexpr int pure_rounds = TOP || PURE_ROUNDS < LOW_ROUNDS ? PURE_ROUNDS : LOW_ROUNDS;
#pragma unroll
    for (int round = 0; round < (emp_rounds > pure_rounds ? emp_rounds : pure_rounds); ++round) {
        if (round >= (v.w ? emp_rounds : pure_rounds)) break;
        const int j0 = min(max((k - b) >> sh, 0), 255);
        float target = fsb + ((float)(slot - j0) + 0.5f) * unit;
        if (v.w) {
            const unsigned e = TOP ? emp_at(k, v, md) : st.e0 + (unsigned)(((u64)st.de
                                     * (unsigned)min(max(k - b, 0), 1 << ES)) >> ES);
            target = (target * WEIGHT_ONE - (float)v.w * (float)e)
                     * __fdividef(1.0f, (float)(WEIGHT_ONE - v.w));
        }
        k = guess_key(target * (1.0f / ONE), mu, sg, zinv, &lin);
    }
    {
        // Solve S(k) = S_b + (slot + 1/2 - j(k)) T / spread for k, S and j(k) = (k - b) / 2^sh
        // linear around the last inversion's key kf.
        const float wf = (float)v.w * (1.0f / WEIGHT_ONE);
        float est = (1.0f - wf) * (float)ONE * lin.g;
        float slope = (1.0f - wf) * (float)ONE * __fdividef(lin.ulp, sg * lin.dzdg)
                      + unit * (1.0f / (1 << sh));
        if (v.w) {
            const int em = emp_row(v.m);
            const int bb = TOP ? min(max(k, 0), NKEYS - 1) >> ES : b >> ES;
            const unsigned e0 = TOP ? emp_w(md, em + bb) : st.e0;
            const float de = (float)(TOP ? emp_w(md, em + bb + 1) - e0 : st.de)
                             * (1.0f / (1 << ES));
            // E at boundary kf + 1/2 (key k's bin starts at boundary k, at value
            // coordinate k - 1/2), per key
            est += wf * ((float)e0 + de * (lin.kf + 0.5f - (float)(bb << ES)));
            slope += wf * de;
        }
        const float target = fsb + ((float)slot + 0.5f
                                    - (lin.kf - (float)b) * (1.0f / (1 << sh))) * unit;
        // Any k is a valid start: a 0 or NaN slope (t = 0 stages, rare) clamps.
        k = __float2int_rn(fminf(fmaxf(lin.kf + __fdividef(target - est, slope), -1.0f),
                                 (float)NKEYS));
    }
    if (FWD_STEPS && !TOP) k = fwd_steps(k, slot, st, unit, mu, sg, v, md);
    int j = min(max((k - b) >> sh, 0), 255);
    if (!TOP && ES) j = low_bounds(j, slot, st, v, p);
    if (TOP && ES && v.w) j = top_bounds(j, slot, v, md, p);
    return j;
}

struct Sym {
    int j, c0, c1;     // symbol, cdf(j), cdf(j + 1)
    unsigned sj, sn;   // S at its two ends
};

// The search after a missed guess (the CDF strictly increases, so any bracketing
// search finds the CPU's symbol). The first probe steps by the guessed symbol's
// own frequency, the next ones interpolate and bisect in turn, so a near miss costs one or
// two CDFs and no miss more than about twice a bisection's 8.
template <bool TOP>
__device__ Sym fast_search(int slot, const Sym& g, const Stage& st, int spread, const Val& v,
                           const Model& md) {
    int lo, hi, k, clo, chi;
    unsigned slo, shi;
    // Probe positions only need to lie in (lo, hi), where they are clamped: float
    // quotients (cdf values are < 2^16 + 256, exact in float) instead of int64 divisions.
    const float rdens = __fdividef(1.0f, (float)max(g.c1 - g.c0, 1));
    if (g.c1 <= slot) {
        lo = g.j + 1; slo = g.sn; clo = g.c1;
        hi = 256; shi = TOP ? (unsigned)ONE : st.sb + st.t; chi = spread + 256;
        k = lo + 1 + (int)fminf((float)(slot - clo) * rdens, 256.0f);
    } else {
        hi = g.j; shi = g.sj; chi = g.c0;
        lo = 0; slo = TOP ? 0u : st.sb; clo = 0;
        k = hi - (int)fminf(ceilf((float)(chi - slot) * rdens), 256.0f);
    }
    bool interp = false;
    while (hi - lo > 1) {
        k = min(max(k, lo + 1), hi - 1);
        const unsigned sk = stage_s<TOP>(k, st, v, md);
        const int ck = stage_c<TOP>(k, sk, st, spread);
        if (ck <= slot) { lo = k; slo = sk; clo = ck; }
        else { hi = k; shi = sk; chi = ck; }
        interp = !interp;
        k = interp ? lo + (int)((float)((slot - clo) * (hi - lo))
                                * __fdividef(1.0f, (float)(chi - clo)))
                   : (lo + hi) >> 1;
    }
    Sym s;
    s.j = lo; s.sj = slo; s.sn = shi; s.c0 = clo; s.c1 = chi;
    return s;
}

// The guessed symbol of slot in a stage, with S and cdf at both its ends (two exact CDFs);
// true if it holds the slot. A stage of no mass (T = 0: a low byte under a top-byte symbol
// where S is flat, as NaN / inf keys under a Gaussian) has cdf(j) = j 2^(p - 8) exactly:
// its symbol is the slot's top byte, with no guess and no check (the float guess would
// miss it by far).
template <bool TOP>
__device__ __forceinline__ bool guess_symbol(Sym& s, int slot, const Stage& st, const Val& v,
        float muf, float sgf, const Model& md, int p) {
    const int spread = (1 << p) - 256;
    if (!TOP && st.t == 0) {  // a low stage of no mass: cdf(j) = j 2^(p - 8), S flat at S_b
        s.j = slot >> (p - 8);
        s.c0 = s.j << (p - 8);
        s.c1 = s.c0 + (1 << (p - 8));
        s.sj = s.sn = st.sb;
        return true;
    }
    s.j = fast_guess<TOP>(slot, st, muf, sgf, md.zinv + v.m * ZROW, v, md, p);
    s.sj = stage_s<TOP>(s.j, st, v, md);
    s.sn = stage_s<TOP>(s.j + 1, st, v, md);
    s.c0 = stage_c<TOP>(s.j, s.sj, st, spread);
    s.c1 = stage_c<TOP>(s.j + 1, s.sn, st, spread);
    return s.c0 <= slot && slot < s.c1;
}

// After a missed guess, its neighbour on the slot's side with one more exact CDF (most
// misses are by one symbol); true if that one holds the slot (then s is it).
template <bool TOP>
__device__ __forceinline__ bool near_symbol(Sym& s, int slot, const Stage& st, int spread,
                                            const Val& v, const Model& md) {
    const bool up = slot >= s.c1;  // else slot < c0: the symbol below (j > 0, as cdf(0) = 0)
    const int k = up ? s.j + 2 : s.j - 1;
    if (up && k > 256) return false;  // j = 255 and slot >= 2^p: a corrupt state
    const unsigned sk = stage_s<TOP>(k, st, v, md);
    const int ck = stage_c<TOP>(k, sk, st, spread);
    if (up ? slot >= ck : slot < ck) return false;
    if (up) { s.j += 1; s.c0 = s.c1; s.c1 = ck; s.sj = s.sn; s.sn = sk; }
    else { s.j -= 1; s.c1 = s.c0; s.c0 = ck; s.sn = s.sj; s.sj = sk; }
    return true;
}

// The symbol of lane q's slot, searched by the whole warp (called by all lanes, q
// warp-uniform): every lane evaluates one of the cdf(8 i), i = 0..31, a ballot brackets the
// slot in 8 symbols, nine lanes evaluate those, a second ballot picks the symbol. The CDF
// strictly increases (cdf(0) = 0 <= slot < cdf(256) = 2^p: any slot, corrupt payloads too),
// so this is the CPU's symbol. Two CDFs a lane instead of a lane's serial search of up to
// ~16 while the warp waits: for the misses that one neighbour did not fix (far ones:
// values where the guess's float model is poor, as NaN / inf / subnormal keys in flat
// stretches of the CDF).
template <bool TOP>
__device__ __forceinline__ void warp_search(Sym& s, int q, int slot, const Stage& st,
        int spread, const Val& v, const Model& md, int lane) {
    Val w;
    w.mub = __shfl_sync(FULL, v.mub, q);
    w.rr = __shfl_sync(FULL, v.rr, q);
    w.dl = __shfl_sync(FULL, v.dl, q);
    w.cb = __shfl_sync(FULL, v.cb, q);
    w.m = __shfl_sync(FULL, v.m, q);
    w.w = __shfl_sync(FULL, v.w, q);
    w.mu32 = __shfl_sync(FULL, v.mu32, q);
    w.big = __shfl_sync(FULL, (int)v.big, q);
#if KEY_TABLE
    w.ksc = __shfl_sync(FULL, v.ksc, q);
#endif
    const int sl = __shfl_sync(FULL, slot, q);
    Stage sq = st;
    if (!TOP) {
        sq.b = __shfl_sync(FULL, st.b, q);
        sq.sb = __shfl_sync(FULL, st.sb, q);
        sq.t = __shfl_sync(FULL, st.t, q);
        sq.e0 = __shfl_sync(FULL, st.e0, q);
        sq.de = __shfl_sync(FULL, st.de, q);
        sq.rq = __shfl_sync(FULL, st.rq, q);
    }
    const int k1 = 8 * lane;
    const int c1 = stage_c<TOP>(k1, stage_s<TOP>(k1, sq, w, md), sq, spread);
    const int base = 8 * (31 - __clz(__ballot_sync(FULL, c1 <= sl)));
    const int k2 = base + min(lane, 8);
    const unsigned s2 = stage_s<TOP>(k2, sq, w, md);
    const int c2 = stage_c<TOP>(k2, s2, sq, spread);
    const int r = 31 - __clz(__ballot_sync(FULL, c2 <= sl) & 0x1FFu);
    const int c0 = __shfl_sync(FULL, c2, r), cn = __shfl_sync(FULL, c2, r + 1);
    const unsigned sj = __shfl_sync(FULL, s2, r), sn = __shfl_sync(FULL, s2, r + 1);
    if (lane == q) { s.j = base + r; s.c0 = c0; s.c1 = cn; s.sj = sj; s.sn = sn; }
}


// The chunk a warp decodes: its stream, this lane's state and value.
struct Chain {
    const unsigned char* words;  // the payload's 16-bit words
    int n_words, wp;             // words, words read
    unsigned x;                  // this lane's rANS state
    bool live;                   // this lane has a value in the current group
    Val v;
    float muf, sgf;
};

// One decode step of a lane (live or not; dist_kernels._decode_step): guess and check the
// symbol; on a miss (WARP_SEARCH; WARP_SEARCH_TOP for a 16-bit format's top stage) try its
// neighbour, then the warp searches each lane's remaining miss, or (else) the lane searches
// alone; update x, take a word. The warp's search pays where misses are far (8-bit
// formats, in flat stretches; a 16-bit format's top byte: NaN / inf / 0 / subnormal keys),
// the lane's where they are few and near (a 16-bit format's low byte).
// The state fits 32 bits whatever the payload: x < 2^32 and a frequency f <= 2^p - 255 give
// f (x >> p) + (slot - c0) < f 2^(32 - p) < 2^32, and a word is shifted in only below 2^16.
// Returns false (warp-uniform) if some lane needs a word past the payload.
template <bool TOP>
__device__ __forceinline__ bool dec_step(Chain& c, Sym& s, const Stage& st, const Model& md,
                                         int p, int lane) {
    constexpr int sh = TOP ? ES : 0;  // keys b + j 2^sh
    const int spread = (1 << p) - 256;
    const int slot = (int)(c.x & ((1u << p) - 1));
    bool miss = false;
    if (c.live && !guess_symbol<TOP>(s, slot, st, c.v, c.muf, c.sgf, md, p)) {
        if constexpr (TOP && ES ? WARP_SEARCH_TOP : WARP_SEARCH)
            miss = !near_symbol<TOP>(s, slot, st, spread, c.v, md);
        else
            s = fast_search<TOP>(slot, s, st, spread, c.v, md);
    }
    unsigned far = __ballot_sync(FULL, miss);
    while (far) {  // warp-uniform
        warp_search<TOP>(s, __ffs(far) - 1, slot, st, spread, c.v, md, lane);
        far &= far - 1;
    }
    bool need = false;
    if (c.live) {
        c.x = (unsigned)(s.c1 - s.c0) * (c.x >> p) + (unsigned)(slot - s.c0);
        need = c.x < LB;
    }
    const unsigned bal = __ballot_sync(FULL, need);
    const int at = c.wp + __popc(bal & ((1u << lane) - 1u));
    c.wp += __popc(bal);
    if (c.wp > c.n_words) return false;
    if (need) {  // one address for both bytes (at >= 0)
        const unsigned char* wd = c.words + 2 * (unsigned)at;
        c.x = (c.x << 16) | wd[0] | ((unsigned)wd[1] << 8);
    }
    return true;
}

// Resident blocks the decoder asks ptxas for: 32 warps an SM, so at most 64 registers. The
// decoder is latency-bound: uncapped, the 16-bit formats' build takes a few more registers
// and leaves 24 warps, which lose more than the cap costs (it spills nothing).
#define DEC_BLOCKS (32 / WARPS)

// Decode chunk c0 into outb and write its status (the warp; Model and tab from the block).
// P > 0: the frame's precision p as a compile-time constant (P = p), so that the shifts,
// masks and spread it sets are immediates (a kernel parameter is re-read and rebuilt with
// uniform instructions at each use); P = 0 takes p as given. dist_decode runs P = DEFAULT_P
// where the frame has it (the other build is cold code: the hot one is as long as before).
template <int P>
__device__ __forceinline__ void decode_chunk(int c0, const unsigned char* frame,
        const i64* desc, const unsigned* mu, const unsigned* sg, const unsigned short* midx,
        int mshift, int m0, i64 n, int chunk_size, int p_arg, const Model& md,
        const unsigned* tab,
        const ChunkQueue& q, const unsigned* xpow, unsigned char* outb, int* status, int lane) {
    const int p = P ? P : p_arg;
    const WarpChunk wc0 = chunk_at(c0, n, chunk_size);
    const int c = c0, cn = wc0.cn, nbytes = cn * BYTES;
    const i64 first = wc0.first;
    const i64* d = desc + 4 * (i64)c;
    const unsigned char* pay = frame + d[0];
    const int len = (int)d[1];
    unsigned char* out = outb + first * BYTES;
    int code = 0, checked = 0;  // values [0, checked) have valid (mu, sigma)
    if (d[2] == MODE_RAW) {
        if (len != nbytes) code = ERR_RAW;
        else for (int k = lane; k < len; k += LANES) out[k] = pay[k];
    } else if (len < 4 * LANES || ((len - 4 * LANES) & 1)) {
        code = ERR_ODD;
    } else {
        Chain ch;
        const unsigned char* s = pay + 4 * lane;
        ch.x = s[0] | (s[1] << 8) | (s[2] << 16) | ((unsigned)s[3] << 24);
        if (__ballot_sync(FULL, ch.x < LB)) code = ERR_STATE;
        ch.words = pay + 4 * LANES;
        ch.n_words = (len - 4 * LANES) >> 1;
        ch.wp = 0;
        // The next group's raw (mu, sigma, model) are loaded a group ahead: they do not
        // depend on the state, and their global loads then wait behind a group's decoding
        // rather than at its start.
        unsigned nmu = 0, nsg = 0;
        int nm = m0;
        if (lane < cn) {
            nmu = mu[first + lane];
            nsg = sg[first + lane];
            if (midx) nm = midx[(first + lane) >> mshift];
        }
        for (int g0 = 0; g0 < cn && !code; g0 += LANES) {
            ch.live = g0 + lane < cn;
            // value index (the chunk re-read: nothing of it stays live through the group)
            const i64 i = chunk_at(warp_chunk_id(q), n, chunk_size).first + g0 + lane;
            bool ok = true;
            ch.muf = ch.sgf = 0.0f;
            const unsigned mub = nmu, sgb = nsg;
            const int mi = nm;
            if (g0 + LANES + lane < cn) {
                nmu = mu[i + LANES];
                nsg = sg[i + LANES];
                if (midx) nm = midx[(i + LANES) >> mshift];
            }
            if (ch.live) {
                ok = param_ok(mub, sgb);
                if (ok) {
                    ch.v = params(mub, sgb, mi, md);
                    ch.muf = __uint_as_float(mub);
                    ch.sgf = __uint_as_float((sgb + (1u << 14)) & ~0x7FFFu);  // sigma's grid
                }
            }
            if (__ballot_sync(FULL, !ok)) { checked = g0; code = ERR_PARAM; break; }
            checked = g0 + LANES;
            Sym top;
            if (!dec_step<true>(ch, top, Stage{}, md, p, lane)) {
                code = ERR_TRUNCATED;
                break;
            }
            int key = top.j;
            if (ES) {
                Sym low;
                const int b = top.j << ES;
                Stage st;  // the top symbol's bucket (Stage)
                st.b = b;
                st.sb = top.sj;
                st.t = top.sn - top.sj;
                st.rq = stage_rq(st.t, (1 << p) - 256);
                if (ch.live && ch.v.w) {
                    const int em = emp_row(ch.v.m) + top.j;
                    st.e0 = emp_w(md, em);
                    st.de = emp_w(md, em + 1) - st.e0;
                } else {
                    st.e0 = st.de = 0;
                }
                if (!dec_step<false>(ch, low, st, md, p, lane)) {
                    code = ERR_TRUNCATED;
                    break;
                }
                key = b + low.j;
            }
            if (ch.live) {
                if (BYTES == 2) reinterpret_cast<unsigned short*>(outb)[i] = bits_of(key);
                else outb[i] = bits_of(key);
            }
        }
        if (!code && ch.wp != ch.n_words) code = ERR_TRAILING;
        if (!code && __ballot_sync(FULL, ch.x != LB)) code = ERR_FINAL;
    }
    {
        // the chunk re-read (as in the group loop)
        const int c = warp_chunk_id(q);
        const WarpChunk wc = chunk_at(c, n, chunk_size);
        const int cn = wc.cn, nbytes = cn * BYTES;
        const i64 first = wc.first;
        unsigned char* out = outb + first * BYTES;
        // Every (mu, sigma) is checked, as the CPU checks them all before decoding.
        const int bad = first_bad(mu, sg, first, checked, cn, lane);
        int where = 0;
        if (bad >= 0) { code = ERR_PARAM; where = bad; }
        if (!code) {
            __syncwarp();  // the lanes' output stores are visible to the whole warp
            if (warp_crc(out, nbytes, lane, tab, xpow) != (unsigned)desc[4 * (i64)c + 3])
                code = ERR_CRC;
        }
        if (lane == 0) {
            status[2 * c] = code;
            status[2 * c + 1] = where;
        }
    }
}

// desc per chunk (i64 x 4): payload offset in frame, length, mode, CRC-32 (all checked by
// dist.py against the frame size). status per chunk (i32 x 2): code, value index in chunk.
// Model index of value i (both kernels): midx[i >> mshift] (one index per value at mshift
// 0; runs of models, as the offload hook's keys then values, one per 2^mshift values, so
// a layer needs a few entries: dist._Models), or m0 where midx is null; in range (dist.py).
extern "C" __global__ void __launch_bounds__(WARPS * 32, DEC_BLOCKS) dist_decode(
        const unsigned char* frame, const i64* desc, const unsigned* mu, const unsigned* sg,
        const unsigned short* midx, int mshift, int m0, i64 n, int chunk_size, int n_chunks,
        int p, const unsigned* shapes, const unsigned* emps, int models, const int* weights,
        const float* zinv, const i64* rtab, const unsigned* xpow, unsigned char* outb,
        int* status) {
    __shared__ unsigned tab[256];
    __shared__ ChunkQueue q;  // DYN_CHUNKS
#if DYN_CHUNKS
    // a block that starts after the last chunk was taken skips the table prologue
    if (__syncthreads_or(threadIdx.x == 0
                         && *(volatile int*)(status + 2 * n_chunks) >= n_chunks)) return;
    if (threadIdx.x == 0) q.ctr = status + 2 * n_chunks;  // before block_model's barrier
#endif
    const Model md = block_model(tab, shapes, emps, models, weights, zinv, rtab, p, true);
    const int lane = threadIdx.x & 31;
    if (p == DEFAULT_P) {  // the default precision's build (decode_chunk's P)
        for (int c = first_chunk(q, lane); c < n_chunks; c = next_chunk(q, n_chunks, lane))
            decode_chunk<DEFAULT_P>(c, frame, desc, mu, sg, midx, mshift, m0, n, chunk_size,
                                    p, md, tab, q, xpow, outb, status, lane);
    } else {
        for (int c = first_chunk(q, lane); c < n_chunks; c = next_chunk(q, n_chunks, lane))
            decode_chunk<0>(c, frame, desc, mu, sg, midx, mshift, m0, n, chunk_size, p, md,
                            tab, q, xpow, outb, status, lane);
    }
}
