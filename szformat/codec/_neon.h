/* SplitZip's decode and encode with ARM's Advanced SIMD (NEON), which every AArch64 CPU has (Graviton, Grace,
 * Apple silicon): _native.c includes this on AArch64 and runs these where it would run its AVX2 kernels on x86.
 *
 * Kept apart from _native.c, with no Python and no C library in it, so the tests can compile it alone for AArch64
 * and run it under an emulator on any machine (tests/codec/test_neon.py), bit for bit against the reference.
 *
 * A Top-16 codebook is exactly one ``tbl`` table: one instruction maps 16 codes to exponents. The encoder looks
 * each exponent byte up in the 256-entry code table as four 64-byte ``tbl`` tables (an index outside a table gives
 * 0, so the four lookups ORed give the entry).
 *
 * Each function takes whole blocks of 16 pk bytes (32 elements) and returns the pairs it took; the caller finishes
 * the rest with its portable loop.
 */

#ifndef SZ_NEON_H
#define SZ_NEON_H

#include <arm_neon.h>
#include <stddef.h>
#include <stdint.h>

/* Elements 2i and 2i + 1 of each pk byte i < the pairs returned: the high nibble's exponent first, from the
 * codebook ``lut``, sign and mantissa from the sm bytes. */
static ptrdiff_t sz_decode_neon(const uint8_t *pk, const uint8_t *sm, const uint8_t *lut, uint16_t *out,
                                ptrdiff_t n_pairs)
{
    const uint8x16_t table = vld1q_u8(lut), nibble = vdupq_n_u8(0x0F);
    const uint8x16_t low7 = vdupq_n_u8(0x7F), high1 = vdupq_n_u8(0x80);
    ptrdiff_t i = 0;
    for (; i + 16 <= n_pairs; i += 16) {
        uint8x16_t packed = vld1q_u8(pk + i);
        uint8x16x2_t codes = vzipq_u8(vshrq_n_u8(packed, 4), vandq_u8(packed, nibble)); /* element order */
        for (int half = 0; half < 2; half++) {
            uint8x16_t exps = vqtbl1q_u8(table, codes.val[half]), s = vld1q_u8(sm + 2 * i + 16 * half);
            uint8x16x2_t bytes; /* each element's low byte (exponent bit 0, mantissa), then its high byte */
            bytes.val[0] = vorrq_u8(vandq_u8(s, low7), vshlq_n_u8(exps, 7));
            bytes.val[1] = vorrq_u8(vandq_u8(s, high1), vshrq_n_u8(exps, 1));
            vst2q_u8((uint8_t *)(out + 2 * i + 16 * half), bytes); /* interleaved: little-endian elements */
        }
    }
    return i;
}

/* The inverse for pairs i < the pairs returned: pk byte i the codes of elements 2i (high nibble) and 2i + 1 from
 * the 256-entry table ``enc`` (an exponent without a code, 16 there, gives nibble 0), sm bytes (sign << 7) |
 * mantissa. */
static ptrdiff_t sz_encode_neon(const uint16_t *bits, const uint8_t *enc, uint8_t *pk, uint8_t *sm, ptrdiff_t n_pairs)
{
    uint8x16x4_t tables[4];
    for (int t = 0; t < 4; t++) /* four loads, not vld1q_u8_x4, which GCC before 9 lacks */
        for (int q = 0; q < 4; q++)
            tables[t].val[q] = vld1q_u8(enc + 64 * t + 16 * q);
    const uint8x16_t low7 = vdupq_n_u8(0x7F), high1 = vdupq_n_u8(0x80), nibble = vdupq_n_u8(0x0F);
    const uint8x16_t step = vdupq_n_u8(64);
    ptrdiff_t i = 0;
    for (; i + 16 <= n_pairs; i += 16) {
        uint8x16_t codes[2];
        for (int half = 0; half < 2; half++) {
            uint8x16x2_t x = vld2q_u8((const uint8_t *)(bits + 2 * i + 16 * half)); /* low bytes, high bytes */
            uint8x16_t exps = vorrq_u8(vshlq_n_u8(x.val[1], 1), vshrq_n_u8(x.val[0], 7));
            vst1q_u8(sm + 2 * i + 16 * half, vorrq_u8(vandq_u8(x.val[1], high1), vandq_u8(x.val[0], low7)));
            uint8x16_t code = vqtbl4q_u8(tables[0], exps);
            for (int t = 1; t < 4; t++) {
                exps = vsubq_u8(exps, step);
                code = vorrq_u8(code, vqtbl4q_u8(tables[t], exps));
            }
            codes[half] = vandq_u8(code, nibble);
        }
        /* even elements' codes to the high nibbles, odd ones' to the low */
        vst1q_u8(pk + i, vorrq_u8(vshlq_n_u8(vuzp1q_u8(codes[0], codes[1]), 4), vuzp2q_u8(codes[0], codes[1])));
    }
    return i;
}

#endif
