/* SplitZip's CPU kernels in C: one pass over a payload's streams per range, the GIL released.
 *
 * The PyTorch reference (szformat/codec/cpu.py) needs five eager calls per slice and reaches about a quarter of a
 * memory copy; a single pass that reads ``pk`` and ``sm`` and writes BF16 cannot be written in eager PyTorch. Here:
 *
 *   decode_pairs(pk, sm, dec_lut, out)   elements 2i, 2i+1 of every pk byte i: exponent through the 16-entry
 *                                        codebook (high nibble first), sign and mantissa from sm; escapes are
 *                                        patched afterwards by the caller, as in the reference.
 *   encode_pairs(bits, enc_lut, pk, sm)  the inverse for whole pairs: an exponent without a code (enc_lut[e] ==
 *                                        16) gets nibble 0; the caller finds the escapes by decoding again.
 *   exponent_histogram(bits, counts)     counts[e] += elements of exponent byte e (int64 x 256); with AVX-512BW
 *                                        the frequent exponents counted 64 elements at a time by byte compares.
 *   mismatches(a, b, positions) -> count where two int16 arrays differ (the encoder's check finds the escapes so):
 *                                        blocks of 32 elements compared at once, the rare differing ones by element.
 *   decode_payload(payload, dec_lut, out, n_esc, chunk_size)
 *                                        a whole payload in one call: its escape streams checked (the reference's
 *                                        checks, order and messages), then pairs, the odd last element and the
 *                                        escapes written; what a small tensor costs is otherwise the Python
 *                                        around five calls.
 *   encode_payload(bits, enc_lut, payload, n_esc, chunk_size) -> escapes
 *                                        the inverse, a whole payload (escape streams and padding included) in
 *                                        one call; the caller checks it by decoding it with decode_payload.
 *   use_crc32(crc32, combine)            zlib-ng's zng_crc32 and zng_crc32_combine (their addresses) for the calls
 *                                        below, checked against a bitwise CRC-32 first.
 *   decode_range(pk, sm, dec_lut, out, positions, exponents, checksums) -> (pk_crc, sm_crc, out_crc) or None
 *                                        a range of a load with its escapes, block by block, each block's stored
 *                                        and decoded bytes checksummed while in the L1 cache when asked (with
 *                                        VPCLMULQDQ folded into the decode loop itself); pk and sm
 *                                        may be views of a file's mapping: a page the file no longer holds (it
 *                                        was truncated) or cannot be read is an EOFError, not SIGBUS.
 *   decode_payloads(items, checksums, progress, populate, threads, release) -> [(stored_crc, ...), ...]
 *                                        payloads (decode_payload's arguments each, views of a file's mapping
 *                                        too) by one call on threads of its own: per payload its escape checks,
 *                                        its decode and both CRC-32s, taken block by block as decode_range takes
 *                                        them, a payload of more than UNIT_ELEMENTS cut into ranges the threads
 *                                        share; no Python between. Outputs of ``populate`` bytes and more (0: none)
 *                                        whose first page is not in memory are faulted in by one madvise each first;
 *                                        with ``release`` each unit's pages of a read-only file mapping are
 *                                        dropped from the page tables once decoded (the close's munmap otherwise).
 *   check_payloads(items, progress, release) -> [(stored_crc, decoded_crc, error), ...]
 *                                        decode_payloads' checks and checksums of payloads given their element
 *                                        count instead of an output, on the caller's thread: each decoded a block
 *                                        at a time into one 32 KiB buffer, for a check that keeps nothing else
 *                                        (szconvert verify); ``release`` as decode_payloads'.
 *   crc32(data, crc) -> crc              zlib-ng's CRC-32 of a buffer, a page that cannot be read an EOFError too.
 *   guards_mapped_reads() -> bool        whether those two calls catch such faults on this platform.
 *   cover_mapping(view) -> slot or None  a read-only view of a file's mapping that reads as zeros from a page the
 *                                        file lost on, on any thread and in any code, instead of raising SIGBUS
 *                                        (Linux; None elsewhere or with every slot taken); covered_faults(slot) ->
 *                                        how many faults were covered, uncover_mapping(slot) before the mapping
 *                                        is closed.
 *
 * A Top-16 codebook is exactly one byte-shuffle table, so with AVX2 one ``vpshufb`` maps 32 codes to exponents;
 * the rest is shifts, masks and an interleave with the sm bytes. The AVX2 path is chosen at run time
 * (``__builtin_cpu_supports``); on AArch64 the NEON kernels of _neon.h run (``tbl``, every such CPU has it);
 * elsewhere a portable loop over a 256-entry pair table runs. Every path is tested bit for bit against the PyTorch
 * reference (NEON's under an emulator: tests/codec/test_neon.py).
 *
 * Buffers are anything with the buffer protocol (NumPy arrays, memoryviews of tensors); lengths are checked here.
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#if defined(__unix__) || defined(__APPLE__)
#define SZ_GUARD 1
#include <pthread.h>
#include <setjmp.h>
#include <signal.h>
#endif

#if defined(__linux__)
#define SZ_POPULATE 1
#include <sys/mman.h>
#include <unistd.h>
#endif

#if defined(SZ_GUARD) && defined(__linux__)
#define SZ_COVER 1
#endif

#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
#define SZ_X86 1
#include <cpuid.h>
#include <immintrin.h>
#endif

#if defined(__aarch64__) && defined(__ARM_NEON)
#define SZ_NEON 1
#include "_neon.h"
#endif

/* ---------------------------------------------------------------------------------------------------------------
 * Decode
 * ------------------------------------------------------------------------------------------------------------- */

/* The sign and mantissa fields of an sm byte, in place in a BF16 element: sign to bit 15, mantissa bits 0-6. */
static inline uint32_t sm_field(uint8_t s) { return ((uint32_t)(s & 0x80) << 8) | (s & 0x7F); }

static void decode_scalar(const uint8_t *pk, const uint8_t *sm, const uint8_t *lut, uint16_t *out, Py_ssize_t n_pairs)
{
    uint32_t pair[256], field[256];
    for (int b = 0; b < 256; b++) {
        pair[b] = ((uint32_t)lut[b >> 4] << 7) | ((uint32_t)lut[b & 0xF] << 23);
        field[b] = sm_field((uint8_t)b);
    }
    for (Py_ssize_t i = 0; i < n_pairs; i++) {
        uint32_t word = pair[pk[i]] | field[sm[2 * i]] | (field[sm[2 * i + 1]] << 16);
        memcpy(out + 2 * i, &word, 4); /* little-endian host: element 2i in the low half */
    }
}

#ifdef SZ_X86
/* 16 pk bytes and 32 sm bytes: elements 0-15 into ``first``, 16-31 into ``second``. */
__attribute__((target("avx2")))
static inline void decode_32(__m256i table, __m128i packed, __m256i s, __m256i *first, __m256i *second)
{
    const __m128i nibble = _mm_set1_epi8(0x0F);
    const __m256i low7 = _mm256_set1_epi8(0x7F), high1 = _mm256_set1_epi8((char)0x80);
    __m128i hi = _mm_and_si128(_mm_srli_epi16(packed, 4), nibble), lo = _mm_and_si128(packed, nibble);
    __m256i codes = _mm256_set_m128i(_mm_unpackhi_epi8(hi, lo), _mm_unpacklo_epi8(hi, lo)); /* element order */
    __m256i exps = _mm256_shuffle_epi8(table, codes);
    /* low byte: exponent bit 0 -> bit 7, mantissa; high byte: sign, exponent bits 1-7 -> bits 0-6 */
    __m256i low = _mm256_or_si256(_mm256_and_si256(s, low7), _mm256_and_si256(_mm256_slli_epi16(exps, 7), high1));
    __m256i high = _mm256_or_si256(_mm256_and_si256(s, high1), _mm256_and_si256(_mm256_srli_epi16(exps, 1), low7));
    __m256i a = _mm256_unpacklo_epi8(low, high), b = _mm256_unpackhi_epi8(low, high);
    *first = _mm256_permute2x128_si256(a, b, 0x20);
    *second = _mm256_permute2x128_si256(a, b, 0x31);
}

__attribute__((target("avx2")))
static void decode_avx2(const uint8_t *pk, const uint8_t *sm, const uint8_t *lut, uint16_t *out, Py_ssize_t n_pairs)
{
    const __m256i table = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)lut));
    Py_ssize_t i = 0;
    for (; i + 16 <= n_pairs; i += 16) { /* 16 pk bytes: 32 elements */
        __m256i first, second;
        decode_32(table, _mm_loadu_si128((const __m128i *)(pk + i)), _mm256_loadu_si256((const __m256i *)(sm + 2 * i)),
                  &first, &second);
        _mm256_storeu_si256((__m256i *)(out + 2 * i), first);
        _mm256_storeu_si256((__m256i *)(out + 2 * i + 16), second);
    }
    if (i < n_pairs)
        decode_scalar(pk + i, sm + 2 * i, lut, out + 2 * i, n_pairs - i);
}
#endif

/* Whether the AVX2 kernels run: the CPU has AVX2, and SZFORMAT_CPU_ISA does not ask for the portable loops (which
 * every CPU without AVX2 runs, and the tests run on every CPU through it). */
static int have_avx2(void)
{
#ifdef SZ_X86
    static int cached = -1;
    if (cached < 0) {
        const char *isa = getenv("SZFORMAT_CPU_ISA");
        __builtin_cpu_init();
        cached = __builtin_cpu_supports("avx2") && !(isa && strcmp(isa, "scalar") == 0) ? 1 : 0;
    }
    return cached;
#else
    return 0;
#endif
}

/* Whether the AVX-512BW exponent histogram runs: the CPU (and the OS, which the builtin checks) has AVX-512F and
 * BW, and SZFORMAT_CPU_ISA asks for neither the portable loops nor AVX2 alone. */
static int have_avx512bw(void)
{
#if defined(SZ_X86) && defined(__x86_64__)
    static int cached = -1;
    if (cached < 0) {
        const char *isa = getenv("SZFORMAT_CPU_ISA");
        int capped = isa && (strcmp(isa, "scalar") == 0 || strcmp(isa, "avx2") == 0);
        __builtin_cpu_init();
        cached = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && !capped ? 1 : 0;
    }
    return cached;
#else
    return 0;
#endif
}

/* ---------------------------------------------------------------------------------------------------------------
 * Encode and histogram
 * ------------------------------------------------------------------------------------------------------------- */

/* An element's 4-bit code (an escape's 16 gives nibble 0) and its sm byte, (sign << 7) | mantissa. */
static inline uint8_t code_nibble(uint16_t x, const uint8_t *enc) { return enc[(x >> 7) & 0xFF] & 0xF; }
static inline uint8_t sm_byte(uint16_t x) { return (uint8_t)(((x >> 8) & 0x80) | (x & 0x7F)); }

static void encode_scalar(const uint16_t *bits, const uint8_t *enc, uint8_t *pk, uint8_t *sm, Py_ssize_t n_pairs)
{
    for (Py_ssize_t i = 0; i < n_pairs; i++) {
        uint16_t x0 = bits[2 * i], x1 = bits[2 * i + 1];
        pk[i] = (uint8_t)(code_nibble(x0, enc) << 4 | code_nibble(x1, enc));
        sm[2 * i] = sm_byte(x0);
        sm[2 * i + 1] = sm_byte(x1);
    }
}

#ifdef SZ_X86
/* 32 elements at a time. The exponent byte e of each element is looked up in the 256-entry code table as 16 rows of
 * 16 (row e >> 4, column e & 15): one vpshufb per row the codebook uses (most codebooks span two or three rows), the
 * other rows giving the escape code; pairs of codes are then packed into pk bytes with one multiply-add. */
__attribute__((target("avx2")))
static void encode_avx2(const uint16_t *bits, const uint8_t *enc, uint8_t *pk, uint8_t *sm, Py_ssize_t n_pairs)
{
    __m256i rows[16];
    int used[16], n_rows = 0;
    for (int h = 0; h < 16; h++) {
        int any = 0;
        for (int l = 0; l < 16; l++)
            any |= enc[16 * h + l] != 16;
        if (any) {
            rows[n_rows] = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(enc + 16 * h)));
            used[n_rows++] = h;
        }
    }
    const __m256i low_nibble = _mm256_set1_epi8(0x0F), escape = _mm256_set1_epi8(16);
    const __m256i byte_mask = _mm256_set1_epi16(0x00FF), sign = _mm256_set1_epi16(0x0080);
    const __m256i mantissa = _mm256_set1_epi16(0x007F), weights = _mm256_set1_epi16(0x0110); /* c0 * 16 + c1 */
    Py_ssize_t i = 0;
    for (; i + 16 <= n_pairs; i += 16) {
        __m256i x0 = _mm256_loadu_si256((const __m256i *)(bits + 2 * i));
        __m256i x1 = _mm256_loadu_si256((const __m256i *)(bits + 2 * i + 16));
        /* exponent bytes and sm bytes, 16-bit lanes packed to bytes in element order */
        __m256i e = _mm256_permute4x64_epi64(_mm256_packus_epi16(_mm256_and_si256(_mm256_srli_epi16(x0, 7), byte_mask),
                                                                 _mm256_and_si256(_mm256_srli_epi16(x1, 7), byte_mask)),
                                             0xD8);
        __m256i s0 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(x0, 8), sign), _mm256_and_si256(x0, mantissa));
        __m256i s1 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(x1, 8), sign), _mm256_and_si256(x1, mantissa));
        _mm256_storeu_si256((__m256i *)(sm + 2 * i), _mm256_permute4x64_epi64(_mm256_packus_epi16(s0, s1), 0xD8));
        __m256i row = _mm256_and_si256(_mm256_srli_epi16(e, 4), low_nibble), column = _mm256_and_si256(e, low_nibble);
        __m256i code = escape;
        for (int r = 0; r < n_rows; r++)
            code = _mm256_blendv_epi8(code, _mm256_shuffle_epi8(rows[r], column),
                                      _mm256_cmpeq_epi8(row, _mm256_set1_epi8((char)used[r])));
        __m256i pairs = _mm256_maddubs_epi16(_mm256_and_si256(code, low_nibble), weights); /* escape: 16 -> 0 */
        __m128i packed = _mm_packus_epi16(_mm256_castsi256_si128(pairs), _mm256_extracti128_si256(pairs, 1));
        _mm_storeu_si128((__m128i *)(pk + i), packed);
    }
    if (i < n_pairs)
        encode_scalar(bits + 2 * i, enc, pk + i, sm + 2 * i, n_pairs - i);
}
#endif

