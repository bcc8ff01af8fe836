/* Address and port rewrites with incremental checksum updates.
 *
 * The kernel helpers do the arithmetic, so CHECKSUM_PARTIAL packets (GSO, checksum offload)
 * are handled: there the L4 field holds the pseudo-header sum, which only pseudo-header
 * changes touch. On CHECKSUM_COMPLETE packets (ingress) skb->csum must follow every byte that
 * changed: an IPv4 address change is cancelled by its header checksum change, and the helper's
 * pseudo-header update adjusts skb->csum for the L4 checksum change. IPv6 has no header
 * checksum, so the address store adds its own difference back to skb->csum, which together
 * with the helper's adjustment nets out (BPF_F_IPV6 says the same, but only since Linux 6.16). */
#pragma once

#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>

#include "parse.h"
#include "sctp.h"

/* A UDP checksum of zero over IPv4 means "none" and stays zero; a computed zero is sent as
 * 0xffff. */
static __always_inline __u64 mangled0(__u8 proto)
{
	return proto == IPPROTO_UDP ? BPF_F_MARK_MANGLED_0 : 0;
}

/* L4 checksums that include the pseudo header. Later fragments have no L4 header at all, and
 * their checksum kind is CSUM_NONE. */
static __always_inline int l4_has_pseudo(const struct pkt *p)
{
	return p->csum == CSUM_PSEUDO;
}

/* Software checksum arithmetic: the quoted packet of ICMP errors, which no helper reaches, and
 * the IPv4 header, whose checksum no offload or skb->csum involves. */
static __always_inline __u16 csum_fold(__u64 sum)
{
	sum = (sum & 0xffff) + (sum >> 16);
	sum = (sum & 0xffff) + (sum >> 16);
	sum = (sum & 0xffff) + (sum >> 16);
	return (__u16)sum;
}

/* csum_apply updates a checksum field by a bpf_csum_diff result (RFC 1624: HC' = ~(~HC + diff)). */
static __always_inline __u16 csum_apply(__u16 check, __s64 diff)
{
	return ~csum_fold((__u64)(__u16)~check + (__u32)diff);
}

/* csum_replace4 is RFC 1624's HC' = ~(~HC + ~m + m') for a 32-bit field changing from m to m'
 * (both sides in network order: the one's complement sum does not care which). */
static __always_inline __u16 ip_csum_replace4(__u16 check, __be32 from, __be32 to)
{
	__u32 nf = ~from;

	return ~csum_fold((__u64)(__u16)~check + (nf & 0xffff) + (nf >> 16) + (to & 0xffff) + (to >> 16));
}

/* ip4_store_addr writes an IPv4 address and the header checksum it changes in one direct access.
 * bpf_l3_csum_replace would do the same arithmetic behind a helper call (a sizeable share of an
 * established flow's cost where calls are dear: retpolines, SRSO's safe RET) and, like it, leaves
 * skb->csum alone: a header whose checksum follows its address sums to the same. parse only
 * accepts an IPv4 header in the linear data, so the bound below fails only if a helper moved it. */
static __always_inline int ip4_store_addr(struct __sk_buff *skb, const int source, __be32 from, __be32 to)
{
	void *data, *data_end;
	struct iphdr *ip;

	asm volatile("" : "+r"(skb)); /* see store */
	data = (void *)(long)skb->data;
	data_end = (void *)(long)skb->data_end;
	ip = data + ETH_HLEN;
	if ((void *)(ip + 1) > data_end)
		return -1;
	ip->check = ip_csum_replace4(ip->check, from, to);
	if (source)
		ip->saddr = to;
	else
		ip->daddr = to;
	return 0;
}

/* Fields are written with direct packet access once the checksum helpers have run: cheaper
 * than bpf_skb_store_bytes, and the verifier unclones the skb first (its direct-write
 * prologue), as the store helper would. Pointers are re-derived because helpers invalidate
 * them. */
static __always_inline int store(struct __sk_buff *skb, __u32 off, const void *from, const __u32 len)
{
	void *data, *data_end, *dst;

	/* Keep clang from reusing a ctx field address computed earlier: the verifier only accepts
	 * ctx loads at a constant offset from the ctx pointer itself. */
	asm volatile("" : "+r"(skb));
	data = (void *)(long)skb->data;
	data_end = (void *)(long)skb->data_end;

	/* Headers behind IPv6 extension headers may lie beyond the linear data, or too far for the
	 * verifier to bound: the store helper reaches them. */
	if (off > PULL_LEN)
		return bpf_skb_store_bytes(skb, off, from, len, 0);
	dst = data + pull_off(off);
	if (dst + len > data_end)
		return bpf_skb_store_bytes(skb, off, from, len, 0);
	__builtin_memcpy(dst, from, len);
	return 0;
}

/* rewrite_addr replaces the source (source=1) or destination address. */
static __always_inline int rewrite_addr(struct __sk_buff *skb, const struct pkt *p, const int v6,
					const int source, const __be32 *from, const __be32 *to)
{
	__u32 csum_off = p->l4_off + p->csum_off;

	if (!v6) {
		__be32 addr = to[0];

		if (l4_has_pseudo(p) &&
		    bpf_l4_csum_replace(skb, csum_off, from[0], addr,
					BPF_F_PSEUDO_HDR | mangled0(p->proto) | sizeof(__be32)) < 0)
			return -1;
		return ip4_store_addr(skb, source, from[0], addr);
	}

	__u32 off = ETH_HLEN + (source ? offsetof(struct ipv6hdr, saddr) : offsetof(struct ipv6hdr, daddr));
	__be32 addr[4] = {to[0], to[1], to[2], to[3]};
	__s64 diff = bpf_csum_diff((__be32 *)from, 16, addr, 16, 0);

	if (l4_has_pseudo(p) &&
	    bpf_l4_csum_replace(skb, csum_off, 0, diff, BPF_F_PSEUDO_HDR | mangled0(p->proto)) < 0)
		return -1;
	if (store(skb, off, addr, sizeof(addr)) < 0)
		return -1;
	/* The stored bytes changed the packet sum by diff (skb->csum follows on CHECKSUM_COMPLETE
	 * only; elsewhere this fails harmlessly). */
	bpf_csum_update(skb, diff);
	return 0;
}

/* rewrite_port replaces the source (source=1) or destination port, or the echo identifier. */
static __always_inline int rewrite_port(struct __sk_buff *skb, const struct pkt *p, const int source,
					__be16 from, __be16 to)
{
	if (p->csum == CSUM_CRC32C)
		return sctp_rewrite_port(skb, p->l4_off, p->end - p->l4_off, source, to);
	if (bpf_l4_csum_replace(skb, p->l4_off + p->csum_off, from, to, mangled0(p->proto) | sizeof(__be16)) < 0)
		return -1;
	return store(skb, p->l4_off + l4_port_off(p->proto, source), &to, sizeof(to));
}

