/* ICMP errors (parse.h says which types) quote the packet that caused them. When that packet
 * belongs to a translated flow, the quoted headers are translated like the flow's packets and the
 * outer header like a reply:
 *
 *   ingress: an error about a packet we masqueraded (quoted source: uplink address, NAT port)
 *            -> quoted source and outer destination back to the pod's address and port;
 *   egress:  an error about a packet we reverse-translated (quoted destination: the pod)
 *            -> quoted destination and outer source to the uplink address and NAT port.
 *
 * The quoted packet may be of any protocol the NAT translates: ports (TCP, UDP, UDP-Lite, DCCP,
 * SCTP), an ICMP query's identifier, or the address alone. The quoted headers are rewritten in a
 * copy with software checksums (quoted IPv4 header, quoted L4 checksum or SCTP CRC where the
 * quote holds it), and the outer ICMP checksum follows the byte difference. An error whose quote the NAT
 * cannot read (IPv4 options, IPv6 extension headers, a later fragment, an untracked ICMP type,
 * cut short) or that quotes no flow of the table is NOT_TRANSLATED: the caller decides. */
#pragma once

#include <linux/bpf.h>
#include <linux/pkt_cls.h>
#include <bpf/bpf_helpers.h>

#include "csum.h"
#include "flow.h"
#include "parse.h"
#include "sctp.h"

/* Quoted IP header (no options) plus the first 8 bytes of its L4 header. */
#define QUOTE4_LEN (20 + 8)
#define QUOTE6_LEN (40 + 8)
_Static_assert(sizeof(((struct nat_scratch *)0)->quote) == QUOTE6_LEN, "nat_scratch's quote holds an IPv6 quote");

/* icmp_error's result for an error it did not translate (no verdict yet). */
#define NOT_TRANSLATED 0x100

static __always_inline __s64 port_diff(__be16 from, __be16 to, __s64 seed)
{
	/* A 16-bit field at an even offset sums the same in the low half of a 32-bit word. */
	__u32 f = from, t = to;

	return bpf_csum_diff(&f, sizeof(f), &t, sizeof(t), seed);
}

/* quote_ports reads the ports (or the ICMP identifier) of a quoted L4 header at q, and where its
 * checksum is in the 8 bytes quoted (0: not there); -1 for a quote the NAT cannot translate. */
static __always_inline int quote_ports(const int v6, __u8 qproto, const __u8 *q, __be16 *sport, __be16 *dport,
				       __u32 *coff)
{
	__u8 request = 0;

	switch (qproto) {
	case IPPROTO_UDP:
	case IPPROTO_UDPLITE_:
	case IPPROTO_DCCP_:
		*coff = 6;
		/* fall through */
	case IPPROTO_TCP:   /* checksums beyond the 8 bytes: see icmp_error */
	case IPPROTO_SCTP_:
		__builtin_memcpy(sport, q, 2);
		__builtin_memcpy(dport, q + 2, 2);
		return 0;
	case IPPROTO_ICMP:
	case IPPROTO_ICMPV6:
		if ((qproto == IPPROTO_ICMPV6) != !!v6 || icmp_kind(v6, q[0], &request) != L4_ECHO)
			return -1;
		*coff = 2;
		__builtin_memcpy(request ? sport : dport, q + 4, 2);
		return 0;
	case NEXTHDR_HOP:
	case NEXTHDR_ROUTING:
	case NEXTHDR_FRAGMENT:
	case NEXTHDR_DEST:
	case NEXTHDR_AUTH:
		if (v6)
			return -1; /* extension headers are not walked in quotes */
	}
	return 0; /* no ports: the address alone */
}

/* quote_csum updates a quoted L4 checksum at c by diff. A zero UDP checksum means none and
 * stays zero, as in the packet itself (BPF_F_MARK_MANGLED_0): over IPv6 too, where tunnels may
 * send it (RFC 6936). */
static __always_inline void quote_csum(__u8 *c, __u8 qproto, __s64 diff)
{
	__u16 check;

	__builtin_memcpy(&check, c, 2);
	if (!check && qproto == IPPROTO_UDP)
		return;
	check = csum_apply(check, diff);
	if (!check && qproto == IPPROTO_UDP)
		check = 0xffff;
	__builtin_memcpy(c, &check, 2);
}