/* Whether the NEON kernels run: on AArch64, unless SZFORMAT_CPU_ISA asks for the portable loops. */
static int have_neon(void)
{
#ifdef SZ_NEON
    static int cached = -1;
    if (cached < 0) {
        const char *isa = getenv("SZFORMAT_CPU_ISA");
        cached = !(isa && strcmp(isa, "scalar") == 0);
    }
    return cached;
#else
    return 0;
#endif
}

/* The kernels as the bindings call them: AVX2 or NEON where have_avx2() or have_neon() says so, the portable loops
 * elsewhere (and for the pairs past NEON's last whole block). */
static void decode(const uint8_t *pk, const uint8_t *sm, const uint8_t *lut, uint16_t *out, Py_ssize_t n_pairs)
{
#ifdef SZ_X86
    if (have_avx2()) {
        decode_avx2(pk, sm, lut, out, n_pairs);
        return;
    }
#endif
#ifdef SZ_NEON
    if (have_neon()) {
        Py_ssize_t done = sz_decode_neon(pk, sm, lut, out, n_pairs);
        pk += done, sm += 2 * done, out += 2 * done, n_pairs -= done;
    }
#endif
    decode_scalar(pk, sm, lut, out, n_pairs);
}

/* Elements [0, n) from (n + 1) / 2 pk bytes and n sm bytes: whole pairs, then an odd count's last element (the high
 * nibble of its pk byte). Escapes are left to the caller. */
static void decode_elements(const uint8_t *pk, const uint8_t *sm, const uint8_t *lut, uint16_t *out, Py_ssize_t n)
{
    decode(pk, sm, lut, out, n / 2);
    if (n % 2)
        out[n - 1] = (uint16_t)(sm_field(sm[n - 1]) | (uint32_t)lut[pk[n / 2] >> 4] << 7);
}

/* An element whose exponent was an escape: the raw exponent byte in place of the codebook's, sign and mantissa kept. */
static inline uint16_t with_exponent(uint16_t element, uint8_t exponent)
{
    return (uint16_t)((element & 0x807F) | (uint32_t)exponent << 7);
}

/* Escapes k, k + 1, ... (ascending positions) below ``end`` patched in ``out``, which holds the elements from
 * ``first`` on; the index of the first one left. */
static inline Py_ssize_t patch_escapes(uint16_t *out, int64_t first, const int64_t *positions,
                                       const uint8_t *exponents, Py_ssize_t n_esc, Py_ssize_t k, int64_t end)
{
    for (; k < n_esc && positions[k] < end; k++)
        out[positions[k] - first] = with_exponent(out[positions[k] - first], exponents[k]);
    return k;
}

static void encode(const uint16_t *bits, const uint8_t *enc, uint8_t *pk, uint8_t *sm, Py_ssize_t n_pairs)
{
#ifdef SZ_X86
    if (have_avx2()) {
        encode_avx2(bits, enc, pk, sm, n_pairs);
        return;
    }
#endif
#ifdef SZ_NEON
    if (have_neon()) {
        Py_ssize_t done = sz_encode_neon(bits, enc, pk, sm, n_pairs);
        bits += 2 * done, pk += done, sm += 2 * done, n_pairs -= done;
    }
#endif
    encode_scalar(bits, enc, pk, sm, n_pairs);
}

static void histogram_scalar(const uint16_t *bits, Py_ssize_t n, int64_t *counts)
{
    /* four partial histograms: consecutive equal exponents (the common case) would otherwise serialize on one
       counter's store-to-load forwarding */
    uint32_t part[4][256];
    memset(part, 0, sizeof part);
    Py_ssize_t i = 0;
    while (i < n) {
        Py_ssize_t stop = n - i > ((Py_ssize_t)1 << 30) ? i + ((Py_ssize_t)1 << 30) : n; /* no 32-bit overflow */
        for (; i + 4 <= stop; i += 4) {
            part[0][(bits[i] >> 7) & 0xFF]++;
            part[1][(bits[i + 1] >> 7) & 0xFF]++;
            part[2][(bits[i + 2] >> 7) & 0xFF]++;
            part[3][(bits[i + 3] >> 7) & 0xFF]++;
        }
        for (; i < stop; i++)
            part[0][(bits[i] >> 7) & 0xFF]++;
        for (int e = 0; e < 256; e++) {
            counts[e] += (int64_t)part[0][e] + part[1][e] + part[2][e] + part[3][e];
            part[0][e] = part[1][e] = part[2][e] = part[3][e] = 0;
        }
    }
}

#if defined(SZ_X86) && defined(__x86_64__) /* 64-bit masks */
#define SZ_HISTOGRAM_AVX512 1
#define HISTOGRAM_SAMPLE 65536 /* elements whose exponents choose the ones counted by compares */
#define HISTOGRAM_BLOCK 65536  /* elements between checks that those still cover nearly all the rest */

/* The exponent histogram with AVX-512BW. A weight's exponents cluster on a few values, so the (at most) 16 most
 * frequent among its first HISTOGRAM_SAMPLE elements are counted 64 elements at a time, one byte compare and one
 * popcount each, and only the elements outside them one by one; a block where those are more than 1/16 hands the
 * rest to the four tables, so no tensor runs much slower than there. The counts are exact whatever was chosen. On
 * weights 0.26 against 0.75 ns per element in cache on the build VM, 0.43 against 0.88 from memory. */
__attribute__((target("avx512f,avx512bw,popcnt")))
static void histogram_avx512(const uint16_t *bits, Py_ssize_t n, int64_t *counts)
{
    Py_ssize_t head = n < HISTOGRAM_SAMPLE ? n : HISTOGRAM_SAMPLE;
    int64_t sample[256] = {0};
    histogram_scalar(bits, head, sample);
    for (int e = 0; e < 256; e++)
        counts[e] += sample[e];
    uint8_t chosen[16];
    int k = 0;
    for (; k < 16; k++) { /* the most frequent first; any choice gives exact counts */
        int best = -1;
        for (int e = 0; e < 256; e++)
            if (sample[e] > 0 && (best < 0 || sample[e] > sample[best]))
                best = e;
        if (best < 0)
            break;
        chosen[k] = (uint8_t)best;
        sample[best] = 0;
    }
    __m512i wanted[16];
    uint64_t hits[16] = {0};
    for (int j = 0; j < k; j++)
        wanted[j] = _mm512_set1_epi8((char)chosen[j]);
    Py_ssize_t i = head, vector_end = head + (n - head) / 64 * 64;
    while (i < vector_end) {
        Py_ssize_t stop = vector_end - i > HISTOGRAM_BLOCK ? i + HISTOGRAM_BLOCK : vector_end, missed = 0;
        for (; i < stop; i += 64) {
            __m512i a = _mm512_srli_epi16(_mm512_loadu_si512(bits + i), 7);
            __m512i b = _mm512_srli_epi16(_mm512_loadu_si512(bits + i + 32), 7);
            __m512i exponents = _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtepi16_epi8(a)),
                                                   _mm512_cvtepi16_epi8(b), 1); /* the low byte of bits >> 7 */
            uint64_t any = 0;
            for (int j = 0; j < k; j++) {
                uint64_t match = _mm512_cmpeq_epi8_mask(exponents, wanted[j]);
                hits[j] += (uint64_t)__builtin_popcountll(match);
                any |= match;
            }
            for (uint64_t rest = ~any; rest; rest &= rest - 1, missed++)
                counts[(bits[i + __builtin_ctzll(rest)] >> 7) & 0xFF]++;
        }
        if (missed > HISTOGRAM_BLOCK / 16)
            break; /* these exponents are not clustered: the four tables count the rest */
    }
    histogram_scalar(bits + i, n - i, counts);
    for (int j = 0; j < k; j++)
        counts[chosen[j]] += (int64_t)hits[j];
}
#endif

static Py_ssize_t mismatches(const uint16_t *a, const uint16_t *b, Py_ssize_t n, int64_t *positions)
{
    Py_ssize_t count = 0, i = 0;
    for (; i + 32 <= n; i += 32) {
        if (memcmp(a + i, b + i, 64) == 0)
            continue;
        for (Py_ssize_t j = i; j < i + 32; j++)
            if (a[j] != b[j])
                positions[count++] = j;
    }
    for (; i < n; i++)
        if (a[i] != b[i])
            positions[count++] = i;
    return count;
}

/* Where the streams of a payload of ``n`` elements and ``n_esc`` escapes start (szformat/codec/layout.py). */
typedef struct {
    Py_ssize_t sm, cid, lpos, ev, end;
} Offsets;

static Py_ssize_t align4(Py_ssize_t x) { return (x + 3) & ~(Py_ssize_t)3; }

static Offsets offsets_of(Py_ssize_t n, Py_ssize_t n_esc)
{
    Offsets o;
    o.sm = align4((n + 1) / 2);
    o.cid = align4(o.sm + n);
    o.lpos = o.cid + 4 * n_esc;
    o.ev = align4(o.lpos + 2 * n_esc);
    o.end = o.ev + n_esc;
    return o;
}

/* Escape k's chunk id (int32) and local position (u16), little-endian, read byte by byte (any alignment). */
static void escape_at(const uint8_t *payload, Offsets o, Py_ssize_t k, int64_t *chunk, int64_t *local)
{
    const uint8_t *c = payload + o.cid + 4 * k, *l = payload + o.lpos + 2 * k;
    *chunk = (int32_t)((uint32_t)c[0] | (uint32_t)c[1] << 8 | (uint32_t)c[2] << 16 | (uint32_t)c[3] << 24);
    *local = (uint32_t)l[0] | (uint32_t)l[1] << 8;
}

/* The escape streams' checks of the reference (``_validated_escapes``), in its order, so a stream that breaks
 * several rules gets the same message: local positions, chunk ids, positions, order. Returns NULL when they hold,
 * else the message (written into ``message``). */
static const char *check_escapes(const uint8_t *payload, Offsets o, Py_ssize_t n_esc, Py_ssize_t n,
                                 Py_ssize_t chunk_size, char *message, size_t size)
{
    if (n_esc == 0)
        return NULL;
    Py_ssize_t n_chunks = (n + chunk_size - 1) / chunk_size;
    int64_t max_local = 0, min_chunk = INT32_MAX, max_chunk = INT32_MIN, max_position = INT64_MIN, previous = -1;
    int ascending = 1;
    for (Py_ssize_t k = 0; k < n_esc; k++) {
        int64_t chunk, local;
        escape_at(payload, o, k, &chunk, &local);
        int64_t position = chunk * chunk_size + local;
        max_local = local > max_local ? local : max_local;
        min_chunk = chunk < min_chunk ? chunk : min_chunk;
        max_chunk = chunk > max_chunk ? chunk : max_chunk;
        max_position = position > max_position ? position : max_position;
        if (k && position <= previous)
            ascending = 0;
        previous = position;
    }
    if (max_local >= chunk_size)
        snprintf(message, size, "escape local position %lld is outside its chunk of %zd", (long long)max_local,
                 chunk_size);
    else if (min_chunk < 0 || max_chunk >= n_chunks)
        snprintf(message, size, "escape chunk id out of range 0..%zd", n_chunks - 1);
    else if (max_position >= n)
        snprintf(message, size, "escape position %lld is past the tensor's %zd elements", (long long)max_position, n);
    else if (!ascending)
        snprintf(message, size, "escape positions are not strictly ascending");
    else
        return NULL;
    return message;
}

/* Every element of a payload whose escapes were checked: whole pairs, the odd last element, then each escape's
 * raw exponent in place of the code's (sign and mantissa are right already). */
static void decode_whole(const uint8_t *payload, Offsets o, const uint8_t *lut, uint16_t *out, Py_ssize_t n,
                         Py_ssize_t n_esc, Py_ssize_t chunk_size)
{
    decode_elements(payload, payload + o.sm, lut, out, n);
    for (Py_ssize_t k = 0; k < n_esc; k++) {
        int64_t chunk, local;
        escape_at(payload, o, k, &chunk, &local);
        int64_t position = chunk * chunk_size + local;
        out[position] = with_exponent(out[position], payload[o.ev + k]);
    }
}

/* ---------------------------------------------------------------------------------------------------------------
 * A range decoded with its checksums
 * ------------------------------------------------------------------------------------------------------------- */

/* zlib-ng's CRC-32 (``zng_crc32``, the one ``szformat.checksum`` calls), handed over by ``use_crc32``: a load's
 * checksums are taken block by block inside the decode, while each block is in the L1 cache, instead of in passes
 * over ranges that have left it (which cost as much as the decode). NULL until it is handed over. */
typedef uint32_t (*crc32_function)(uint32_t crc, const uint8_t *buf, uint32_t len);
static crc32_function crc32_of = NULL;

/* zlib-ng's ``zng_crc32_combine``: the CRC-32 of a + b from those of a and b and b's length, so a payload's stored
 * CRC-32 can be taken stream by stream inside the decode. Handed over with crc32_of. */
typedef uint32_t (*crc32_combine_function)(uint32_t crc_a, uint32_t crc_b, int64_t length_b);
static crc32_combine_function crc32_joined = NULL;

/* CRC-32 bit by bit: only to check the function ``use_crc32`` is handed before trusting it. */
static uint32_t crc32_bitwise(uint32_t crc, const uint8_t *buf, size_t len)
{
    crc = ~crc;
    for (size_t i = 0; i < len; i++) {
        crc ^= buf[i];
        for (int k = 0; k < 8; k++)
            crc = (crc >> 1) ^ (0xEDB88320u & (0u - (crc & 1u)));
    }
    return ~crc;
}

