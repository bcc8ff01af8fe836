/* TCP state tracking: what each direction of a flow has sent (the latest ACK and window, the end
 * of its segment, the window scale of its SYN), whether a FIN or RST is plausible enough to close
 * the flow, the resync after a new handshake on an old tuple, and the reopening of a closed flow
 * by a new SYN. Conntrack's TCP tracking is the reference; the design is in docs/design.md, Flow
 * state. */
#pragma once

#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>

#include "maps.h"
#include "parse.h"
#include "flow.h"

#define TCP_WSCALE_MAX 14

static __always_inline int tcp_is_syn(const struct pkt *p)
{
	return p->proto == IPPROTO_TCP && (p->tcp_flags & (TCPF_SYN | TCPF_ACK | TCPF_RST)) == TCPF_SYN;
}

static __always_inline int tcp_is_synack(const struct pkt *p)
{
	return p->proto == IPPROTO_TCP && (p->tcp_flags & (TCPF_SYN | TCPF_ACK | TCPF_RST)) == (TCPF_SYN | TCPF_ACK);
}

/* tcp_wscale_at reads the window scale option from the len bytes of TCP options at off: 0 when
 * there is none (RFC 7323), read into nat_scratch. A global function, so that the verifier checks its loop once rather
 * than at every place a SYN is tracked. */
__attribute__((noinline)) int tcp_wscale_at(struct __sk_buff *skb, __u32 off, __u32 len)
{
	struct nat_scratch *s = scratch();
	__u8 *opt;
	__u32 i = 0;

	if (!s || !skb || !size_in(len, TCP_OPT_MAX) || bpf_skb_load_bytes(skb, off, s->opt, len) < 0)
		return 0;
	opt = s->opt;
	/* Every step moves i on, so the loop ends; i is its only counter, which lets the verifier
	 * prune its states. */
	while (i < len && i < TCP_OPT_MAX - 2) {
		__u8 kind, olen;

		kind = opt[i];
		if (kind == 0) /* end of options */
			break;
		if (kind == 1) { /* no-op */
			i++;
			continue;
		}
		olen = opt[i + 1];
		if (olen < 2)
			break;
		if (kind == 3 && olen == 3 && i + 2 < len)
			return opt[i + 2] < TCP_WSCALE_MAX ? opt[i + 2] : TCP_WSCALE_MAX;
		i += olen;
	}
	return 0;
}

static __always_inline __u8 tcp_wscale(struct __sk_buff *skb, const struct pkt *p)
{
	if (p->tcp_hlen <= TCP_HLEN_MIN)
		return 0;
	return tcp_wscale_at(skb, p->l4_off + TCP_HLEN_MIN, p->tcp_hlen - TCP_HLEN_MIN);
}

/* tcp_window is the largest sequence offset beyond its latest ACK that e's direction accepts. */
static __always_inline __u32 tcp_window(const struct nat_entry *e)
{
	__u8 scale = e->wscale == NAT_WSCALE_UNKNOWN ? TCP_WSCALE_MAX : e->wscale;

	return (__u32)e->win << scale;
}

/* tcp_plausible tells whether a FIN or RST (seq, flags) sent in e's direction is one its receiver,
 * whose half is pe, would act on (conntrack's tcp_in_window and its RST rules): within the window
 * the receiver advertised, and for an RST at its next expected byte or right after the sender's
 * last segment. A receiver that acknowledged nothing yet (a flow being opened) has no window to
 * check against. */
static __always_inline int tcp_plausible(__u32 seq, __u8 flags, const struct nat_entry *e,
					 const struct nat_entry *pe)
{
	__u32 off;

	if (!pe || !(pe->flags & NAT_F_ACK))
		return 1;
	off = seq - pe->ack;
	if (off > tcp_window(pe))
		return 0;
	if (!(flags & TCPF_RST))
		return 1;
	return off == 0 || seq == e->end;
}

/* tcp_track records what a TCP packet says of its direction: the latest ACK with its window, the
 * end of the segment, and from a SYN the window scale. An RST says nothing to build on. */
static __always_inline void tcp_track(struct __sk_buff *skb, struct nat_entry *e, const struct pkt *p)
{
	__u8 f = p->tcp_flags;

	if (f & TCPF_RST)
		return;
	if (f & TCPF_SYN)
		e->wscale = tcp_wscale(skb, p);
	if (f & TCPF_ACK) {
		if (!(e->flags & NAT_F_ACK) || (__s32)(p->tcp_ack - e->ack) > 0)
			e->ack = p->tcp_ack;
		if (e->win != p->tcp_win)
			e->win = p->tcp_win;
		if (!(e->flags & NAT_F_ACK))
			e->flags |= NAT_F_ACK;
	}
	e->end = p->tcp_seq + p->tcp_len + !!(f & TCPF_SYN) + !!(f & TCPF_FIN);
}

