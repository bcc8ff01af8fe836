/* Address and port rewrites with incremental checksum updates.
 *
 * The kernel helpers do the arithmetic, so CHECKSUM_PARTIAL packets (GSO, checksum offload)
 * are handled: there the L4 field holds the pseudo-header sum, which only pseudo-header
 * changes touch. On CHECKSUM_COMPLETE packets (ingress) skb->csum must follow every byte that
 * changed: an IPv4 address change is cancelled by its header checksum change, and the helper's
 * pseudo-header update adjusts skb->csum for the L4 checksum change. IPv6 has no header
 * checksum, so its address store recomputes skb->csum itself, which together with the
 * helper's adjustment nets out (BPF_F_IPV6 says the same, but only since Linux 6.16). */
#pragma once

#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>

#include "parse.h"

/* A UDP checksum of zero over IPv4 means "none" and stays zero; a computed zero is sent as
 * 0xffff. */
static __always_inline __u64 mangled0(__u8 proto)
{
	return proto == IPPROTO_UDP ? BPF_F_MARK_MANGLED_0 : 0;
}

/* L4 checksums that include the pseudo header: all but ICMPv4. Later fragments have none. */
static __always_inline int l4_has_pseudo(const struct pkt *p)
{
	return p->frag != FRAG_LATER && p->proto != IPPROTO_ICMP;
}

/* rewrite_addr replaces the source (source=1) or destination address. */
static __always_inline int rewrite_addr(struct __sk_buff *skb, const struct pkt *p, const int v6,
					const int source, const __be32 *from, const __be32 *to)
{
	__u32 csum_off = p->l4_off + l4_csum_off(p->proto);

	if (!v6) {
		__u32 off = ETH_HLEN + (source ? offsetof(struct iphdr, saddr) : offsetof(struct iphdr, daddr));

		if (l4_has_pseudo(p) &&
		    bpf_l4_csum_replace(skb, csum_off, from[0], to[0],
					BPF_F_PSEUDO_HDR | mangled0(p->proto) | sizeof(__be32)) < 0)
			return -1;
		if (bpf_l3_csum_replace(skb, ETH_HLEN + offsetof(struct iphdr, check), from[0], to[0],
					sizeof(__be32)) < 0)
			return -1;
		return bpf_skb_store_bytes(skb, off, to, sizeof(__be32), 0) < 0 ? -1 : 0;
	}

	__u32 off = ETH_HLEN + (source ? offsetof(struct ipv6hdr, saddr) : offsetof(struct ipv6hdr, daddr));
	__s64 diff = bpf_csum_diff((__be32 *)from, 16, (__be32 *)to, 16, 0);

	if (bpf_l4_csum_replace(skb, csum_off, 0, diff, BPF_F_PSEUDO_HDR | mangled0(p->proto)) < 0)
		return -1;
	return bpf_skb_store_bytes(skb, off, to, 16, BPF_F_RECOMPUTE_CSUM) < 0 ? -1 : 0;
}

/* rewrite_port replaces the source (source=1) or destination port, or the echo identifier. */
static __always_inline int rewrite_port(struct __sk_buff *skb, const struct pkt *p, const int source,
					__be16 from, __be16 to)
{
	if (bpf_l4_csum_replace(skb, p->l4_off + l4_csum_off(p->proto), from, to,
				mangled0(p->proto) | sizeof(__be16)) < 0)
		return -1;
	return bpf_skb_store_bytes(skb, p->l4_off + l4_port_off(p->proto, source), &to, sizeof(to), 0) < 0
		       ? -1
		       : 0;
}

/* Software checksum arithmetic for the quoted packet of ICMP errors, which no helper reaches. */
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