/* ---------------------------------------------------------------------------------------------------------------
 * A range decoded with its CRC-32s folded in (AVX-512 and VPCLMULQDQ)
 *
 * zlib-ng's CRC-32 runs at the rate of this CPU's carry-less multiplies; called block by block after the decode, it
 * adds its whole time to the decode's. Folded into the decode loop, the multiplies run while the loop waits on
 * memory: each stream's bytes are carried forward as 512-bit (pk: 256-bit) accumulators, x^d mod P at a time, and
 * only the last 16 bytes and the range's tail go through zlib-ng. A CRC-32 is linear, so the register's initial
 * ~0 is XORed into a stream's first four bytes and the rest is taken with a zero register.
 * ------------------------------------------------------------------------------------------------------------- */

#if defined(SZ_X86) && defined(__x86_64__) && (defined(__clang__) ? __clang_major__ >= 8 : __GNUC__ >= 8)
#define SZ_FOLDED_CRC 1
#define FOLD_TARGET __attribute__((target("avx2,avx512f,avx512bw,avx512vl,vpclmulqdq,pclmul")))

/* Whether decode_range folds its CRC-32s: AVX-512 (F, BW, VL) and VPCLMULQDQ, unless SZFORMAT_CPU_ISA caps the
 * kernels below it ("avx512bw" keeps the zlib-ng calls, so the tests run both on one CPU). */
static int have_folded_crc(void)
{
    static int cached = -1;
    if (cached < 0) {
        const char *isa = getenv("SZFORMAT_CPU_ISA");
        unsigned int a, b, c, d;
        int cpu = __get_cpuid_count(7, 0, &a, &b, &c, &d) && (b & (1u << 31)) && (c & (1u << 10)); /* VL, VPCLMULQDQ */
        cached = have_avx512bw() && cpu && !(isa && strcmp(isa, "avx512bw") == 0) ? 1 : 0;
    }
    return cached;
}

/* x^n mod P, P CRC-32's polynomial, bit-reflected as zlib's CRC-32 holds its register: bit i the coefficient of
 * x^(31 - i). Multiplying by x shifts right; the x^32 that leaves is P's lower terms. */
static uint32_t x_power_mod_p(int n)
{
    uint32_t v = 0x80000000u;
    while (n-- > 0)
        v = (v >> 1) ^ (0xEDB88320u & (0u - (v & 1u)));
    return v;
}

/* Multipliers that carry 16 bytes of a stream ``distance`` bits further on, one per 64-bit half: the first half
 * (the higher powers in a reflected stream) by x^(distance + 64), the second by x^distance, each a power less for
 * the x that a carry-less product of two reflected operands gains, in the upper 32 bits of a reflected 64-bit lane.
 * Filled by use_crc32 (under the GIL, before any decode): distances 128, 256, 384, 512 and 1024 bits. */
enum { BY_128, BY_256, BY_384, BY_512, BY_1024, FOLD_DISTANCES };
static uint64_t fold_multipliers[FOLD_DISTANCES][2];

static void fill_fold_multipliers(void)
{
    static const int distances[FOLD_DISTANCES] = {128, 256, 384, 512, 1024};
    for (int i = 0; i < FOLD_DISTANCES; i++) {
        fold_multipliers[i][0] = (uint64_t)x_power_mod_p(distances[i] + 63) << 32;
        fold_multipliers[i][1] = (uint64_t)x_power_mod_p(distances[i] - 1) << 32;
    }
}

FOLD_TARGET static inline __m128i multipliers_128(int distance)
{
    return _mm_loadu_si128((const __m128i *)fold_multipliers[distance]);
}

FOLD_TARGET static inline __m128i fold_128(__m128i acc, __m128i k, __m128i data)
{
    return _mm_ternarylogic_epi64(_mm_clmulepi64_si128(acc, k, 0x00), _mm_clmulepi64_si128(acc, k, 0x11), data, 0x96);
}

FOLD_TARGET static inline __m256i fold_256(__m256i acc, __m256i k, __m256i data)
{
    return _mm256_ternarylogic_epi64(_mm256_clmulepi64_epi128(acc, k, 0x00), _mm256_clmulepi64_epi128(acc, k, 0x11),
                                     data, 0x96);
}

FOLD_TARGET static inline __m512i fold_512(__m512i acc, __m512i k, __m512i data)
{
    return _mm512_ternarylogic_epi64(_mm512_clmulepi64_epi128(acc, k, 0x00), _mm512_clmulepi64_epi128(acc, k, 0x11),
                                     data, 0x96);
}

/* The CRC-32 of a stream whose bytes up to ``tail`` were folded into ``acc`` (its last 16 bytes' worth, the earlier
 * ones carried into it), then ``tail``'s ``len`` bytes. */
static uint32_t crc_after_fold(__m128i acc, const uint8_t *tail, Py_ssize_t len)
{
    uint8_t last[16];
    memcpy(last, &acc, 16);
    uint32_t crc = crc32_of(0xFFFFFFFFu, last, 16); /* a zero register: the initial ~0 is in the first bytes */
    return len > 0 ? crc32_of(crc, tail, (uint32_t)len) : crc;
}

FOLD_TARGET static inline __m128i folded_512(__m512i acc)
{
    __m128i v = _mm512_extracti32x4_epi32(acc, 3);
    v = fold_128(_mm512_extracti32x4_epi32(acc, 2), multipliers_128(BY_128), v);
    v = fold_128(_mm512_extracti32x4_epi32(acc, 1), multipliers_128(BY_256), v);
    return fold_128(_mm512_castsi512_si128(acc), multipliers_128(BY_384), v);
}

/* Elements [64 i, 64 i + 64) of decode_range_folded: decoded and stored; returned as its 128 output bytes. */
FOLD_TARGET static inline void decode_64(__m256i table, __m256i packed, __m512i s, uint16_t *out, __m512i *lo,
                                         __m512i *hi)
{
    __m256i o0, o1, o2, o3;
    decode_32(table, _mm256_castsi256_si128(packed), _mm512_castsi512_si256(s), &o0, &o1);
    decode_32(table, _mm256_extracti128_si256(packed, 1), _mm512_extracti64x4_epi64(s, 1), &o2, &o3);
    *lo = _mm512_inserti64x4(_mm512_castsi256_si512(o0), o1, 1);
    *hi = _mm512_inserti64x4(_mm512_castsi256_si512(o2), o3, 1);
    _mm512_storeu_si512(out, *lo);
    _mm512_storeu_si512(out + 32, *hi);
}

/* decode_range with its checksums, for n >= 64: 64 elements at a time (32 pk bytes, 64 sm bytes, 128 output bytes,
 * the output's two 64-byte halves folded into accumulators of their own), escapes patched in the output before its
 * bytes are folded; the last n % 64 elements by decode and zlib-ng. */
FOLD_TARGET
static void decode_range_folded(const uint8_t *pk, const uint8_t *sm, const uint8_t *lut, uint16_t *out, int scratch,
                                Py_ssize_t n, const int64_t *positions, const uint8_t *exponents, Py_ssize_t n_esc,
                                uint32_t *crcs)
{
    const __m256i table = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)lut));
    const __m512i by_512 = _mm512_broadcast_i32x4(multipliers_128(BY_512));
    const __m512i by_1024 = _mm512_broadcast_i32x4(multipliers_128(BY_1024));
    const __m256i by_256 = _mm256_broadcastsi128_si256(multipliers_128(BY_256));
    const __m512i register_init = _mm512_maskz_set1_epi32(1, -1); /* ~0 into a stream's first four bytes */
    Py_ssize_t blocks = n / 64, k = 0;
    __m256i pk_acc = _mm256_setzero_si256();
    __m512i sm_acc = _mm512_setzero_si512(), out_lo = sm_acc, out_hi = sm_acc;
    for (Py_ssize_t i = 0; i < blocks; i++) {
        __m256i packed = _mm256_loadu_si256((const __m256i *)(pk + 32 * i));
        __m512i s = _mm512_loadu_si512(sm + 64 * i), lo, hi;
        uint16_t *block_out = scratch ? out : out + 64 * i;
        decode_64(table, packed, s, block_out, &lo, &hi);
        Py_ssize_t patched = k;
        k = patch_escapes(block_out, 64 * i, positions, exponents, n_esc, k, 64 * (i + 1));
        if (k != patched) { /* the block's output as patched, for its CRC-32 */
            lo = _mm512_loadu_si512(block_out);
            hi = _mm512_loadu_si512(block_out + 32);
        }
        if (i == 0) {
            pk_acc = _mm256_xor_si256(packed, _mm512_castsi512_si256(register_init));
            sm_acc = _mm512_xor_si512(s, register_init);
            out_lo = _mm512_xor_si512(lo, register_init);
            out_hi = hi;
        } else {
            pk_acc = fold_256(pk_acc, by_256, packed);
            sm_acc = fold_512(sm_acc, by_512, s);
            out_lo = fold_512(out_lo, by_1024, lo);
            out_hi = fold_512(out_hi, by_1024, hi);
        }
    }
    Py_ssize_t done = 64 * blocks, rest = n - done;
    uint16_t *tail_out = scratch ? out : out + done;
    decode_elements(pk + done / 2, sm + done, lut, tail_out, rest);
    patch_escapes(tail_out, done, positions, exponents, n_esc, k, n);
    __m128i pk_last = fold_128(_mm256_castsi256_si128(pk_acc), multipliers_128(BY_128),
                               _mm256_extracti128_si256(pk_acc, 1));
    crcs[0] = crc_after_fold(pk_last, pk + done / 2, (n + 1) / 2 - done / 2);
    crcs[1] = crc_after_fold(folded_512(sm_acc), sm + done, rest);
    crcs[2] = crc_after_fold(folded_512(fold_512(out_lo, by_512, out_hi)), (const uint8_t *)tail_out, 2 * rest);
}
#endif

/* Pairs per block of decode_range: 8 KiB of pk, 16 KiB of sm and 32 KiB out, so each block's checksums
 * read it from the L1 or L2 cache right after the decode touched it. */
#define CHECKED_BLOCK_PAIRS 8192
#define CHECKED_BLOCK_ELEMENTS (2 * CHECKED_BLOCK_PAIRS)

/* Elements [0, n) of a range that starts at an even element: pk holds (n + 1) / 2 bytes, sm n bytes; ``positions``
 * (ascending, inside [0, n), checked by the caller) and ``exponents`` are the range's escapes. Block by block: the
 * pk and sm bytes' CRC-32s taken (when ``crcs`` is not NULL), the block decoded, its escapes patched, its output's
 * CRC-32 taken. With ``scratch`` every block is decoded at the start of ``out`` (CHECKED_BLOCK_ELEMENTS long), for a
 * check that keeps only the checksums: the output never leaves the cache and takes no fresh pages. */
static void decode_range(const uint8_t *pk, const uint8_t *sm, const uint8_t *lut, uint16_t *out, int scratch,
                         Py_ssize_t n, const int64_t *positions, const uint8_t *exponents, Py_ssize_t n_esc,
                         uint32_t *crcs)
{
#ifdef SZ_FOLDED_CRC
    if (crcs != NULL && n >= 64 && have_folded_crc()) {
        decode_range_folded(pk, sm, lut, out, scratch, n, positions, exponents, n_esc, crcs);
        return;
    }
#endif
    uint32_t pk_crc = 0, sm_crc = 0, out_crc = 0;
    Py_ssize_t k = 0;
    for (Py_ssize_t first = 0; first < n; first += CHECKED_BLOCK_ELEMENTS) {
        Py_ssize_t count = n - first < CHECKED_BLOCK_ELEMENTS ? n - first : CHECKED_BLOCK_ELEMENTS;
        const uint8_t *block_pk = pk + first / 2, *block_sm = sm + first;
        uint16_t *block_out = scratch ? out : out + first;
        if (crcs != NULL) {
            pk_crc = crc32_of(pk_crc, block_pk, (uint32_t)((count + 1) / 2));
            sm_crc = crc32_of(sm_crc, block_sm, (uint32_t)count);
        }
        decode_elements(block_pk, block_sm, lut, block_out, count);
        k = patch_escapes(block_out, first, positions, exponents, n_esc, k, first + count);
        if (crcs != NULL)
            out_crc = crc32_of(out_crc, (const uint8_t *)block_out, (uint32_t)(2 * count));
    }
    if (crcs != NULL) {
        crcs[0] = pk_crc;
        crcs[1] = sm_crc;
        crcs[2] = out_crc;
    }
}

/* Columns [first, last) of rows of ``width`` elements (all three even, so each row's piece is whole pairs) from the
 * rows' ``pk`` and ``sm`` bytes into ``out``, the kept columns row after row: a row-parallel shard of a matrix, the
 * other columns never decoded. The escapes at ``positions`` (ascending, counted from the first row) are patched where
 * their column is kept. */
static void decode_columns(const uint8_t *pk, const uint8_t *sm, const uint8_t *lut, uint16_t *out, Py_ssize_t n_rows,
                           Py_ssize_t width, Py_ssize_t first, Py_ssize_t last, const int64_t *positions,
                           const uint8_t *exponents, Py_ssize_t n_esc)
{
    Py_ssize_t kept = last - first;
    for (Py_ssize_t r = 0; r < n_rows; r++)
        decode(pk + r * (width / 2) + first / 2, sm + r * width + first, lut, out + r * kept, kept / 2);
    for (Py_ssize_t k = 0; k < n_esc; k++) {
        Py_ssize_t row = (Py_ssize_t)(positions[k] / width), column = (Py_ssize_t)(positions[k] % width);
        if (column >= first && column < last) {
            uint16_t *value = out + row * kept + (column - first);
            *value = with_exponent(*value, exponents[k]);
        }
    }
}

/* ---------------------------------------------------------------------------------------------------------------
 * Reads through a file's mapping
 *
 * Reading a mapped page the file no longer holds (another process truncated it) or that the disk cannot deliver
 * raises SIGBUS, which ends the process. Copying the bytes out with pread first avoids that, at the price of a
 * copy that costs a load a sixth of its time. Instead, decode_range runs with a SIGBUS handler of this module
 * installed: a fault on a thread inside a guarded call jumps back out of it (siglongjmp) and the call raises
 * EOFError; a fault anywhere else is handed to whatever handled SIGBUS before (faulthandler, the default action),
 * once, so a crash outside a guarded call stays a crash and a cycle of handlers cannot loop.
 * ------------------------------------------------------------------------------------------------------------- */