/* The functions below run inside the global ones: their keys and values live in nat_scratch
 * (s), whose k is the entry e's key, so that their stack stays small. */

/* tcp_closing records a plausible FIN or RST (seq, flags) on the partner of the flow whose entry
 * e sits at s->k, and returns the flag for e's own (0: an implausible one changes nothing). */
static __always_inline int tcp_closing(const int v6, struct nat_scratch *s, const struct nat_entry *e,
				       __u32 seq, __u8 flags)
{
	struct nat_entry *pe;
	__u8 f = flags & TCPF_RST ? NAT_F_RST : NAT_F_FIN;

	partner_key(v6, &s->pk, &s->k, e);
	pe = nat_lookup(v6, &s->pk);
	if (pe && !points_back(v6, &s->k, pe))
		pe = 0;
	if (!tcp_plausible(seq, flags, e, pe)) {
		event_add(EV_TCP_OUT_OF_WINDOW, 1);
		return 0;
	}
	if (pe)
		pe->flags |= f;
	return f;
}

/* tcp_resync: a SYN-ACK from the side of e that did not open the flow, acknowledging exactly the
 * end of the opener's latest segment, answers a SYN that opened a new connection on the flow's
 * tuple (a new ISN, the old connection never seen closing; flow_seen lets it through): the window
 * state starts over from the new handshake, as conntrack gets in sync from a SYN it ignored (its
 * TCP_CONNTRACK_IGNORE case). e, at s->k, acknowledges this ack; the opener's acknowledgment, of
 * the old connection, is forgotten until its next ACK. */
static __always_inline void tcp_resync(const int v6, struct nat_scratch *s, struct nat_entry *e, __u32 ack)
{
	struct nat_entry *pe;

	partner_key(v6, &s->pk, &s->k, e);
	pe = nat_lookup(v6, &s->pk);
	if (!pe || !points_back(v6, &s->k, pe) || !(pe->flags & NAT_F_ORIG) || pe->end != ack)
		return;
	e->ack = ack;
	e->flags |= NAT_F_ACK;
	pe->flags &= ~NAT_F_ACK;
	event_add(EV_REOPEN, 1);
}

/* tcp_closing_*: tcp_closing of the entry at nat_scratch's k, by its copy there; the flag to set on
 * the entry. */
static __always_inline int tcp_closing_at(const int v6, __u32 seq, __u32 flags)
{
	struct nat_scratch *s = scratch();

	return s ? tcp_closing(v6, s, &s->cur, seq, flags) : 0;
}

__attribute__((noinline)) int tcp_closing_v4(__u32 seq, __u32 flags)
{
	return tcp_closing_at(0, seq, flags);
}

__attribute__((noinline)) int tcp_closing_v6(__u32 seq, __u32 flags)
{
	return tcp_closing_at(1, seq, flags);
}

static __always_inline void tcp_resync_at(const int v6, __u32 tbl, __u32 ack)
{
	struct nat_scratch *s = scratch();
	struct nat_entry *e;

	if (!s)
		return;
	e = nat_get(v6, tbl, &s->k);
	if (e)
		tcp_resync(v6, s, e, ack);
}

__attribute__((noinline)) int tcp_resync_v4(__u32 tbl, __u32 ack)
{
	tcp_resync_at(0, tbl, ack);
	return 0;
}

__attribute__((noinline)) int tcp_resync_v6(__u32 tbl, __u32 ack)
{
	tcp_resync_at(1, tbl, ack);
	return 0;
}

/* syn_from_replier: a SYN (no ACK) from the side of e that did not open the flow, once that side
 * answered or the flow closed. Conntrack's table has it invalid (a reply-direction SYN past
 * SYN_SENT) and applies no NAT to it: it passes as it is, changing nothing. Only a simultaneous
 * open (a flow still unreplied) has such a SYN. */
static __always_inline int syn_from_replier(const struct pkt *p, const struct nat_entry *e)
{
	return tcp_is_syn(p) && !(e->flags & NAT_F_ORIG) && (e->flags & (NAT_F_REPLIED | NAT_F_FIN | NAT_F_RST));
}

/* is_reopen: a new SYN on a flow that was closed (a pod reusing its source port). */
static __always_inline int is_reopen(const struct pkt *p, const struct nat_entry *e)
{
	return tcp_is_syn(p) && (e->flags & (NAT_F_FIN | NAT_F_RST));
}

/* reopen starts the state of the flow of e over, with the side that sent the SYN as the opener;
 * the mapping is kept, so the far side sees the same port again. */
static __always_inline void reopen(const int v6, const union nat_key *k, struct nat_entry *e)
{
	union nat_key pk;
	struct nat_entry *pe;

	e->flags = NAT_F_ORIG;
	partner_key(v6, &pk, k, e);
	pe = nat_lookup(v6, &pk);
	if (pe && points_back(v6, k, pe))
		pe->flags = 0;
	event_add(EV_REOPEN, 1);
}