static __always_inline int icmp_error(struct __sk_buff *skb, const struct pkt *p, const int v6, const int dir)
{
	struct nat_scratch *s = scratch();
	__u8 *q, *nq;
	const __u32 qlen = v6 ? QUOTE6_LEN : QUOTE4_LEN;
	const __u32 ihl = v6 ? 40 : 20;
	const __u32 qoff = p->l4_off + ICMP_HLEN;
	/* The quoted packet went the other way: on ingress its source is ours, on egress its
	 * destination. */
	const int src_side = dir == DIR_INGRESS;
	__be32 qsaddr[4] = {}, qdaddr[4] = {};
	__be16 qsport = 0, qdport = 0;
	__u32 coff = 0;
	__u8 qproto;
	union nat_key k;
	struct nat_entry *e;
	__be32 to[4] = {};
	__be16 to_port;

	if (!s)
		return NOT_TRANSLATED;
	q = s->quote;
	nq = s->nquote;
	if (qoff + qlen > p->end || bpf_skb_load_bytes(skb, qoff, q, qlen) < 0)
		return NOT_TRANSLATED; /* quote too short to say which flow */
	if (v6) {
		if ((q[0] >> 4) != 6)
			return NOT_TRANSLATED;
		qproto = q[6];
		__builtin_memcpy(qsaddr, q + 8, 16);
		__builtin_memcpy(qdaddr, q + 24, 16);
	} else {
		if (q[0] != 0x45) /* version 4 without options */
			return NOT_TRANSLATED;
		if (((q[6] << 8) | q[7]) & IP_OFFMASK)
			return NOT_TRANSLATED; /* a later fragment quoted: no ports */
		qproto = q[9];
		__builtin_memcpy(qsaddr, q + 12, 4);
		__builtin_memcpy(qdaddr, q + 16, 4);
	}
	if (quote_ports(v6, qproto, q + ihl, &qsport, &qdport, &coff) < 0)
		return NOT_TRANSLATED;

	/* The flow's entry for the direction of the error is keyed by the quoted tuple reversed. */
	nat_key(v6, &k, qdaddr, qsaddr, qdport, qsport, qproto, dir);
	e = nat_lookup(v6, &k);
	if (!e)
		return NOT_TRANSLATED;
	addr_copy(v6, to, WORDS(e->addr));
	to_port = e->port;

	const __be32 *from = src_side ? qsaddr : qdaddr;
	const __be16 from_port = src_side ? qsport : qdport;

	if (addr_eq(v6, from, to) && from_port == to_port)
		return TC_NEXT; /* host or inbound flow: nothing was translated */

	__builtin_memcpy(nq, q, QUOTE6_LEN);
	__s64 addr_d = bpf_csum_diff((__be32 *)from, v6 ? 16 : 4, to, v6 ? 16 : 4, 0);
	__u32 aoff = v6 ? (src_side ? 8 : 24) : (src_side ? 12 : 16);

	__builtin_memcpy(nq + aoff, to, v6 ? 16 : 4);
	if (!v6) {
		__u16 check;

		__builtin_memcpy(&check, q + 10, 2);
		check = csum_apply(check, addr_d);
		__builtin_memcpy(nq + 10, &check, 2);
	}

	/* The quoted L4 header: its port, and its checksum where the quote holds it (the pseudo
	 * header counts the address for all but ICMPv4). */
	__u32 poff = ihl + (is_icmp(qproto) ? 4 : (src_side ? 0 : 2));
	__s64 l4_d = port_diff(from_port, to_port, qproto == IPPROTO_ICMP ? 0 : addr_d);
	__u16 check;

	if (from_port != to_port)
		__builtin_memcpy(nq + poff, &to_port, 2);
	/* Constant offsets for the verifier: the checksum is at 6 (UDP, UDP-Lite, DCCP) or 2 (ICMP). */
	if (coff == 6)
		quote_csum(nq + ihl + 6, qproto, l4_d);
	else if (coff == 2)
		quote_csum(nq + ihl + 2, qproto, l4_d);

	__s64 outer_d = bpf_csum_diff((__be32 *)q, qlen, (__be32 *)nq, qlen, 0);

	if (qproto == IPPROTO_TCP || qproto == IPPROTO_SCTP_) {
		/* The TCP checksum and the SCTP CRC lie beyond the first 8 bytes; fix them when the
		 * quote has them (the CRC by its change over the quoted bytes: a whole quoted packet's
		 * stays valid, a cut one's as invalid as it was). */
		__u32 toff = qoff + ihl + (qproto == IPPROTO_TCP ? offsetof(struct tcphdr, check) : 8);
		__u32 ow, nw;

		if (toff + 4 <= p->end && bpf_skb_load_bytes(skb, toff, &ow, 4) == 0) {
			nw = ow;
			if (qproto == IPPROTO_TCP) {
				__builtin_memcpy(&check, &ow, 2);
				check = csum_apply(check, l4_d);
				__builtin_memcpy(&nw, &check, 2);
			} else {
				__u32 qp, np;

				__builtin_memcpy(&qp, q + ihl, 4);
				__builtin_memcpy(&np, nq + ihl, 4);
				nw ^= sctp_crc_delta(qp ^ np, p->end - (qoff + ihl));
			}
			outer_d = bpf_csum_diff(&ow, 4, &nw, 4, outer_d);
			if (bpf_skb_store_bytes(skb, toff, &nw, 4, 0) < 0)
				goto drop;
		}
	}

	if (bpf_l4_csum_replace(skb, p->l4_off + 2, 0, outer_d, 0) < 0)
		goto drop;
	if (bpf_skb_store_bytes(skb, qoff, nq, qlen, 0) < 0)
		goto drop;

	/* The outer address that was the flow's own (the pod or the uplink address). */
	const __be32 *outer = src_side ? p->daddr : p->saddr;

	if (addr_eq(v6, outer, from) && rewrite_addr(skb, p, v6, !src_side, outer, to) < 0)
		goto drop;
	event_add(EV_ICMP_ERROR, 1);
	return TC_NEXT;
drop:
	event_add(EV_DROP_REWRITE, 1);
	return TC_ACT_SHOT;
}

/* icmp_error on the packet being handled (parse.h: packet), one global function per family: the verifier checks
 * each once, for both directions. */
static __always_inline int icmp_error_at(struct __sk_buff *skb, const int v6, __u32 dir)
{
	const struct pkt *p = packet();

	if (!p)
		return NOT_TRANSLATED;
	return icmp_error(skb, p, v6, dir);
}

__attribute__((noinline)) int icmp_error_v4(struct __sk_buff *skb, __u32 dir)
{
	return icmp_error_at(skb, 0, dir);
}

__attribute__((noinline)) int icmp_error_v6(struct __sk_buff *skb, __u32 dir)
{
	return icmp_error_at(skb, 1, dir);
}