#ifdef SZ_GUARD
static __thread sigjmp_buf *guard_target; /* set while this thread is inside a guarded call */
static struct sigaction previous_bus_action;
static volatile sig_atomic_t passed_on;
static pthread_mutex_t guard_lock = PTHREAD_MUTEX_INITIALIZER;
#ifdef SZ_COVER
static int cover_fault(uintptr_t address);
#endif

static void on_bus_fault(int signum, siginfo_t *info, void *context)
{
    (void)context;
    sigjmp_buf *target = guard_target;
    if (target != NULL && info->si_code > 0) { /* a fault (si_code > 0), not a signal some process sent */
        guard_target = NULL;
        siglongjmp(*target, 1);
    }
#ifdef SZ_COVER
    if (info->si_code > 0 && cover_fault((uintptr_t)info->si_addr))
        return; /* the faulting instruction runs again and reads zeros */
#endif
    /* Not a guarded read: give the signal back and return, so the faulting instruction runs again and meets the
     * previous handler (a signal sent by a process is sent again, to be delivered once this handler returns); a
     * second one outside a guarded call gets the default action (the process ends). */
    struct sigaction action = previous_bus_action;
    if (passed_on) {
        memset(&action, 0, sizeof action);
        action.sa_handler = SIG_DFL;
    }
    passed_on = 1;
    sigaction(signum, &action, NULL);
    if (info->si_code <= 0)
        raise(signum);
}

/* Make on_bus_fault SIGBUS's handler unless it is already (someone, faulthandler say, may have installed theirs
 * since the last call): theirs becomes the one a fault outside a guarded call is handed to. */
static int install_bus_guard(void)
{
    struct sigaction current, ours;
    int status = 0;
    pthread_mutex_lock(&guard_lock);
    if (sigaction(SIGBUS, NULL, &current) != 0) {
        status = -1;
    } else if (!((current.sa_flags & SA_SIGINFO) && current.sa_sigaction == on_bus_fault)) {
        memset(&ours, 0, sizeof ours);
        ours.sa_sigaction = on_bus_fault;
        ours.sa_flags = SA_SIGINFO;
        sigemptyset(&ours.sa_mask);
        previous_bus_action = current;
        passed_on = 0;
        status = sigaction(SIGBUS, &ours, NULL);
    }
    pthread_mutex_unlock(&guard_lock);
    return status;
}

/* work(arg) with this thread's SIGBUS faults caught: 0, or -1 where a page could not be read (whatever work
 * wrote is then partly written). */
static int run_guarded(void (*work)(void *), void *arg)
{
    sigjmp_buf target;
    if (sigsetjmp(target, 1) != 0)
        return -1; /* guard_target was cleared by the handler */
    guard_target = &target;
    work(arg);
    guard_target = NULL;
    return 0;
}
#endif

/* The escape streams being written: escapes past ``n_esc`` are counted, not written. */
typedef struct {
    uint8_t *payload;
    Offsets o;
    Py_ssize_t n_esc, chunk_size, found;
} Escapes;

static void add_escape(Escapes *s, Py_ssize_t i, uint8_t exponent)
{
    if (s->found < s->n_esc) {
        uint32_t chunk = (uint32_t)(i / s->chunk_size), local = (uint32_t)(i % s->chunk_size);
        uint8_t *c = s->payload + s->o.cid + 4 * s->found, *l = s->payload + s->o.lpos + 2 * s->found;
        c[0] = (uint8_t)chunk, c[1] = (uint8_t)(chunk >> 8), c[2] = (uint8_t)(chunk >> 16), c[3] = (uint8_t)(chunk >> 24);
        l[0] = (uint8_t)local, l[1] = (uint8_t)(local >> 8);
        s->payload[s->o.ev + s->found] = exponent;
    }
    s->found++;
}

static void list_escapes_scalar(const uint16_t *bits, Py_ssize_t start, Py_ssize_t n, const uint8_t *enc, Escapes *s)
{
    for (Py_ssize_t i = start; i < n; i++)
        if (enc[(bits[i] >> 7) & 0xFF] == 16)
            add_escape(s, i, (uint8_t)(bits[i] >> 7));
}

#ifdef SZ_X86
/* 32 elements at a time: each exponent byte compared with the codebook's (at most 16) exponents; the elements that
 * match none, rare, are then taken one by one. A table with more than 16 codes (no codebook makes one) goes to
 * the portable loop. */
__attribute__((target("avx2")))
static void list_escapes_avx2(const uint16_t *bits, Py_ssize_t n, const uint8_t *enc, Escapes *s)
{
    __m256i codebook[16];
    int used = 0;
    for (int e = 0; e < 256; e++) {
        if (enc[e] == 16)
            continue;
        if (used == 16) {
            list_escapes_scalar(bits, 0, n, enc, s);
            return;
        }
        codebook[used++] = _mm256_set1_epi8((char)e);
    }
    const __m256i byte_mask = _mm256_set1_epi16(0x00FF);
    Py_ssize_t i = 0;
    for (; i + 32 <= n; i += 32) {
        __m256i x0 = _mm256_loadu_si256((const __m256i *)(bits + i));
        __m256i x1 = _mm256_loadu_si256((const __m256i *)(bits + i + 16));
        __m256i e = _mm256_permute4x64_epi64(_mm256_packus_epi16(_mm256_and_si256(_mm256_srli_epi16(x0, 7), byte_mask),
                                                                 _mm256_and_si256(_mm256_srli_epi16(x1, 7), byte_mask)),
                                             0xD8);
        __m256i known = _mm256_setzero_si256();
        for (int k = 0; k < used; k++)
            known = _mm256_or_si256(known, _mm256_cmpeq_epi8(e, codebook[k]));
        uint32_t escaped = ~(uint32_t)_mm256_movemask_epi8(known);
        while (escaped) {
            int j = __builtin_ctz(escaped);
            add_escape(s, i + j, (uint8_t)(bits[i + j] >> 7));
            escaped &= escaped - 1;
        }
    }
    list_escapes_scalar(bits, i, n, enc, s);
}
#endif

/* Every element whose exponent byte the table maps to the escape code (16), in order. */
static void list_escapes(const uint16_t *bits, Py_ssize_t n, const uint8_t *enc, Escapes *s)
{
#ifdef SZ_X86
    if (have_avx2()) {
        list_escapes_avx2(bits, n, enc, s);
        return;
    }
#endif
    list_escapes_scalar(bits, 0, n, enc, s);
}

/* A whole payload of ``n`` elements: pairs, the odd last element (its code in the high nibble), the alignment gaps
 * zeroed, and the escapes (elements whose exponent byte the table maps to the escape code 16) listed in the escape
 * streams, at most ``n_esc`` of them written. Returns how many escapes the elements hold, so the caller can tell a
 * layout that miscounts them (nothing is written past ``n_esc``). */
static Py_ssize_t encode_whole(const uint16_t *bits, const uint8_t *enc, uint8_t *payload, Offsets o, Py_ssize_t n,
                               Py_ssize_t n_esc, Py_ssize_t chunk_size)
{
    uint8_t *pk = payload, *sm = payload + o.sm;
    encode(bits, enc, pk, sm, n / 2);
    if (n % 2) {
        pk[n / 2] = (uint8_t)(code_nibble(bits[n - 1], enc) << 4);
        sm[n - 1] = sm_byte(bits[n - 1]);
    }
    memset(payload + (n + 1) / 2, 0, (size_t)(o.sm - (n + 1) / 2));
    memset(payload + o.sm + n, 0, (size_t)(o.cid - o.sm - n));
    memset(payload + o.lpos + 2 * n_esc, 0, (size_t)(o.ev - o.lpos - 2 * n_esc));
    Escapes escapes = {payload, o, n_esc, chunk_size, 0};
    list_escapes(bits, n, enc, &escapes);
    return escapes.found;
}

/* ---------------------------------------------------------------------------------------------------------------
 * Byte planes (the at-rest stage of raw tensors): plane j holds byte j of every element (little-endian), after
 * the element is rotated left by one bit when ``sign_last`` (a float's sign moves to bit 0, so its exponent fills
 * the high byte). Plain loops over the planes' own pointers, the element type and the rotation constant in each
 * instance, which compilers vectorize: a plane is read or written as one sequential stream, at memory speed.
 * ------------------------------------------------------------------------------------------------------------- */

#define PLANES_LOOPS(K, T, ROT, NAME)                                                                          \
    static void join_##NAME(const uint8_t *const *planes, uint8_t *restrict out, Py_ssize_t n)                 \
    {                                                                                                           \
        const uint8_t *p[K];                                                                                    \
        for (int j = 0; j < K; j++)                                                                             \
            p[j] = planes[j];                                                                                   \
        for (Py_ssize_t i = 0; i < n; i++) {                                                                    \
            T v = 0;                                                                                            \
            for (int j = 0; j < K; j++)                                                                         \
                v |= (T)p[j][i] << (8 * j);                                                                     \
            if (ROT)                                                                                            \
                v = (T)((v >> 1) | (v << (8 * K - 1)));                                                         \
            memcpy(out + i * K, &v, K);                                                                         \
        }                                                                                                       \
    }                                                                                                           \
    static void split_##NAME(const uint8_t *restrict data, uint8_t *const *planes, Py_ssize_t n)               \
    {                                                                                                           \
        uint8_t *p[K];                                                                                          \
        for (int j = 0; j < K; j++)                                                                             \
            p[j] = planes[j];                                                                                   \
        for (Py_ssize_t i = 0; i < n; i++) {                                                                    \
            T v;                                                                                                \
            memcpy(&v, data + i * K, K);                                                                        \
            if (ROT)                                                                                            \
                v = (T)((v << 1) | (v >> (8 * K - 1)));                                                         \
            for (int j = 0; j < K; j++)                                                                         \
                p[j][i] = (uint8_t)(v >> (8 * j));                                                              \
        }                                                                                                       \
    }

PLANES_LOOPS(2, uint16_t, 0, 2)
PLANES_LOOPS(4, uint32_t, 0, 4)
PLANES_LOOPS(8, uint64_t, 0, 8)
PLANES_LOOPS(2, uint16_t, 1, 2r)
PLANES_LOOPS(4, uint32_t, 1, 4r)
PLANES_LOOPS(8, uint64_t, 1, 8r)

static int loop_index(int itemsize) { return itemsize == 2 ? 0 : itemsize == 4 ? 1 : 2; }

/* Elements ``data`` (n of them) into planes ``planes`` (plane j at planes + j * n). */
static void planes_split(const uint8_t *data, uint8_t *planes, Py_ssize_t n, int itemsize, int sign_last)
{
    typedef void (*loop)(const uint8_t *restrict, uint8_t *const *, Py_ssize_t);
    static const loop splits[2][3] = {{split_2, split_4, split_8}, {split_2r, split_4r, split_8r}};
    uint8_t *pointers[8];
    for (int j = 0; j < itemsize; j++)
        pointers[j] = planes + (Py_ssize_t)j * n;
    splits[sign_last != 0][loop_index(itemsize)](data, pointers, n);
}

/* Planes ``planes[j]`` (n bytes each, anywhere: an inflated plane in a scratch, a verbatim one where it is stored)
 * into elements ``out``. */
static void planes_join(const uint8_t *const *planes, uint8_t *out, Py_ssize_t n, int itemsize, int sign_last)
{
    typedef void (*loop)(const uint8_t *const *, uint8_t *restrict, Py_ssize_t);
    static const loop joins[2][3] = {{join_2, join_4, join_8}, {join_2r, join_4r, join_8r}};
    joins[sign_last != 0][loop_index(itemsize)](planes, out, n);
}

/* ---------------------------------------------------------------------------------------------------------------
 * Python bindings
 * ------------------------------------------------------------------------------------------------------------- */

#define MAX_BUFFERS 6

/* A call's arguments as buffers: ``names[i]`` for messages; bit i of ``writable`` asks for a writable one. Every
 * buffer taken is released by ``release`` whatever happened. */
typedef struct {
    Py_buffer views[MAX_BUFFERS];
    int count;
} Buffers;

static int take(const char *function, PyObject *const *args, Py_ssize_t nargs, int count, const char *const *names,
                unsigned writable, Buffers *b)
{
    b->count = 0;
    if (nargs != count) {
        PyErr_Format(PyExc_TypeError, "%s() takes %d arguments (%zd given)", function, count, nargs);
        return -1;
    }
    for (int i = 0; i < count; i++) {
        int w = (writable >> i) & 1;
        if (PyObject_GetBuffer(args[i], &b->views[i], PyBUF_C_CONTIGUOUS | (w ? PyBUF_WRITABLE : 0)) < 0) {
            PyErr_Format(PyExc_TypeError, "%s(): %s must be a C-contiguous%s buffer", function, names[i],
                         w ? " writable" : "");
            return -1;
        }
        b->count = i + 1;
    }
    return 0;
}

static void release(Buffers *b)
{
    for (int i = 0; i < b->count; i++)
        PyBuffer_Release(&b->views[i]);
}

static PyObject *py_decode_pairs(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    static const char *const names[] = {"pk", "sm", "dec_lut", "out"};
    Buffers b;
    PyObject *result = NULL;
    if (take("decode_pairs", args, nargs, 4, names, 0x8, &b) == 0) {
        Py_ssize_t n_pairs = b.views[0].len;
        if (b.views[1].len != 2 * n_pairs || b.views[2].len != 16 || b.views[3].len != 4 * n_pairs) {
            PyErr_Format(PyExc_ValueError, "decode_pairs(): %zd pk bytes need %zd sm bytes, a 16-byte codebook and "
                         "%zd output bytes (got %zd, %zd, %zd)", n_pairs, 2 * n_pairs, 4 * n_pairs, b.views[1].len,
                         b.views[2].len, b.views[3].len);
        } else {
            const uint8_t *pk = b.views[0].buf, *sm = b.views[1].buf, *lut = b.views[2].buf;
            uint16_t *out = b.views[3].buf;
            Py_BEGIN_ALLOW_THREADS
            decode(pk, sm, lut, out, n_pairs);
            Py_END_ALLOW_THREADS
            result = Py_NewRef(Py_None);
        }
    }
    release(&b);
    return result;
}

