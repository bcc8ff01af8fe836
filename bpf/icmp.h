/* ICMP errors (destination unreachable including fragmentation needed / packet too big, time
 * exceeded) quote the packet that caused them. When that packet belongs to a translated flow,
 * the quoted headers are translated like the flow's packets and the outer header like a reply:
 *
 *   ingress: an error about a packet we masqueraded (quoted source: uplink address, NAT port)
 *            -> quoted source and outer destination back to the pod's address and port;
 *   egress:  an error about a packet we reverse-translated (quoted destination: the pod)
 *            -> quoted destination and outer source to the uplink address and NAT port.
 *
 * The quoted headers are rewritten in a copy with software checksums (quoted IP header, quoted
 * UDP/TCP/ICMP checksum), and the outer ICMP checksum follows the byte difference. */
#pragma once

#include <linux/bpf.h>
#include <linux/pkt_cls.h>
#include <bpf/bpf_helpers.h>

#include "csum.h"
#include "nat.h"
#include "parse.h"

/* Quoted IP header (no options) plus the first 8 bytes of its L4 header. */
#define QUOTE4_LEN (20 + 8)
#define QUOTE6_LEN (40 + 8)

static __always_inline __s64 port_diff(__be16 from, __be16 to, __s64 seed)
{
	/* A 16-bit field at an even offset sums the same in the low half of a 32-bit word. */
	__u32 f = from, t = to;

	return bpf_csum_diff(&f, sizeof(f), &t, sizeof(t), seed);
}

static __always_inline int icmp_error(struct __sk_buff *skb, const struct pkt *p, const int v6, const int dir)
{
	__u8 q[QUOTE6_LEN] = {}, nq[QUOTE6_LEN];
	const __u32 qlen = v6 ? QUOTE6_LEN : QUOTE4_LEN;
	const __u32 ihl = v6 ? 40 : 20;
	const __u32 qoff = p->l4_off + ICMP_HLEN;
	/* The quoted packet went the other way: on ingress its source is ours, on egress its
	 * destination. */
	const int src_side = dir == DIR_INGRESS;
	__be32 qsaddr[4] = {}, qdaddr[4] = {};
	__be16 qsport = 0, qdport = 0;
	__u8 qproto;
	union nat_key k;
	struct nat_entry *e;
	__be32 to[4] = {};
	__be16 to_port;

	if (qoff + qlen > p->end || bpf_skb_load_bytes(skb, qoff, q, qlen) < 0)
		return TC_NEXT; /* quote too short to say which flow */
	if (v6) {
		if ((q[0] >> 4) != 6)
			return TC_NEXT;
		qproto = q[6];
		__builtin_memcpy(qsaddr, q + 8, 16);
		__builtin_memcpy(qdaddr, q + 24, 16);
	} else {
		if (q[0] != 0x45) /* version 4 without options */
			return TC_NEXT;
		if (((q[6] << 8) | q[7]) & IP_OFFMASK)
			return TC_NEXT; /* a later fragment quoted: no ports */
		qproto = q[9];
		__builtin_memcpy(qsaddr, q + 12, 4);
		__builtin_memcpy(qdaddr, q + 16, 4);
	}

	switch (qproto) {
	case IPPROTO_TCP:
	case IPPROTO_UDP:
		__builtin_memcpy(&qsport, q + ihl, 2);
		__builtin_memcpy(&qdport, q + ihl + 2, 2);
		break;
	case IPPROTO_ICMP:
	case IPPROTO_ICMPV6:
		if ((qproto == IPPROTO_ICMPV6) != !!v6)
			return TC_NEXT;
		if (q[ihl] == (v6 ? ICMPV6_ECHO_REQUEST : ICMP_ECHO))
			__builtin_memcpy(&qsport, q + ihl + 4, 2);
		else if (q[ihl] == (v6 ? ICMPV6_ECHO_REPLY : ICMP_ECHOREPLY))
			__builtin_memcpy(&qdport, q + ihl + 4, 2);
		else
			return TC_NEXT;
		break;
	default:
		return TC_NEXT;
	}

	/* The flow's entry for the direction of the error is keyed by the quoted tuple reversed. */
	nat_key(v6, &k, qdaddr, qsaddr, qdport, qsport, qproto, dir);
	e = nat_lookup(v6, &k);
	if (!e)
		return TC_NEXT;
	addr_copy(v6, to, WORDS(e->addr));
	to_port = e->port;

	const __be32 *from = src_side ? qsaddr : qdaddr;
	const __be16 from_port = src_side ? qsport : qdport;

	if (addr_eq(v6, from, to) && from_port == to_port)
		return TC_NEXT; /* host or inbound flow: nothing was translated */

	__builtin_memcpy(nq, q, sizeof(nq));
	__s64 addr_d = bpf_csum_diff((__be32 *)from, v6 ? 16 : 4, to, v6 ? 16 : 4, 0);
	__u32 aoff = v6 ? (src_side ? 8 : 24) : (src_side ? 12 : 16);

	__builtin_memcpy(nq + aoff, to, v6 ? 16 : 4);
	if (!v6) {
		__u16 check;

		__builtin_memcpy(&check, q + 10, 2);
		check = csum_apply(check, addr_d);
		__builtin_memcpy(nq + 10, &check, 2);
	}

	__u32 poff = ihl + (is_icmp(qproto) ? 4 : (src_side ? 0 : 2));
	__s64 l4_d = port_diff(from_port, to_port, qproto == IPPROTO_ICMP ? 0 : addr_d);
	__u16 check;

	__builtin_memcpy(nq + poff, &to_port, 2);
	if (qproto == IPPROTO_UDP || is_icmp(qproto)) {
		__u32 coff = ihl + l4_csum_off(qproto);

		__builtin_memcpy(&check, q + coff, 2);
		/* A zero UDP checksum means none and stays zero, as in the packet itself
		 * (BPF_F_MARK_MANGLED_0): over IPv6 too, where tunnels may send it (RFC 6936). */
		if (check || qproto != IPPROTO_UDP) {
			check = csum_apply(check, l4_d);
			if (!check && qproto == IPPROTO_UDP)
				check = 0xffff;
			__builtin_memcpy(nq + coff, &check, 2);
		}
	}

	__s64 outer_d = bpf_csum_diff((__be32 *)q, qlen, (__be32 *)nq, qlen, 0);

	if (qproto == IPPROTO_TCP) {
		/* The TCP checksum lies beyond the first 8 bytes; fix it when the quote has it. */
		__u32 toff = qoff + ihl + offsetof(struct tcphdr, check);
		__u32 ow, nw;

		if (toff + 4 <= p->end && bpf_skb_load_bytes(skb, toff, &ow, 4) == 0) {
			__builtin_memcpy(&check, &ow, 2);
			check = csum_apply(check, l4_d);
			nw = ow;
			__builtin_memcpy(&nw, &check, 2);
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
