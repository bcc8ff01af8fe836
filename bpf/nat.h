/* The NAT's flow state: what a packet of a known flow does to it (flow_seen), on the flow table
 * (flow.h), TCP state tracking (tcp.h) and port allocation (ports.h); fragments' ports are
 * frag.h's. Netfilter conntrack with MASQUERADE on the same node is the reference for every
 * promise made here. The design (a flow's two entries and how each finds its partner, the
 * confirmed and unreplied tables, what opens a flow, TCP closing, repairs, ports) is in
 * docs/design.md, Flow state: change it with the code. */
#pragma once

#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>

#include "maps.h"
#include "parse.h"
#include "flow.h"
#include "tcp.h"

/* scratch_key leaves k in nat_scratch for the global functions; 0 when there is no scratch. */
static __always_inline int scratch_key(const union nat_key *k)
{
	struct nat_scratch *s = scratch();

	if (!s)
		return 0;
	s->k = *k;
	return 1;
}

/* scratch_entry leaves k and a copy of its entry e in nat_scratch for the global functions that
 * read the entry (tcp_closing_*, flow_slow_*): a copy costs less than their lookup of it. */
static __always_inline int scratch_entry(const union nat_key *k, const struct nat_entry *e)
{
	struct nat_scratch *s = scratch();

	if (!s)
		return 0;
	s->k = *k;
	s->cur = *e;
	return 1;
}

/* flow_seen records a packet of the flow whose entry e sits at k in table tbl: TCP state and the
 * time inline (the path of every packet of an established flow), the rest in flow_slow_*
 * (after which e may be gone: callers copy what they need first). Returns -1 when the other
 * half's key holds another flow, so that e belongs to a flow that is gone. */
static __always_inline int flow_seen(struct __sk_buff *skb, const int v6, const int tbl, const union nat_key *k,
				     struct nat_entry *e, const struct pkt *p, __u64 now)
{
	__u32 pflags = 0;
	int refreshed, r;

	if (p->proto == IPPROTO_TCP) {
		pflags = PF_TCP | p->tcp_flags;
		if ((p->tcp_flags & (TCPF_FIN | TCPF_RST)) && scratch_entry(k, e)) {
			r = v6 ? tcp_closing_v6(p->tcp_seq, p->tcp_flags) : tcp_closing_v4(p->tcp_seq, p->tcp_flags);
			if (r)
				e->flags |= r;
		}
		/* A SYN-ACK of the replying side after its first reply, acknowledging something new. */
		if (tcp_is_synack(p) && (e->flags & (NAT_F_ORIG | NAT_F_REPLIED)) == NAT_F_REPLIED &&
		    (!(e->flags & NAT_F_ACK) || p->tcp_ack != e->ack) && scratch_key(k)) {
			if (v6)
				tcp_resync_v6(tbl, p->tcp_ack);
			else
				tcp_resync_v4(tbl, p->tcp_ack);
		}
		tcp_track(skb, e, p);
	}
	refreshed = refresh(e, now);
	if (tbl != NAT_UNREPLIED && (e->flags & NAT_F_REPLIED) && !refreshed)
		return 0; /* an established flow's packet: nothing more to do */
	if (!scratch_entry(k, e))
		return 0;
	r = v6 ? flow_slow_v6(tbl, refreshed, pflags, now) : flow_slow_v4(tbl, refreshed, pflags, now);
	if (r > 0)
		e->flags |= r;
	return r < 0 ? -1 : 0;
}