static PyObject *py_encode_pairs(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    static const char *const names[] = {"bits", "enc_lut", "pk", "sm"};
    Buffers b;
    PyObject *result = NULL;
    if (take("encode_pairs", args, nargs, 4, names, 0xC, &b) == 0) {
        Py_ssize_t n_pairs = b.views[2].len;
        if (b.views[0].len != 4 * n_pairs || b.views[1].len != 256 || b.views[3].len != 2 * n_pairs) {
            PyErr_Format(PyExc_ValueError, "encode_pairs(): %zd pk bytes need %zd source bytes, a 256-byte table and "
                         "%zd sm bytes (got %zd, %zd, %zd)", n_pairs, 4 * n_pairs, 2 * n_pairs, b.views[0].len,
                         b.views[1].len, b.views[3].len);
        } else {
            const uint16_t *bits = b.views[0].buf;
            const uint8_t *enc = b.views[1].buf;
            uint8_t *pk = b.views[2].buf, *sm = b.views[3].buf;
            Py_BEGIN_ALLOW_THREADS
            encode(bits, enc, pk, sm, n_pairs);
            Py_END_ALLOW_THREADS
            result = Py_NewRef(Py_None);
        }
    }
    release(&b);
    return result;
}

static PyObject *py_exponent_histogram(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    static const char *const names[] = {"bits", "counts"};
    Buffers b;
    PyObject *result = NULL;
    if (take("exponent_histogram", args, nargs, 2, names, 0x2, &b) == 0) {
        if (b.views[0].len % 2 || b.views[1].len != 256 * 8) {
            PyErr_SetString(PyExc_ValueError, "exponent_histogram(): 16-bit elements and 256 int64 counts");
        } else {
            const uint16_t *bits = b.views[0].buf;
            int64_t *counts = b.views[1].buf;
            Py_ssize_t n = b.views[0].len / 2;
            Py_BEGIN_ALLOW_THREADS
#ifdef SZ_HISTOGRAM_AVX512
            if (have_avx512bw())
                histogram_avx512(bits, n, counts);
            else
#endif
                histogram_scalar(bits, n, counts);
            Py_END_ALLOW_THREADS
            result = Py_NewRef(Py_None);
        }
    }
    release(&b);
    return result;
}

static PyObject *py_mismatches(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    static const char *const names[] = {"a", "b", "positions"};
    Buffers b;
    PyObject *result = NULL;
    if (take("mismatches", args, nargs, 3, names, 0x4, &b) == 0) {
        Py_ssize_t n = b.views[0].len / 2;
        if (b.views[0].len % 2 || b.views[1].len != b.views[0].len || b.views[2].len < 8 * n) {
            PyErr_SetString(PyExc_ValueError, "mismatches(): two int16 arrays of one length and room for as many "
                            "int64 positions");
        } else {
            const uint16_t *x = b.views[0].buf, *y = b.views[1].buf;
            int64_t *positions = b.views[2].buf;
            Py_ssize_t count;
            Py_BEGIN_ALLOW_THREADS
            count = mismatches(x, y, n, positions);
            Py_END_ALLOW_THREADS
            result = PyLong_FromSsize_t(count);
        }
    }
    release(&b);
    return result;
}

/* The arguments of decode_payload and encode_payload: three buffers (the payload, a table of ``table_bytes``, and
 * the elements, in the order ``names`` gives), then the escape count and the chunk size, checked against each other
 * before anything is read or written. The caller releases ``a->b`` whatever this returns. */
typedef struct {
    Buffers b;
    Py_ssize_t n, n_esc, chunk_size;
    Offsets o;
} PayloadArgs;

/* 0 where a payload of ``payload_len`` bytes and a table of ``table_len`` hold ``a->n`` elements (``element_bytes``
 * of output, even) with ``a->n_esc`` escapes in chunks of ``a->chunk_size`` (a->o set); -1 with a ValueError else. */
static int payload_sizes(const char *function, PayloadArgs *a, Py_ssize_t payload_len, Py_ssize_t table_len,
                         Py_ssize_t table_bytes, Py_ssize_t element_bytes)
{
    a->o = offsets_of(a->n < 0 ? 0 : a->n, a->n_esc < 0 ? 0 : a->n_esc);
    if (a->n < 0 || element_bytes % 2 || a->n_esc < 0 || a->n_esc > a->n || a->chunk_size <= 0 ||
        a->chunk_size > 65536 || table_len != table_bytes || payload_len < a->o.end) {
        PyErr_Format(PyExc_ValueError, "%s(): %zd elements with %zd escapes in chunks of %zd need %zd payload bytes "
                     "and a %zd-byte table (got %zd payload bytes, a %zd-byte table, %zd element bytes)", function,
                     a->n, a->n_esc, a->chunk_size, a->o.end, table_bytes, payload_len, table_len, element_bytes);
        return -1;
    }
    return 0;
}

static int payload_args(const char *function, PyObject *const *args, Py_ssize_t nargs, const char *const *names,
                        unsigned writable, int payload, int elements, Py_ssize_t table_bytes, PayloadArgs *a)
{
    a->b.count = 0;
    if (nargs != 5) {
        PyErr_Format(PyExc_TypeError, "%s() takes 5 arguments (%zd given)", function, nargs);
        return -1;
    }
    a->n_esc = PyLong_AsSsize_t(args[3]);
    a->chunk_size = PyLong_AsSsize_t(args[4]);
    if ((a->n_esc == -1 || a->chunk_size == -1) && PyErr_Occurred())
        return -1;
    if (take(function, args, 3, 3, names, writable, &a->b) < 0)
        return -1;
    const Py_buffer *v = a->b.views;
    a->n = v[elements].len / 2;
    return payload_sizes(function, a, v[payload].len, v[1].len, table_bytes, v[elements].len);
}

/* check_payloads' item ``(payload, dec_lut, n, n_esc, chunk_size)``: payload_args' checks, with the element count
 * given where decode_payloads' items give an output of that size. */
static int check_args(const char *function, PyObject *const *args, PayloadArgs *a)
{
    static const char *const names[] = {"payload", "dec_lut"};
    a->b.count = 0;
    a->n = PyLong_AsSsize_t(args[2]);
    a->n_esc = PyLong_AsSsize_t(args[3]);
    a->chunk_size = PyLong_AsSsize_t(args[4]);
    if ((a->n == -1 || a->n_esc == -1 || a->chunk_size == -1) && PyErr_Occurred())
        return -1;
    if (take(function, args, 2, 2, names, 0, &a->b) < 0)
        return -1;
    return payload_sizes(function, a, a->b.views[0].len, a->b.views[1].len, 16, 2 * a->n);
}

static PyObject *py_decode_payload(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    static const char *const names[] = {"payload", "dec_lut", "out"};
    PayloadArgs a;
    PyObject *result = NULL;
    if (payload_args("decode_payload", args, nargs, names, 0x4, 0, 2, 16, &a) == 0) {
        const uint8_t *payload = a.b.views[0].buf, *lut = a.b.views[1].buf;
        uint16_t *out = a.b.views[2].buf;
        char message[160];
        const char *error;
        Py_BEGIN_ALLOW_THREADS
        error = check_escapes(payload, a.o, a.n_esc, a.n, a.chunk_size, message, sizeof message);
        if (error == NULL)
            decode_whole(payload, a.o, lut, out, a.n, a.n_esc, a.chunk_size);
        Py_END_ALLOW_THREADS
        if (error != NULL)
            PyErr_SetString(PyExc_ValueError, error);
        else
            result = Py_NewRef(Py_None);
    }
    release(&a.b);
    return result;
}

static PyObject *py_encode_payload(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    static const char *const names[] = {"bits", "enc_lut", "payload"};
    PayloadArgs a;
    PyObject *result = NULL;
    if (payload_args("encode_payload", args, nargs, names, 0x4, 2, 0, 256, &a) == 0) {
        const uint16_t *bits = a.b.views[0].buf;
        const uint8_t *enc = a.b.views[1].buf;
        uint8_t *payload = a.b.views[2].buf;
        Py_ssize_t found;
        Py_BEGIN_ALLOW_THREADS
        found = encode_whole(bits, enc, payload, a.o, a.n, a.n_esc, a.chunk_size);
        Py_END_ALLOW_THREADS
        result = PyLong_FromSsize_t(found);
    }
    release(&a.b);
    return result;
}

static PyObject *py_use_crc32(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_Format(PyExc_TypeError, "use_crc32() takes 2 arguments (%zd given)", nargs);
        return NULL;
    }
    void *crc_pointer = PyLong_AsVoidPtr(args[0]), *combine_pointer = PyLong_AsVoidPtr(args[1]);
    if (crc_pointer == NULL || combine_pointer == NULL) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "use_crc32(): a null address");
        return NULL;
    }
    crc32_function crc = (crc32_function)crc_pointer;
    crc32_combine_function combine = (crc32_combine_function)combine_pointer;
    uint8_t probe[257];
    for (int i = 0; i < 257; i++)
        probe[i] = (uint8_t)(i * 167 + 13);
    if (crc(0x12345678u, probe, sizeof probe) != crc32_bitwise(0x12345678u, probe, sizeof probe)) {
        PyErr_SetString(PyExc_ValueError, "use_crc32(): the function does not compute CRC-32");
        return NULL;
    }
    if (combine(crc32_bitwise(0, probe, 100), crc32_bitwise(0, probe + 100, 157), 157) !=
        crc32_bitwise(0, probe, sizeof probe)) {
        PyErr_SetString(PyExc_ValueError, "use_crc32(): the second function does not join CRC-32s");
        return NULL;
    }
    crc32_of = crc;
    crc32_joined = combine;
#ifdef SZ_FOLDED_CRC
    fill_fold_multipliers();
#endif
    Py_RETURN_NONE;
}

/* The EOFError of a guarded call that could not read a page of a mapping. */
static void page_lost(const char *function)
{
    PyErr_Format(PyExc_EOFError, "%s(): a page could not be read (SIGBUS: a mapped file was truncated, or its disk "
                 "failed)", function);
}

/* A call that reads views of a file's mapping: ``work(arg)`` with the GIL released and, where the platform allows,
 * SIGBUS caught (``run_guarded``). 0, or -1 with EOFError set where a page could not be read. */
