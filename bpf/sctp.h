/* SCTP ports. SCTP's checksum is CRC32c (RFC 9260 6.8, appendix A) over the SCTP packet with the
 * checksum field zero, stored little-endian, and no pseudo-header: an address rewrite leaves it
 * alone, a port rewrite changes it. The kernel's SCTP NAT computes it again over the whole
 * packet (sctp_compute_cksum); no helper does that for BPF, but the CRC is linear. Changing the
 * packet by a difference d (XOR) changes the CRC by the CRC of d from a zero register, without
 * the final inversion; d is the 4 port bytes at the start of an L-byte packet, zero elsewhere,
 * whose CRC is d times x^(8L) in the CRC's field GF(2)[x]/P. That product costs a multiplication
 * per set bit of L, with no loop over the packet. */
#pragma once

#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>

#include "parse.h"

/* The Castagnoli polynomial, bit-reflected: bit 31 is the coefficient of x^0. */
#define CRC32C_POLY 0x82f63b78u
#define CRC32C_ONE 0x80000000u /* x^0 */
#define CRC32C_X8 0x00800000u  /* x^8: one zero byte */

/* crc32c_mul multiplies a and b modulo P, both bit-reflected. A global function, which the
 * verifier walks once rather than at each of sctp_crc_delta's 32 multiplications (a call costs a
 * few ns beside the loop's 32 steps). */
__attribute__((noinline)) __u32 crc32c_mul(__u32 a, __u32 b)
{
	__u32 p = 0;

	/* Without branches, so that the verifier walks the loop once. */
	for (int i = 0; i < 32; i++) {
		p ^= b & -((a >> (31 - i)) & 1);
		b = (b >> 1) ^ (CRC32C_POLY & -(b & 1)); /* b *= x */
	}
	return p;
}

/* sctp_crc_delta is the CRC change of a len-byte SCTP packet whose first 4 bytes (the ports) change
 * by d, as loaded little-endian from the packet: d times x^(8 len). A global function, which the
 * verifier checks once rather than at every place the NAT rewrites a port. */
__attribute__((noinline)) __u32 sctp_crc_delta(__u32 d, __u32 len)
{
	__u32 pw = CRC32C_ONE, sq = CRC32C_X8;

	/* x^(8L) as the product of x^(8*2^k) over the set bits k of L; SCTP packets are at most 64k. */
	for (int k = 0; k < 16; k++) {
		__u32 bit = -((len >> k) & 1);

		pw = (crc32c_mul(pw, sq) & bit) | (pw & ~bit);
		sq = crc32c_mul(sq, sq);
	}
	return crc32c_mul(d, pw);
}

/* sctp_rewrite_port replaces the source (source=1) or destination port of the SCTP header at
 * l4_off with to, and updates the CRC of the len-byte SCTP packet: the ports and the checksum are
 * stored with BPF_F_RECOMPUTE_CSUM, so that skb->csum follows on CHECKSUM_COMPLETE packets
 * (ingress). On a packet whose checksum the stack or the device computes later
 * (CHECKSUM_PARTIAL, GSO), the field is overwritten then, and the update is harmless. */
static __always_inline int sctp_rewrite_port(struct __sk_buff *skb, __u32 l4_off, __u32 len, const int source,
					     __be16 to)
{
	__u32 hdr[3]; /* ports, verification tag, checksum */
	__u32 old;

	if (len > 0xffff || bpf_skb_load_bytes(skb, l4_off, hdr, sizeof(hdr)) < 0)
		return -1;
	old = hdr[0];
	/* Two stores rather than one at a computed offset, which clang may build by OR-ing the
	 * offset into the stack pointer: pointer arithmetic the verifier refuses. */
	if (source)
		__builtin_memcpy(hdr, &to, sizeof(to));
	else
		__builtin_memcpy((__u8 *)hdr + 2, &to, sizeof(to));
	hdr[2] ^= sctp_crc_delta(old ^ hdr[0], len);
	if (bpf_skb_store_bytes(skb, l4_off, &hdr[0], 4, BPF_F_RECOMPUTE_CSUM) < 0)
		return -1;
	return bpf_skb_store_bytes(skb, l4_off + 8, &hdr[2], 4, BPF_F_RECOMPUTE_CSUM) < 0 ? -1 : 0;
}