static int guarded(const char *function, void (*work)(void *), void *arg)
{
    int faulted = 0;
#ifdef SZ_GUARD
    if (install_bus_guard() != 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    Py_BEGIN_ALLOW_THREADS
    faulted = run_guarded(work, arg) != 0;
    Py_END_ALLOW_THREADS
#else
    Py_BEGIN_ALLOW_THREADS
    work(arg);
    Py_END_ALLOW_THREADS
#endif
    if (faulted) {
        page_lost(function);
        return -1;
    }
    return 0;
}

typedef struct {
    const uint8_t *pk, *sm, *lut;
    uint16_t *out;
    Py_ssize_t n;
    const int64_t *positions;
    const uint8_t *exponents;
    Py_ssize_t n_esc;
    uint32_t *crcs;
} DecodeRangeCall;

static void run_decode_range(void *arg)
{
    DecodeRangeCall *c = arg;
    decode_range(c->pk, c->sm, c->lut, c->out, 0, c->n, c->positions, c->exponents, c->n_esc, c->crcs);
}

typedef struct {
    const uint8_t *data;
    Py_ssize_t len;
    uint32_t crc;
} Crc32Call;

/* crc32_of over any length (it takes 32-bit lengths): in pieces of 1 GiB. */
static uint32_t crc32_long(uint32_t crc, const uint8_t *data, Py_ssize_t len)
{
    for (Py_ssize_t done = 0; done < len;) {
        uint32_t piece = len - done < (1 << 30) ? (uint32_t)(len - done) : (1u << 30);
        crc = crc32_of(crc, data + done, piece);
        done += piece;
    }
    return crc;
}

static void run_crc32(void *arg)
{
    Crc32Call *c = arg;
    c->crc = crc32_long(c->crc, c->data, c->len);
}

#define MESSAGE_BYTES 160

#ifdef SZ_POPULATE
/* The page size, read once. */
static uintptr_t page_size(void)
{
    static uintptr_t page = 0;
    if (page == 0)
        page = (uintptr_t)sysconf(_SC_PAGESIZE);
    return page;
}
#endif

/* Fault in the whole pages of an output about to be written whole, in one call rather than a fault per page, unless
 * its first page is in memory already (memory the process wrote before, which walking would only cost): what
 * loading/host_pages.populate does for one tensor from Python, here without the GIL and the Python per tensor
 * (6 us each, a tenth of a small tensor's load). Linux 5.14's MADV_POPULATE_WRITE; a kernel that refuses it (older,
 * out of memory) leaves the pages to fault in as they are written. Elsewhere nothing. */
static void populate_pages(void *buf, Py_ssize_t len)
{
#ifdef SZ_POPULATE
#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif
    uintptr_t page = page_size();
    uintptr_t first = ((uintptr_t)buf + page - 1) / page * page, last = ((uintptr_t)buf + len) / page * page;
    unsigned char resident = 1;
    if (last > first && mincore((void *)first, page, &resident) == 0 && !(resident & 1))
        (void)madvise((void *)first, last - first, MADV_POPULATE_WRITE);
#else
    (void)buf;
    (void)len;
#endif
}

/* The fewest bytes release_pages drops in one call: each call costs a few microseconds (more where other threads of
 * the process must flush their TLBs), what the close's munmap spends on about a hundred pages. MiniLM's load on two
 * threads of the 2-core VM took 0.45 ms longer with a call for each of its 104 tensors. */
#define RELEASE_MIN_BYTES (256 << 10)

/* Drop this process's page table entries for the whole pages inside [buf, buf + len), a view of a read-only file
 * mapping whose bytes were decoded (MADV_DONTNEED: the file's pages stay in the page cache and a later read maps
 * them again, so nothing read changes), unless they are fewer than RELEASE_MIN_BYTES. Unmapping a file's pages is
 * otherwise the close's: munmap tore down the entries of a 2.2 GB load's 1.65 GB of stored bytes in 19 ms on one
 * thread, a quarter of the load on 16 threads; here each thread drops those of the units it decoded. Elsewhere
 * nothing. */
static void release_pages(const void *buf, Py_ssize_t len)
{
#ifdef SZ_POPULATE
    uintptr_t page = page_size();
    uintptr_t first = ((uintptr_t)buf + page - 1) / page * page, last = ((uintptr_t)buf + len) / page * page;
    if (last > first && last - first >= RELEASE_MIN_BYTES)
        (void)madvise((void *)first, last - first, MADV_DONTNEED);
#else
    (void)buf;
    (void)len;
#endif
}

/* ---------------------------------------------------------------------------------------------------------------
 * Covered mappings: pages a file loses read as zeros (Linux)
 *
 * The converter reads its source through a mapping of the file: copying each tensor out with pread first took 0.8
 * of a 2.2 GB conversion's 2.3-2.9 CPU-seconds. But every code that reads those bytes (these kernels, NumPy, the
 * CRC-32 thread, a direct write's copy) would end the process with SIGBUS should another process truncate the file
 * meanwhile, and NumPy's reads cannot be guarded as decode_range's are. So the mapping is covered: a fault inside
 * it, on any thread, outside a guarded call, gets anonymous zeros mapped over the rest of the mapping from the page
 * that faulted on (MAP_FIXED, read-only as the mapping is: a truncated file has lost all of it, and one signal
 * does where a signal per page took seconds), counted, and the faulting instruction runs again and reads zeros.
 * The converter then refuses the tensor it was reading (the file's size and time changed, and the count), so
 * nothing made from those zeros is kept. A slot is taken while start < end; the handler reads it without a lock,
 * so end is published last and cleared first, and a slot is given back only once nothing reads its mapping.
 * ------------------------------------------------------------------------------------------------------------- */

#ifdef SZ_COVER
#define COVERS 64

static struct {
    uintptr_t start, end;
    long faults;
} covers[COVERS];

static int cover_fault(uintptr_t address)
{
    for (int i = 0; i < COVERS; i++) {
        uintptr_t end = __atomic_load_n(&covers[i].end, __ATOMIC_ACQUIRE);
        if (address >= __atomic_load_n(&covers[i].start, __ATOMIC_RELAXED) && address < end) {
            uintptr_t page = page_size(); /* read once when the slot was taken: no sysconf in a handler */
            uintptr_t first = address / page * page, last = (end + page - 1) / page * page;
            void *zeros = mmap((void *)first, last - first, PROT_READ, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0);
            if (zeros == MAP_FAILED)
                return 0;
            __atomic_add_fetch(&covers[i].faults, 1, __ATOMIC_RELAXED);
            return 1;
        }
    }
    return 0;
}
#endif

static PyObject *py_cover_mapping(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 1) {
        PyErr_Format(PyExc_TypeError, "cover_mapping() takes 1 argument (%zd given)", nargs);
        return NULL;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_SIMPLE) != 0)
        return NULL;
    PyObject *result = NULL;
    if (!view.readonly) {
        PyErr_SetString(PyExc_ValueError, "cover_mapping(): a read-only view of a file's mapping only (a page of "
                        "zeros over writable memory would lose what was written)");
    } else {
#ifdef SZ_COVER
        long slot = -1;
        page_size();
        if (install_bus_guard() != 0) {
            PyErr_SetFromErrno(PyExc_OSError);
        } else {
            pthread_mutex_lock(&guard_lock);
            for (int i = 0; i < COVERS && slot < 0; i++)
                if (__atomic_load_n(&covers[i].end, __ATOMIC_RELAXED) == 0)
                    slot = i;
            if (slot >= 0) {
                covers[slot].faults = 0;
                __atomic_store_n(&covers[slot].start, (uintptr_t)view.buf, __ATOMIC_RELAXED);
                __atomic_store_n(&covers[slot].end, (uintptr_t)view.buf + (uintptr_t)view.len, __ATOMIC_RELEASE);
            }
            pthread_mutex_unlock(&guard_lock);
            result = slot >= 0 ? PyLong_FromLong(slot) : Py_NewRef(Py_None);
        }
#else
        result = Py_NewRef(Py_None);
#endif
    }
    PyBuffer_Release(&view);
    return result;
}

/* The slot argument of covered_faults and uncover_mapping: a slot cover_mapping gave, or -1 with ValueError set. */
static long cover_slot(const char *function, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 1) {
        PyErr_Format(PyExc_TypeError, "%s() takes 1 argument (%zd given)", function, nargs);
        return -1;
    }
    long slot = PyLong_AsLong(args[0]);
    if (slot == -1 && PyErr_Occurred())
        return -1;
#ifdef SZ_COVER
    if (slot >= 0 && slot < COVERS && __atomic_load_n(&covers[slot].end, __ATOMIC_ACQUIRE) != 0)
        return slot;
#endif
    PyErr_Format(PyExc_ValueError, "%s(): %ld is not a slot cover_mapping gave", function, slot);
    return -1;
}

static PyObject *py_covered_faults(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    long slot = cover_slot("covered_faults", args, nargs);
    if (slot < 0)
        return NULL;
#ifdef SZ_COVER
    return PyLong_FromLong(__atomic_load_n(&covers[slot].faults, __ATOMIC_RELAXED));
#else
    Py_RETURN_NONE; /* unreachable: no slot is ever given here */
#endif
}

static PyObject *py_uncover_mapping(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    long slot = cover_slot("uncover_mapping", args, nargs);
    if (slot < 0)
        return NULL;
#ifdef SZ_COVER
    pthread_mutex_lock(&guard_lock);
    __atomic_store_n(&covers[slot].end, 0, __ATOMIC_RELEASE);
    __atomic_store_n(&covers[slot].start, 0, __ATOMIC_RELAXED);
    pthread_mutex_unlock(&guard_lock);
#endif
    Py_RETURN_NONE;
}

/* Payloads decoded by one call (decode_payloads, check_payloads), on threads of the call's own: per item its stored
 * bytes' CRC-32 (when asked), its escape checks, and where they hold its decode and its output's CRC-32, with no
 * Python between items. The work is cut into units a thread takes one at a time (the next unit counter): a whole
 * item, or a range of UNIT_ELEMENTS of an item of more (a split item, its escapes checked before any range is
 * taken and its ranges' CRC-32s joined after the last). So one large tensor spreads over every thread, a thread
 * descheduled by another process holds back only its unit, and no unit holds more escapes than elements. */
#define UNIT_ELEMENTS ((Py_ssize_t)1 << 20)
#define MAX_THREADS 256

typedef struct {
    Py_ssize_t item, start, stop; /* elements [start, stop) of an item */
} Unit;

typedef struct {
    PayloadArgs *items;
    Py_ssize_t count;
    int checksums;
    Py_ssize_t populate;     /* outputs of this many bytes and more are populated first (0: none) */
    int scratch;             /* check_payloads: each unit decoded block by block into its thread's scratch */
    int release_read;        /* payloads are views of a read-only file mapping: each unit's pages dropped once read */
    uint32_t *crcs;          /* stored and decoded, two per item */
    const char **errors;     /* per item: NULL, or its escape streams' message */
    char *messages;          /* MESSAGE_BYTES per item */
    Unit *units;             /* room for every item's units */
    uint32_t *unit_crcs;     /* per unit of a split item: its pk, sm and decoded bytes' CRC-32s */
    Py_ssize_t n_units, next;
    Py_ssize_t faulted;      /* the item a page of which could not be read, or -1; the units left are then skipped */
} PayloadsCall;

/* One thread of a PayloadsCall, with its own buffers: the positions of one unit's escapes (at most UNIT_ELEMENTS),
 * and with ``scratch`` the block each unit is decoded into. */
typedef struct {
    PayloadsCall *call;
    int64_t *positions;
    uint16_t *scratch;
    Py_ssize_t item;         /* the item under way, for a fault */
} Worker;

static int is_split(const PayloadArgs *a) { return a->n > UNIT_ELEMENTS; }

static Py_ssize_t units_of(const PayloadArgs *a)
{
    return is_split(a) ? (a->n + UNIT_ELEMENTS - 1) / UNIT_ELEMENTS : 1;
}

static int64_t escape_position(const uint8_t *payload, const PayloadArgs *a, Py_ssize_t k)
{
    int64_t chunk, local;
    escape_at(payload, a->o, k, &chunk, &local);
    return chunk * a->chunk_size + local;
}

/* A payload of ``length`` bytes whose escapes were checked, decoded by decode_range with its checksums: the stored
 * CRC-32 joins those of the pk stream, the bytes up to sm, and the sm stream with everything after it. */
static void stored_and_decoded(const uint8_t *payload, Py_ssize_t length, Offsets o, Py_ssize_t n,
                               const uint32_t *streams, uint32_t *crcs)
{
    Py_ssize_t pk_end = (n + 1) / 2, sm_end = o.sm + n;
    uint32_t head = crc32_long(streams[0], payload + pk_end, o.sm - pk_end);
    uint32_t tail = crc32_long(streams[1], payload + sm_end, length - sm_end);
    crcs[0] = crc32_joined(head, tail, length - o.sm);
    crcs[1] = streams[2];
}

/* Elements [u->start, u->stop) of an item, its escapes there (escapes checked: ascending) found by bisection,
 * decoded by decode_range into ``out`` (the unit's first element), the range's three CRC-32s into ``crcs`` (NULL:
 * none). */
static void decode_unit(Worker *w, const PayloadArgs *a, const Unit *u, uint16_t *out, uint32_t *crcs)
{
    const uint8_t *payload = a->b.views[0].buf, *lut = a->b.views[1].buf;
    Py_ssize_t lo = 0, hi = a->n_esc, m = 0;
    while (lo < hi) {
        Py_ssize_t mid = lo + (hi - lo) / 2;
        if (escape_position(payload, a, mid) < u->start)
            lo = mid + 1;
        else
            hi = mid;
    }
    for (int64_t position; lo + m < a->n_esc && (position = escape_position(payload, a, lo + m)) < u->stop; m++)
        w->positions[m] = position - u->start;
    decode_range(payload + u->start / 2, payload + a->o.sm + u->start, lut, out, w->scratch != NULL,
                 u->stop - u->start, w->positions, payload + a->o.ev + lo, m, crcs);
}

static void run_unit(Worker *w, Py_ssize_t index)
{
    PayloadsCall *c = w->call;
    const Unit *u = &c->units[index];
    const PayloadArgs *a = &c->items[u->item];
    const uint8_t *payload = a->b.views[0].buf;
    uint16_t *out = w->scratch != NULL ? w->scratch : (uint16_t *)a->b.views[2].buf + u->start;
    w->item = u->item;
    if (w->scratch == NULL && c->populate && a->b.views[2].len >= c->populate)
        populate_pages(out, 2 * (u->stop - u->start));
    if (is_split(a)) { /* its escapes were checked */
        decode_unit(w, a, u, out, c->checksums ? c->unit_crcs + 3 * index : NULL);
        if (c->release_read) {
            release_pages(payload + u->start / 2, (u->stop + 1) / 2 - u->start / 2);
            release_pages(payload + a->o.sm + u->start, u->stop - u->start);
        }
        return;
    }
    Py_ssize_t i = u->item;
    c->errors[i] = check_escapes(payload, a->o, a->n_esc, a->n, a->chunk_size, c->messages + i * MESSAGE_BYTES,
                                 MESSAGE_BYTES);
    if (c->errors[i] != NULL) {
        if (c->checksums)
            c->crcs[2 * i] = crc32_long(0, payload, a->b.views[0].len);
    } else if (c->checksums) {
        uint32_t streams[3];
        decode_unit(w, a, u, out, streams);
        stored_and_decoded(payload, a->b.views[0].len, a->o, a->n, streams, c->crcs + 2 * i);
    } else {
        decode_whole(payload, a->o, a->b.views[1].buf, out, a->n, a->n_esc, a->chunk_size);
    }
    if (c->release_read)
        release_pages(payload, a->b.views[0].len);
}

static Py_ssize_t next_unit(PayloadsCall *c)
{
#ifdef SZ_GUARD
    return __atomic_fetch_add(&c->next, 1, __ATOMIC_RELAXED);
#else
    return c->next++;
#endif
}

static int has_faulted(PayloadsCall *c)
{
#ifdef SZ_GUARD
    return __atomic_load_n(&c->faulted, __ATOMIC_RELAXED) >= 0;
#else
    return c->faulted >= 0;
#endif
}

/* The first fault is the one reported. */
static void set_faulted(PayloadsCall *c, Py_ssize_t item)
{
#ifdef SZ_GUARD
    Py_ssize_t none = -1;
    __atomic_compare_exchange_n(&c->faulted, &none, item, 0, __ATOMIC_RELAXED, __ATOMIC_RELAXED);
#else
    if (c->faulted < 0)
        c->faulted = item;
#endif
}

/* work(arg) with this thread's SIGBUS faults caught where the platform allows (run_guarded): 0, or -1. */
static int guard(void (*work)(void *), void *arg)
{
#ifdef SZ_GUARD
    return run_guarded(work, arg);
#else
    work(arg);
    return 0;
#endif
}

/* The split items' escapes checked (one refused gets its stored CRC-32 and no units), then every unit listed. */
static void plan_units(void *arg)
{
    Worker *w = arg;
    PayloadsCall *c = w->call;
    for (Py_ssize_t i = 0; i < c->count; i++) {
        const PayloadArgs *a = &c->items[i];
        w->item = i;
        if (is_split(a)) {
            const uint8_t *payload = a->b.views[0].buf;
            c->errors[i] = check_escapes(payload, a->o, a->n_esc, a->n, a->chunk_size,
                                         c->messages + i * MESSAGE_BYTES, MESSAGE_BYTES);
            if (c->errors[i] != NULL) {
                if (c->checksums)
                    c->crcs[2 * i] = crc32_long(0, payload, a->b.views[0].len);
                continue;
            }
        }
        for (Py_ssize_t start = 0; start < a->n || start == 0; start += UNIT_ELEMENTS) {
            Py_ssize_t stop = is_split(a) && a->n - start > UNIT_ELEMENTS ? start + UNIT_ELEMENTS : a->n;
            c->units[c->n_units++] = (Unit){i, start, stop};
        }
    }
}

static void work_units(void *arg)
{
    Worker *w = arg;
    PayloadsCall *c = w->call;
    for (Py_ssize_t index; !has_faulted(c) && (index = next_unit(c)) < c->n_units;)
        run_unit(w, index);
}

/* Each split item's stored and decoded CRC-32s, from those of its units (listed in order, one item's together). */
static void join_units(void *arg)
{
    Worker *w = arg;
    PayloadsCall *c = w->call;
    for (Py_ssize_t index = 0; index < c->n_units;) {
        Py_ssize_t i = c->units[index].item;
        const PayloadArgs *a = &c->items[i];
        if (!is_split(a)) {
            index++;
            continue;
        }
        w->item = i;
        uint32_t streams[3];
        memcpy(streams, c->unit_crcs + 3 * index, sizeof streams);
        for (index++; index < c->n_units && c->units[index].item == i; index++) {
            const Unit *u = &c->units[index];
            const uint32_t *unit = c->unit_crcs + 3 * index;
            streams[0] = crc32_joined(streams[0], unit[0], (u->stop + 1) / 2 - u->start / 2);
            streams[1] = crc32_joined(streams[1], unit[1], u->stop - u->start);
            streams[2] = crc32_joined(streams[2], unit[2], 2 * (u->stop - u->start));
        }
        stored_and_decoded(a->b.views[0].buf, a->b.views[0].len, a->o, a->n, streams, c->crcs + 2 * i);
    }
}

#ifdef SZ_GUARD
static void *work_units_thread(void *arg)
{
    Worker *w = arg;
    if (run_guarded(work_units, w) != 0)
        set_faulted(w->call, w->item);
    return NULL;
}
#endif

/* Every unit of ``c`` on up to ``threads`` threads, the caller's included (``workers``: one per thread), the GIL
 * released by the caller; ``c->faulted`` says which item's page could not be read, if one could not. The threads
 * are the call's own, started and joined here: about 20 us each, against a millisecond's work per two units. */
static void run_units(PayloadsCall *c, Worker *workers, int threads)
{
    if (guard(plan_units, &workers[0]) != 0) {
        c->faulted = workers[0].item;
        return;
    }
    threads = c->n_units < threads ? (int)(c->n_units > 0 ? c->n_units : 1) : threads;
#ifdef SZ_GUARD
    pthread_t ids[MAX_THREADS];
    int started = 0;
    while (started + 1 < threads && pthread_create(&ids[started], NULL, work_units_thread, &workers[started + 1]) == 0)
        started++; /* a thread that cannot be started leaves its share to the others */
#endif
    if (guard(work_units, &workers[0]) != 0)
        set_faulted(c, workers[0].item);
#ifdef SZ_GUARD
    for (int t = 0; t < started; t++)
        pthread_join(ids[t], NULL);
#endif
    if (c->faulted < 0 && c->checksums && guard(join_units, &workers[0]) != 0)
        c->faulted = workers[0].item;
}

/* crc32(data, crc) -> crc: zlib-ng's CRC-32 of a buffer (a view of a file's mapping, say) continuing ``crc``, with
 * a page that cannot be read an EOFError, as in decode_range. */
static PyObject *py_crc32(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    static const char *const names[] = {"data"};
    Buffers b;
    PyObject *result = NULL;
    if (nargs != 2) {
        PyErr_Format(PyExc_TypeError, "crc32() takes 2 arguments (%zd given)", nargs);
        return NULL;
    }
    unsigned long crc = PyLong_AsUnsignedLong(args[1]);
    if (PyErr_Occurred())
        return NULL;
    if (crc > 0xFFFFFFFFul) {
        PyErr_SetString(PyExc_ValueError, "crc32(): crc must be in [0, 2**32)");
        return NULL;
    }
    if (crc32_of == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "crc32(): no CRC-32 function (use_crc32)");
        return NULL;
    }
    if (take("crc32", args, 1, 1, names, 0, &b) < 0)
        goto done;
    Crc32Call call = {b.views[0].buf, b.views[0].len, (uint32_t)crc};
    if (guarded("crc32", run_crc32, &call) == 0)
        result = PyLong_FromUnsignedLong(call.crc);
done:
    release(&b);
    return result;
}

/* The ``checksums`` argument of a checked decode: 1 or 0, or -1 with an error set (not a truth value, or checksums
 * asked for before use_crc32 handed the CRC-32 functions over). */
static int checksums_wanted(const char *function, PyObject *flag)
{
    int wanted = PyObject_IsTrue(flag);
    if (wanted > 0 && (crc32_of == NULL || crc32_joined == NULL)) {
        PyErr_Format(PyExc_RuntimeError, "%s(): no CRC-32 function (use_crc32)", function);
        return -1;
    }
    return wanted;
}

/* The call decode_payloads and check_payloads share: ``items`` parsed by decode_payloads' checks or, with
 * ``scratch``, check_payloads' (each unit decoded block by block into its thread's scratch: only the checksums are
 * kept), their units run on up to ``threads`` threads (run_units), and the list of results. */
static PyObject *run_payloads(const char *function, PyObject *items_arg, PyObject *progress_arg, int checksums,
                              Py_ssize_t populate, int scratch, int release_read, int threads)
{
    static const char *const names[] = {"payload", "dec_lut", "out"};
    char not_a_sequence[64];
    snprintf(not_a_sequence, sizeof not_a_sequence, "%s(): items must be a list or a tuple", function);
    PyObject *items = PySequence_Fast(items_arg, not_a_sequence);
    if (items == NULL)
        return NULL;
    Py_ssize_t count = PySequence_Fast_GET_SIZE(items), taken = 0, unit_escapes = 0, units = 0;
    PyObject *result = NULL;
    Py_buffer progress = {0};
    int have_progress = 0, made = 0;
    Worker *workers = NULL;
    PayloadsCall call = {.items = PyMem_Calloc(count + 1, sizeof(PayloadArgs)), .count = count,
                         .checksums = checksums, .populate = populate, .scratch = scratch, .release_read = release_read,
                         .crcs = PyMem_Calloc(2 * count + 2, sizeof(uint32_t)),
                         .errors = PyMem_Calloc(count + 1, sizeof(char *)),
                         .messages = PyMem_Calloc(count + 1, MESSAGE_BYTES), .faulted = -1};
    if (call.items == NULL || call.crcs == NULL || call.errors == NULL || call.messages == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    if (PyObject_GetBuffer(progress_arg, &progress, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0)
        goto done;
    have_progress = 1;
    if (progress.len < (Py_ssize_t)sizeof(int64_t)) {
        PyErr_Format(PyExc_ValueError, "%s(): progress must hold an int64", function);
        goto done;
    }
    for (; taken < count; taken++) {
        PyObject *item = PySequence_Fast_GET_ITEM(items, taken);
        if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) != 5) {
            PyErr_Format(PyExc_TypeError, "%s(): item %zd must be a tuple of 5", function, taken);
            goto done;
        }
        PyObject *const *fields = PySequence_Fast_ITEMS(item);
        PayloadArgs *a = &call.items[taken];
        if ((scratch ? check_args(function, fields, a) : payload_args(function, fields, 5, names, 0x4, 0, 2, 16, a))
            < 0) {
            taken++; /* its buffers taken so far are released below */
            goto done;
        }
        Py_ssize_t escapes = a->n_esc < UNIT_ELEMENTS ? a->n_esc : UNIT_ELEMENTS; /* n_esc <= n: payload_sizes */
        unit_escapes = escapes > unit_escapes ? escapes : unit_escapes;
        units += units_of(a);
    }
    threads = units < threads ? (int)(units > 0 ? units : 1) : threads;
    call.units = PyMem_Malloc((units + 1) * sizeof(Unit));
    call.unit_crcs = PyMem_Malloc((3 * units + 3) * sizeof(uint32_t));
    workers = PyMem_Calloc(threads, sizeof(Worker));
    if (call.units == NULL || call.unit_crcs == NULL || workers == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (; made < threads; made++) {
        Worker *w = &workers[made];
        w->call = &call;
        w->positions = PyMem_Malloc((unit_escapes + 1) * sizeof(int64_t));
        w->scratch = scratch ? PyMem_Malloc(CHECKED_BLOCK_ELEMENTS * sizeof(uint16_t)) : NULL;
        if (w->positions == NULL || (scratch && w->scratch == NULL)) {
            made++; /* its buffers are freed below */
            PyErr_NoMemory();
            goto done;
        }
    }
#ifdef SZ_GUARD
    if (install_bus_guard() != 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        goto done;
    }
#endif
    Py_BEGIN_ALLOW_THREADS
    run_units(&call, workers, threads);
    Py_END_ALLOW_THREADS
    if (call.faulted >= 0) {
        *(int64_t *)progress.buf = call.faulted;
        page_lost(function);
        goto done;
    }
    result = PyList_New(count);
    for (Py_ssize_t i = 0; result != NULL && i < count; i++) {
        PyObject *entry = call.errors[i] == NULL
            ? Py_BuildValue("(kkO)", (unsigned long)call.crcs[2 * i], (unsigned long)call.crcs[2 * i + 1], Py_None)
            : Py_BuildValue("(kks)", (unsigned long)call.crcs[2 * i], 0ul, call.errors[i]);
        if (entry == NULL)
            Py_CLEAR(result);
        else
            PyList_SET_ITEM(result, i, entry);
    }
done:
    for (Py_ssize_t i = 0; i < taken; i++)
        release(&call.items[i].b);
    if (have_progress)
        PyBuffer_Release(&progress);
    for (int t = 0; t < made; t++) {
        PyMem_Free(workers[t].positions);
        PyMem_Free(workers[t].scratch);
    }
    PyMem_Free(workers);
    PyMem_Free(call.items);
    PyMem_Free(call.crcs);
    PyMem_Free(call.errors);
    PyMem_Free(call.messages);
    PyMem_Free(call.units);
    PyMem_Free(call.unit_crcs);
    Py_DECREF(items);
    return result;
}

/* The ``threads`` argument of decode_payloads: an int >= 1 (at most MAX_THREADS are started),
 * or -1 with an error set. */
static int threads_wanted(const char *function, PyObject *arg)
{
    Py_ssize_t threads = PyLong_AsSsize_t(arg);
    if (threads == -1 && PyErr_Occurred())
        return -1;
    if (threads < 1) {
        PyErr_Format(PyExc_ValueError, "%s(): threads must be >= 1", function);
        return -1;
    }
    return threads < MAX_THREADS ? (int)threads : MAX_THREADS;
}

/* decode_payloads(items, checksums, progress, populate, threads, release) -> [(stored_crc, decoded_crc, error),
 * ...]: ``items`` a list of decode_payload's arguments ``(payload, dec_lut, out, n_esc, chunk_size)``, each checked
 * as decode_payload checks them; one call decodes them all on up to ``threads`` threads (payloads may be views of a
 * file's mapping: each thread's reads are guarded), each output of at least ``populate`` bytes (0: none) populated
 * first (populate_pages) by the threads writing it. With ``release`` (payloads that are views of a read-only file
 * mapping, and only those: anonymous memory would lose its bytes) each unit's stored pages are dropped from the
 * process's page tables once decoded (release_pages). Per item: the CRC-32s (0 when ``checksums`` is false, the
 * decoded one also where the escapes were refused) and None, or the escape streams' message (that item's ``out``
 * left unwritten). A page that could not be read is an EOFError, the index of its item in ``progress[0]`` (an int64
 * buffer); the other items' outputs are then partly written. */
static PyObject *py_decode_payloads(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 6) {
        PyErr_Format(PyExc_TypeError, "decode_payloads() takes 6 arguments (%zd given)", nargs);
        return NULL;
    }
    int checksums = checksums_wanted("decode_payloads", args[1]);
    if (checksums < 0)
        return NULL;
    Py_ssize_t populate = PyLong_AsSsize_t(args[3]);
    if (populate == -1 && PyErr_Occurred())
        return NULL;
    if (populate < 0) {
        PyErr_SetString(PyExc_ValueError, "decode_payloads(): populate must be a byte count >= 0");
        return NULL;
    }
    int threads = threads_wanted("decode_payloads", args[4]);
    if (threads < 0)
        return NULL;
    int release_read = PyObject_IsTrue(args[5]);
    if (release_read < 0)
        return NULL;
    return run_payloads("decode_payloads", args[0], args[2], checksums, populate, 0, release_read, threads);
}

/* check_payloads(items, progress, release) -> [(stored_crc, decoded_crc, error), ...]: decode_payloads with its
 * checksums for a check that keeps nothing else (``szconvert verify``, which runs a call per thread of its own):
 * ``items`` of ``(payload, dec_lut, n, n_esc, chunk_size)``, each unit decoded a block at a time into one buffer of
 * 32 KiB, where decode_payloads' outputs take fresh pages for every byte (a 23 MB tensor: most of a small file's
 * check); ``release`` as decode_payloads'. */
static PyObject *py_check_payloads(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_Format(PyExc_TypeError, "check_payloads() takes 3 arguments (%zd given)", nargs);
        return NULL;
    }
    if (checksums_wanted("check_payloads", Py_True) < 0)
        return NULL;
    int release_read = PyObject_IsTrue(args[2]);
    if (release_read < 0)
        return NULL;
    return run_payloads("check_payloads", args[0], args[1], 1, 0, 1, release_read, 1);
}

/* 0 where the ``n_esc`` escape ``positions`` ascend inside [0, n), as a decode that patches them needs; else -1 with
 * a ValueError set. */
static int check_positions(const char *function, const int64_t *positions, Py_ssize_t n_esc, Py_ssize_t n)
{
    for (Py_ssize_t k = 0; k < n_esc; k++) {
        if (positions[k] < 0 || positions[k] >= n || (k && positions[k] <= positions[k - 1])) {
            PyErr_Format(PyExc_ValueError, "%s(): escape positions must ascend inside [0, %zd)", function, n);
            return -1;
        }
    }
    return 0;
}

static PyObject *py_decode_range(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    static const char *const names[] = {"pk", "sm", "dec_lut", "out", "positions", "exponents"};
    Buffers b;
    PyObject *result = NULL;
    if (nargs != 7) {
        PyErr_Format(PyExc_TypeError, "decode_range() takes 7 arguments (%zd given)", nargs);
        return NULL;
    }
    int checksums = checksums_wanted("decode_range", args[6]);
    if (checksums < 0)
        return NULL;
    if (take("decode_range", args, 6, 6, names, 0x8, &b) < 0)
        goto done;
    const Py_buffer *v = b.views;
    Py_ssize_t n = v[1].len, n_esc = v[5].len;
    if (v[0].len != (n + 1) / 2 || v[2].len != 16 || v[3].len != 2 * n || v[4].len != 8 * n_esc) {
        PyErr_Format(PyExc_ValueError, "decode_range(): %zd sm bytes need %zd pk bytes, a 16-byte codebook, "
                     "%zd output bytes and 8 position bytes per escape exponent (got %zd, %zd, %zd, %zd for %zd)", n,
                     (n + 1) / 2, 2 * n, v[0].len, v[2].len, v[3].len, v[4].len, n_esc);
        goto done;
    }
    const int64_t *positions = v[4].buf;
    if (check_positions("decode_range", positions, n_esc, n) < 0)
        goto done;
    uint32_t crcs[3];
    DecodeRangeCall call = {v[0].buf, v[1].buf, v[2].buf, v[3].buf, n, positions, v[5].buf, n_esc,
                            checksums ? crcs : NULL};
    if (guarded("decode_range", run_decode_range, &call) < 0)
        goto done;
    if (checksums)
        result = Py_BuildValue("(kkk)", (unsigned long)crcs[0], (unsigned long)crcs[1], (unsigned long)crcs[2]);
    else
        result = Py_NewRef(Py_None);
done:
    release(&b);
    return result;
}

typedef struct {
    const uint8_t *pk, *sm, *lut;
    uint16_t *out;
    Py_ssize_t n_rows, width, first, last;
    const int64_t *positions;
    const uint8_t *exponents;
    Py_ssize_t n_esc;
} DecodeColumnsCall;

static void run_decode_columns(void *arg)
{
    DecodeColumnsCall *c = arg;
    decode_columns(c->pk, c->sm, c->lut, c->out, c->n_rows, c->width, c->first, c->last, c->positions, c->exponents,
                   c->n_esc);
}

/* decode_columns(pk, sm, dec_lut, out, positions, exponents, width, first, last): see decode_columns above; the
 * rows' count is the sm bytes over ``width``. The streams may be views of a file's mapping: a page that cannot be
 * read is an EOFError, as in decode_range. */
static PyObject *py_decode_columns(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    static const char *const names[] = {"pk", "sm", "dec_lut", "out", "positions", "exponents"};
    Buffers b;
    PyObject *result = NULL;
    if (nargs != 9) {
        PyErr_Format(PyExc_TypeError, "decode_columns() takes 9 arguments (%zd given)", nargs);
        return NULL;
    }
    Py_ssize_t width = PyLong_AsSsize_t(args[6]), first = PyLong_AsSsize_t(args[7]), last = PyLong_AsSsize_t(args[8]);
    if (PyErr_Occurred())
        return NULL;
    if (width <= 0 || width % 2 || first % 2 || last % 2 || first < 0 || first > last || last > width) {
        PyErr_Format(PyExc_ValueError, "decode_columns(): columns [%zd, %zd) of rows of %zd elements need even bounds "
                     "inside a row of even width", first, last, width);
        return NULL;
    }
    if (take("decode_columns", args, 6, 6, names, 0x8, &b) < 0)
        goto done;
    const Py_buffer *v = b.views;
    Py_ssize_t n = v[1].len, n_rows = n / width, n_esc = v[5].len;
    if (n % width || v[0].len != n / 2 || v[2].len != 16 || v[3].len != 2 * n_rows * (last - first)
            || v[4].len != 8 * n_esc) {
        PyErr_Format(PyExc_ValueError, "decode_columns(): rows of %zd elements need whole rows of sm bytes, half as "
                     "many pk bytes, a 16-byte codebook, 2 output bytes per kept element and 8 position bytes per "
                     "escape exponent (got %zd sm, %zd pk, %zd, %zd, %zd for %zd)", width, n, v[0].len, v[2].len,
                     v[3].len, v[4].len, n_esc);
        goto done;
    }
    const int64_t *positions = v[4].buf;
    if (check_positions("decode_columns", positions, n_esc, n) < 0)
        goto done;
    DecodeColumnsCall call = {v[0].buf, v[1].buf, v[2].buf, v[3].buf, n_rows, width, first, last, positions,
                              v[5].buf, n_esc};
    if (guarded("decode_columns", run_decode_columns, &call) == 0)
        result = Py_NewRef(Py_None);
done:
    release(&b);
    return result;
}

static PyObject *py_guards_mapped_reads(PyObject *self, PyObject *noargs)
{
#ifdef SZ_GUARD
    Py_RETURN_TRUE;
#else
    Py_RETURN_FALSE;
#endif
}

static int planes_args(const char *function, PyObject *const *args, Py_ssize_t nargs, Py_ssize_t *itemsize,
                       int *sign_last)
{
    if (nargs != 4) {
        PyErr_Format(PyExc_TypeError, "%s() takes 4 arguments (%zd given)", function, nargs);
        return -1;
    }
    *itemsize = PyLong_AsSsize_t(args[2]);
    if (*itemsize == -1 && PyErr_Occurred())
        return -1;
    if (*itemsize != 2 && *itemsize != 4 && *itemsize != 8) {
        PyErr_Format(PyExc_ValueError, "%s(): element size 2, 4 or 8, got %zd", function, *itemsize);
        return -1;
    }
    *sign_last = PyObject_IsTrue(args[3]);
    return *sign_last < 0 ? -1 : 0;
}

static PyObject *py_split_planes(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    static const char *const names[] = {"data", "out"};
    Py_ssize_t itemsize;
    int sign_last;
    Buffers b;
    PyObject *result = NULL;
    if (planes_args("split_planes", args, nargs, &itemsize, &sign_last) < 0)
        return NULL;
    if (take("split_planes", args, 2, 2, names, 0x2, &b) == 0) {
        if (b.views[0].len != b.views[1].len || b.views[0].len % itemsize) {
            PyErr_Format(PyExc_ValueError, "split_planes(): two buffers of one length, a multiple of %zd (got %zd "
                         "and %zd bytes)", itemsize, b.views[0].len, b.views[1].len);
        } else {
            const uint8_t *data = b.views[0].buf;
            uint8_t *out = b.views[1].buf;
            Py_ssize_t n = b.views[0].len / itemsize;
            Py_BEGIN_ALLOW_THREADS
            planes_split(data, out, n, (int)itemsize, sign_last);
            Py_END_ALLOW_THREADS
            result = Py_NewRef(Py_None);
        }
    }
    release(&b);
    return result;
}

static PyObject *py_join_planes(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    Py_ssize_t itemsize;
    int sign_last;
    if (planes_args("join_planes", args, nargs, &itemsize, &sign_last) < 0)
        return NULL;
    PyObject *sequence = PySequence_Fast(args[0], "join_planes(): planes must be a sequence of buffers");
    if (sequence == NULL)
        return NULL;
    Py_buffer planes[8], out;
    const uint8_t *pointers[8];
    Py_ssize_t taken = 0, count = PySequence_Fast_GET_SIZE(sequence);
    PyObject *result = NULL;
    int have_out = 0;
    if (count != itemsize) {
        PyErr_Format(PyExc_ValueError, "join_planes(): %zd planes for %zd-byte elements", count, itemsize);
        goto done;
    }
    if (PyObject_GetBuffer(args[1], &out, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0)
        goto done;
    have_out = 1;
    Py_ssize_t n = out.len / itemsize;
    for (; taken < count; taken++) {
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(sequence, taken), &planes[taken], PyBUF_C_CONTIGUOUS) < 0)
            goto done;
        pointers[taken] = planes[taken].buf;
        if (planes[taken].len != n) {
            taken++;
            PyErr_Format(PyExc_ValueError, "join_planes(): each plane holds %zd bytes for an output of %zd", n,
                         out.len);
            goto done;
        }
    }
    if (out.len % itemsize) {
        PyErr_Format(PyExc_ValueError, "join_planes(): an output of %zd bytes is not whole elements", out.len);
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    planes_join(pointers, out.buf, n, (int)itemsize, sign_last);
    Py_END_ALLOW_THREADS
    result = Py_NewRef(Py_None);
done:
    for (Py_ssize_t i = 0; i < taken; i++)
        PyBuffer_Release(&planes[i]);
    if (have_out)
        PyBuffer_Release(&out);
    Py_DECREF(sequence);
    return result;
}

static PyObject *py_isa(PyObject *self, PyObject *noargs)
{
#ifdef SZ_FOLDED_CRC
    if (have_folded_crc())
        return PyUnicode_FromString("avx2+avx512bw+vpclmulqdq");
#endif
    if (have_neon())
        return PyUnicode_FromString("neon");
    return PyUnicode_FromString(have_avx512bw() ? "avx2+avx512bw" : have_avx2() ? "avx2" : "scalar");
}

#define FASTCALL(function) (PyCFunction)(void (*)(void))(function), METH_FASTCALL

static PyMethodDef methods[] = {
    {"decode_pairs", FASTCALL(py_decode_pairs), "decode_pairs(pk, sm, dec_lut, out): whole pairs, escapes aside"},
    {"encode_pairs", FASTCALL(py_encode_pairs), "encode_pairs(bits, enc_lut, pk, sm): whole pairs"},
    {"exponent_histogram", FASTCALL(py_exponent_histogram), "exponent_histogram(bits, counts): counts += ..."},
    {"mismatches", FASTCALL(py_mismatches), "mismatches(a, b, positions) -> count: where int16 arrays differ"},
    {"decode_payload", FASTCALL(py_decode_payload), "decode_payload(payload, dec_lut, out, n_esc, chunk_size): a whole "
     "payload, escapes checked and patched"},
    {"encode_payload", FASTCALL(py_encode_payload), "encode_payload(bits, enc_lut, payload, n_esc, chunk_size) -> "
     "escapes: a whole payload, escape streams and padding included"},
    {"use_crc32", FASTCALL(py_use_crc32), "use_crc32(crc32, combine): the addresses of zlib-ng's zng_crc32 and "
     "zng_crc32_combine for the checked decodes, checked against a bitwise CRC-32 first"},
    {"decode_range", FASTCALL(py_decode_range), "decode_range(pk, sm, dec_lut, out, positions, exponents, checksums) "
     "-> (pk_crc, sm_crc, out_crc) or None: a range decoded block by block, with its checksums when asked; a page "
     "of pk or sm that cannot be read is an EOFError"},
    {"decode_columns", FASTCALL(py_decode_columns), "decode_columns(pk, sm, dec_lut, out, positions, exponents, "
     "width, first, last): columns [first, last) of the rows of width elements whose streams pk and sm are, escapes "
     "patched; a page of pk or sm that cannot be read is an EOFError"},
    {"decode_payloads", FASTCALL(py_decode_payloads), "decode_payloads(items, checksums, progress, populate, "
     "threads, release) -> [(stored_crc, decoded_crc, error), ...]: payloads (decode_payload's arguments each) "
     "decoded by one call on up to threads threads, with their checksums when asked, outputs of populate bytes or "
     "more faulted in first (0: none), with release the pages of payloads that are views of a read-only file mapping "
     "dropped from the page tables once decoded; a page that could not be read an EOFError, its item's index in "
     "progress[0]"},
    {"check_payloads", FASTCALL(py_check_payloads), "check_payloads(items, progress, release) -> [(stored_crc, "
     "decoded_crc, error), ...]: decode_payloads' checks and checksums of (payload, dec_lut, n, n_esc, chunk_size) "
     "items, each decoded a block at a time into one small buffer of the call's; release as decode_payloads'"},
    {"crc32", FASTCALL(py_crc32), "crc32(data, crc) -> crc: zlib-ng's CRC-32 continuing crc; a page of data that "
     "cannot be read is an EOFError"},
    {"guards_mapped_reads", py_guards_mapped_reads, METH_NOARGS, "whether decode_range, decode_columns and crc32 "
     "turn a fault on a mapped page into EOFError here"},
    {"cover_mapping", FASTCALL(py_cover_mapping), "cover_mapping(view) -> slot or None: this read-only view of a "
     "file's mapping reads as zeros from a page the file lost on, instead of raising SIGBUS (Linux; None elsewhere or "
     "with every slot taken)"},
    {"covered_faults", FASTCALL(py_covered_faults), "covered_faults(slot) -> count: faults of a covered mapping "
     "answered with zeros so far"},
    {"uncover_mapping", FASTCALL(py_uncover_mapping), "uncover_mapping(slot): give the slot back (before the mapping "
     "is closed)"},
    {"join_planes", FASTCALL(py_join_planes), "join_planes(planes, out, itemsize, sign_last): a sequence of planes to elements"},
    {"split_planes", FASTCALL(py_split_planes), "split_planes(data, out, itemsize, sign_last): elements to plane-major bytes"},
    {"isa", py_isa, METH_NOARGS, "the instructions the kernels use here: 'avx2+avx512bw+vpclmulqdq' (the folded "
     "checksums), 'avx2+avx512bw' (the histogram), 'avx2', 'neon' or 'scalar'"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_native", "SplitZip's CPU kernels in C.", -1, methods};

/* The module, with UNIT_ELEMENTS: where decode_payloads and check_payloads cut a payload into ranges. */
PyMODINIT_FUNC PyInit__native(void)
{
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && PyModule_AddIntConstant(m, "UNIT_ELEMENTS", (long)UNIT_ELEMENTS) < 0)
        Py_CLEAR(m);
    return m;
}
