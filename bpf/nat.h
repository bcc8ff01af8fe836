/* The NAT table: flow state, port allocation, and the fragment table. Netfilter conntrack with
 * MASQUERADE on the same node is the reference for every promise made here. The design (a flow's
 * two entries and how each finds its partner, the confirmed and unreplied tables, what opens a
 * flow, TCP closing, repairs, ports) is in docs/design.md, Flow state: change it with the code. */
#pragma once

#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>

#include "maps.h"
#include "parse.h"

/* Port probes per new mapping before the packet is dropped, and how many of them follow the
 * endpoint's sequence before the rest go random. */
#define NAT_PROBES 128
#define NAT_SEQ_PROBES 4
/* last_seen is rewritten at most this often, to keep flow entries' cache lines quiet. */
#define REFRESH_NS 1000000000ULL
#define TCP_WSCALE_MAX 14
#define TCP_OPT_MAX 40

#define AF_INET 2
#define AF_INET6 10
#define EEXIST 17

/* Which table of a family an entry is in. */
enum nat_table {
	NAT_CONFIRMED = 0,
	NAT_UNREPLIED = 1,
};

union nat_key {
	struct nat4_key k4;
	struct nat6_key k6;
};

/* An address field of the maps' structs (a byte array, 4-byte aligned: see types.h) as the
 * words the packet's addresses are held in. */
#define WORDS(a) ((const __be32 *)(a))
#define WORDS_MUT(a) ((__be32 *)(a))

static __always_inline int addr_eq(const int v6, const __be32 *a, const __be32 *b)
{
	if (!v6)
		return a[0] == b[0];
	return a[0] == b[0] && a[1] == b[1] && a[2] == b[2] && a[3] == b[3];
}

static __always_inline void addr_copy(const int v6, __be32 *dst, const __be32 *src)
{
	dst[0] = src[0];
	if (v6) {
		dst[1] = src[1];
		dst[2] = src[2];
		dst[3] = src[3];
	}
}

static __always_inline void nat_key(const int v6, union nat_key *k, const __be32 *saddr,
				    const __be32 *daddr, __be16 sport, __be16 dport, __u8 proto, __u8 dir)
{
	if (v6) {
		k->k6 = (struct nat6_key){.sport = sport, .dport = dport, .proto = proto, .dir = dir};
		__builtin_memcpy(k->k6.saddr, saddr, 16);
		__builtin_memcpy(k->k6.daddr, daddr, 16);
	} else {
		k->k4 = (struct nat4_key){.sport = sport, .dport = dport, .proto = proto, .dir = dir};
		__builtin_memcpy(k->k4.saddr, saddr, 4);
		__builtin_memcpy(k->k4.daddr, daddr, 4);
	}
}

static __always_inline __u8 key_dir(const int v6, const union nat_key *k)
{
	return v6 ? k->k6.dir : k->k4.dir;
}

/* The key's destination port (the NAT port of an ingress key), rewritten between claims. */
static __always_inline void nat_key_set_dport(const int v6, union nat_key *k, __be16 port)
{
	if (v6)
		k->k6.dport = port;
	else
		k->k4.dport = port;
}

static __always_inline struct nat_entry *nat_get(const int v6, const int tbl, const union nat_key *k)
{
	if (v6) {
		if (tbl == NAT_UNREPLIED)
			return bpf_map_lookup_elem(&nat_new_v6, &k->k6);
		return bpf_map_lookup_elem(&nat_v6, &k->k6);
	}
	if (tbl == NAT_UNREPLIED)
		return bpf_map_lookup_elem(&nat_new_v4, &k->k4);
	return bpf_map_lookup_elem(&nat_v4, &k->k4);
}

static __always_inline int nat_put(const int v6, const int tbl, const union nat_key *k,
				   const struct nat_entry *e, __u64 flags)
{
	if (v6) {
		if (tbl == NAT_UNREPLIED)
			return map_update(&nat_new_v6, &k->k6, e, flags);
		return map_update(&nat_v6, &k->k6, e, flags);
	}
	if (tbl == NAT_UNREPLIED)
		return map_update(&nat_new_v4, &k->k4, e, flags);
	return map_update(&nat_v4, &k->k4, e, flags);
}

static __always_inline void nat_del(const int v6, const int tbl, const union nat_key *k)
{
	if (v6) {
		if (tbl == NAT_UNREPLIED)
			bpf_map_delete_elem(&nat_new_v6, &k->k6);
		else
			bpf_map_delete_elem(&nat_v6, &k->k6);
	} else {
		if (tbl == NAT_UNREPLIED)
			bpf_map_delete_elem(&nat_new_v4, &k->k4);
		else
			bpf_map_delete_elem(&nat_v4, &k->k4);
	}
}

/* nat_get_moved is the entry at k after a lookup of the confirmed table missed it: in the
 * unreplied table, or in the confirmed one after all, when another CPU confirmed the flow in
 * between (confirm inserts a flow's halves into the confirmed table before it deletes them from
 * the unreplied one, so a lookup that misses the unreplied entry finds the confirmed one). *tbl
 * says where it was found. Only a packet of no flow pays the third lookup. */
static __always_inline struct nat_entry *nat_get_moved(const int v6, const union nat_key *k, int *tbl)
{
	struct nat_entry *e = nat_get(v6, NAT_UNREPLIED, k);

	*tbl = NAT_UNREPLIED;
	if (e)
		return e;
	*tbl = NAT_CONFIRMED;
	return nat_get(v6, NAT_CONFIRMED, k);
}

/* nat_lookup finds an entry in either table, confirmed flows first (nat_get_moved). */
static __always_inline struct nat_entry *nat_lookup(const int v6, const union nat_key *k)
{
	struct nat_entry *e = nat_get(v6, NAT_CONFIRMED, k);
	int tbl;

	return e ? e : nat_get_moved(v6, k, &tbl);
}

/* nat_lookup_from finds the entry at k in either table, starting with tbl, where the flow is most
 * likely (the partner of an unreplied entry, a new flow's other key): nat_get_moved finds it in two
 * lookups at most where nat_lookup's miss of the confirmed table takes three. */
static __always_inline struct nat_entry *nat_lookup_from(const int v6, const int tbl, const union nat_key *k)
{
	int found;

	return tbl == NAT_UNREPLIED ? nat_get_moved(v6, k, &found) : nat_lookup(v6, k);
}

/* partner_key computes the key of the other half of the flow whose entry e sits at k. */
static __always_inline void partner_key(const int v6, union nat_key *pk, const union nat_key *k,
					const struct nat_entry *e)
{
	if (v6) {
		const struct nat6_key *a = &k->k6;

		if (a->dir == DIR_EGRESS)
			nat_key(v6, pk, WORDS(a->daddr), WORDS(e->addr), a->dport, e->port, a->proto, DIR_INGRESS);
		else
			nat_key(v6, pk, WORDS(e->addr), WORDS(a->saddr), e->port, a->sport, a->proto, DIR_EGRESS);
	} else {
		const struct nat4_key *a = &k->k4;

		if (a->dir == DIR_EGRESS)
			nat_key(v6, pk, WORDS(a->daddr), WORDS(e->addr), a->dport, e->port, a->proto, DIR_INGRESS);
		else
			nat_key(v6, pk, WORDS(e->addr), WORDS(a->saddr), e->port, a->sport, a->proto, DIR_EGRESS);
	}
}

/* points_back tells whether pe, found at the partner key of the entry at k, belongs to the same
 * flow as that entry, rather than to a flow that took the key over after an eviction. */
static __always_inline int points_back(const int v6, const union nat_key *k, const struct nat_entry *pe)
{
	if (v6) {
		const struct nat6_key *a = &k->k6;

		if (a->dir == DIR_EGRESS)
			return addr_eq(v6, WORDS(pe->addr), WORDS(a->saddr)) && pe->port == a->sport;
		return addr_eq(v6, WORDS(pe->addr), WORDS(a->daddr)) && pe->port == a->dport;
	}
	const struct nat4_key *a = &k->k4;

	if (a->dir == DIR_EGRESS)
		return addr_eq(v6, WORDS(pe->addr), WORDS(a->saddr)) && pe->port == a->sport;
	return addr_eq(v6, WORDS(pe->addr), WORDS(a->daddr)) && pe->port == a->dport;
}

/* partner_value is what the other half of e's flow holds: the side of k that e does not
 * translate (an egress key's source, an ingress key's destination), the flow's shared state, and
 * the opposite direction. */
static __always_inline void partner_value(const int v6, const union nat_key *k, const struct nat_entry *e,
					  struct nat_entry *out, __u64 now)
{
	*out = (struct nat_entry){.kind = e->kind, .slot = e->slot, .last_seen = now,
				  .wscale = NAT_WSCALE_UNKNOWN,
				  .flags = (e->flags & (NAT_F_FIN | NAT_F_RST | NAT_F_REPLIED)) |
					   (e->flags & NAT_F_ORIG ? 0 : NAT_F_ORIG)};
	if (v6) {
		const struct nat6_key *a = &k->k6;

		addr_copy(v6, WORDS_MUT(out->addr), WORDS(a->dir == DIR_EGRESS ? a->saddr : a->daddr));
		out->port = a->dir == DIR_EGRESS ? a->sport : a->dport;
	} else {
		const struct nat4_key *a = &k->k4;

		addr_copy(v6, WORDS_MUT(out->addr), WORDS(a->dir == DIR_EGRESS ? a->saddr : a->daddr));
		out->port = a->dir == DIR_EGRESS ? a->sport : a->dport;
	}
}

/* refresh records the time of a packet, at most once per REFRESH_NS; returns 1 when it did. */
static __always_inline int refresh(struct nat_entry *e, __u64 now)
{
	if (now - e->last_seen < REFRESH_NS)
		return 0;
	e->last_seen = now;
	return 1;
}

static __always_inline int tcp_is_syn(const struct pkt *p)
{
	return p->proto == IPPROTO_TCP && (p->tcp_flags & (TCPF_SYN | TCPF_ACK | TCPF_RST)) == TCPF_SYN;
}

static __always_inline int tcp_is_synack(const struct pkt *p)
{
	return p->proto == IPPROTO_TCP && (p->tcp_flags & (TCPF_SYN | TCPF_ACK | TCPF_RST)) == (TCPF_SYN | TCPF_ACK);
}

/* The rare steps of a known flow's packet run in global functions, which the verifier checks
 * once rather than along every path of the programs; they find the flow's entry again by the key
 * its caller left in nat_scratch. What they are told of the packet: its TCP flags, and PF_TCP. */
#define PF_TCP 0x100

/* The per-CPU working space of a run of the programs: what the global functions are handed
 * beyond their scalar arguments and the packet (parse.h: packet); a global function takes the skb
 * and scalars only (pointers to other memory are Linux 5.12's). It holds nothing from one run to
 * the next, so it is not pinned and no layout has it (pkg/bpf: scratchMaps): its fields may
 * change freely. */
struct nat_scratch {
	union nat_key key; /* the packet's flow key, for egress_new_* and ingress_new_* */
	__be32 to[4];     /* the address xlate_* writes, and egress_new_*'s */
	union nat_key k;  /* the entry of the flow_slow_* and tcp_closing_* calls */
	struct nat_entry cur; /* ... a copy of it, which they read rather than look it up again */
	union nat_key pk; /* ... its partner's key */
	struct nat_entry ne, pv; /* ... values being written */
	union nat_key rk; /* nat_alloc: the reply half's key, whose NAT port nat_probe_* rewrites */
	struct nat_entry rev; /* ... and its value */
	__u32 step;       /* how far the endpoint's port sequence moves on */
	__be32 snat[4];   /* egress_new_*: the uplink's SNAT address, which egress read (snat_set) */
	__u32 snat_set;
	__u8 opt[TCP_OPT_MAX]; /* tcp_wscale_at: the options of a SYN */
	/* icmp_error: an error's quote as read and as rewritten (IPv6 header and 8 bytes of L4),
	 * here rather than on its stack, which the calls above it leave too little of before 6.x
	 * (a chain of calls has 512 bytes in all). */
	__u8 quote[40 + 8], nquote[40 + 8];
	__u32 pad;
};

/* Per CPU: a program runs to its end on one CPU, and neither hook runs inside the other there. */
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct nat_scratch);
} cpu_scratch SEC(".maps");

static __always_inline struct nat_scratch *scratch(void)
{
	__u32 zero = 0;

	return bpf_map_lookup_elem(&cpu_scratch, &zero);
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

/* check_partner makes sure the other half of the flow whose entry e sits at s->k (in table tbl)
 * exists: a missing half is re-created. Returns -1 when another flow holds that key, so this
 * half belongs to a flow that is gone. */
static __always_inline int check_partner(const int v6, const int tbl, struct nat_scratch *s,
					 const struct nat_entry *e, __u64 now)
{
	struct nat_entry *pe;

	partner_key(v6, &s->pk, &s->k, e);
	pe = nat_lookup_from(v6, tbl, &s->pk);
	if (pe)
		return points_back(v6, &s->k, pe) ? 0 : -1;
	partner_value(v6, &s->k, e, &s->ne, now);
	if (nat_put(v6, tbl, &s->pk, &s->ne, BPF_NOEXIST) == 0) {
		event_add(EV_REPAIR, 1);
		return 0;
	}
	pe = nat_lookup(v6, &s->pk); /* created meanwhile by another CPU */
	return pe && points_back(v6, &s->k, pe) ? 0 : -1;
}

/* first_reply marks the flow of e (a half that is not the opener's, seeing its first packet, in
 * table tbl) as replied, on both halves; a missing opener's half is re-created. e is nat_scratch's
 * copy: the flag for the entry itself is returned (flow_slow). */
static __always_inline int first_reply(const int v6, const int tbl, struct nat_scratch *s, struct nat_entry *e,
				       __u64 now)
{
	struct nat_entry *pe;

	e->flags |= NAT_F_REPLIED;
	partner_key(v6, &s->pk, &s->k, e);
	pe = nat_lookup_from(v6, tbl, &s->pk);
	if (pe) {
		if (!points_back(v6, &s->k, pe))
			return -1;
		pe->flags |= NAT_F_REPLIED;
		return NAT_F_REPLIED;
	}
	partner_value(v6, &s->k, e, &s->ne, now);
	if (nat_put(v6, NAT_UNREPLIED, &s->pk, &s->ne, BPF_NOEXIST) == 0)
		event_add(EV_REPAIR, 1);
	return NAT_F_REPLIED;
}

/* confirm moves the flow of e, which proved two-way, from nat_new_* to nat_*. When that table is
 * full the flow stays (and works) where it is, marked so that the next try waits for a refresh
 * (the flag returned, for the entry: e is nat_scratch's copy of it). The entry is gone
 * afterwards. Returns -1 when the other half's key holds another flow.
 *
 * Both halves go into nat_* before either leaves nat_new_* (nat_get_moved relies on it). Another
 * CPU may be confirming the same flow, from either half: the CPU whose insert of e finds it there
 * already leaves the move to the one that made it, which deletes the unreplied halves once both
 * confirmed ones exist (theirs or ours); the CPU that inserted the egress half counts the flow. */
static __always_inline int confirm(const int v6, struct nat_scratch *s, const struct nat_entry *e, __u64 now)
{
	struct nat_entry *pe;
	int err, perr = 0;

	partner_key(v6, &s->pk, &s->k, e);
	pe = nat_get(v6, NAT_UNREPLIED, &s->pk);
	if (!pe)
		pe = nat_get(v6, NAT_CONFIRMED, &s->pk);
	if (pe && !points_back(v6, &s->k, pe))
		return -1;
	if (pe)
		s->pv = *pe;
	else
		partner_value(v6, &s->k, e, &s->pv, now);
	s->ne = *e;
	s->ne.flags &= ~NAT_F_NOROOM;
	s->pv.flags &= ~NAT_F_NOROOM;
	err = nat_put(v6, NAT_CONFIRMED, &s->k, &s->ne, BPF_NOEXIST);
	if (err == -EEXIST)
		return 0; /* another CPU is moving the flow */
	if (err == 0) {
		perr = nat_put(v6, NAT_CONFIRMED, &s->pk, &s->pv, BPF_NOEXIST);
		if (perr != 0 && perr != -EEXIST) { /* EEXIST: another CPU inserted it */
			nat_del(v6, NAT_CONFIRMED, &s->k);
			err = perr;
		}
	}
	if (err != 0) {
		if (!(e->flags & NAT_F_NOROOM)) /* each flow counts once */
			event_add(EV_CONFIRM_FULL, 1);
		return NAT_F_NOROOM;
	}
	nat_del(v6, NAT_UNREPLIED, &s->k);
	nat_del(v6, NAT_UNREPLIED, &s->pk);
	if (key_dir(v6, &s->k) == DIR_EGRESS || perr == 0)
		event_add(EV_CONFIRMED, 1);
	return 0;
}

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

/* flow_slow: the first reply, the move of a flow that proved two-way to the confirmed table,
 * and the partner check of a refresh, for the entry at nat_scratch's k in table tbl, of which
 * nat_scratch's cur is a copy (a lookup less). Returns -1 when the other half's key holds another
 * flow, so that the entry belongs to a flow that is gone, else the flags to set on the entry
 * (none once it moved). */
static __always_inline int flow_slow(const int v6, __u32 tbl, __u32 refreshed, __u32 pflags, __u64 now)
{
	struct nat_scratch *s = scratch();
	struct nat_entry *e;
	int tcp = pflags & PF_TCP;

	if (!s)
		return 0;
	e = &s->cur;
	if (!(e->flags & NAT_F_REPLIED)) {
		/* A reopened flow in the confirmed table gets its reply marked too. */
		if (!(e->flags & NAT_F_ORIG) && !(tcp && (pflags & TCPF_RST)))
			return first_reply(v6, tbl, s, e, now);
	} else if (tbl == NAT_UNREPLIED &&
		   (!tcp || ((e->flags & NAT_F_ORIG) && !(pflags & (TCPF_SYN | TCPF_RST))))) {
		if (!(e->flags & NAT_F_NOROOM) || refreshed)
			return confirm(v6, s, e, now);
	}
	return refreshed ? check_partner(v6, tbl, s, e, now) : 0;
}

__attribute__((noinline)) int flow_slow_v4(__u32 tbl, __u32 refreshed, __u32 pflags, __u64 now)
{
	return flow_slow(0, tbl, refreshed, pflags, now);
}

__attribute__((noinline)) int flow_slow_v6(__u32 tbl, __u32 refreshed, __u32 pflags, __u64 now)
{
	return flow_slow(1, tbl, refreshed, pflags, now);
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

static __always_inline int port_in_ranges(const struct nat_config *cfg, __u16 port)
{
	for (int i = 0; i < MAX_PORT_RANGES; i++) {
		if (i >= cfg->nranges)
			break;
		if (port >= cfg->ranges[i].first && port <= cfg->ranges[i].last)
			return 1;
	}
	return 0;
}

/* port_held: a port outside the ranges that a mapping of an earlier --to-ports still holds. */
static __always_inline int port_held(__u16 port)
{
	__u32 k = port / 64;
	const __u64 *w = bpf_map_lookup_elem(&held_ports, &k);

	return w && (*w >> (port % 64)) & 1;
}

/* port_mapped: a port that a mapping to an uplink address may hold: one of the ranges, or one
 * held since they changed. */
static __always_inline int port_mapped(const struct nat_config *cfg, __u16 port)
{
	return port_in_ranges(cfg, port) || port_held(port);
}

/* endpoint_hash mixes a remote endpoint (address, port, protocol) with the node's secret
 * (murmur3's steps): where its port sequence starts and which port_turns slot it uses. */
static __always_inline __u32 mix32(__u32 h, __u32 v)
{
	v *= 0xcc9e2d51;
	v = (v << 15) | (v >> 17);
	h ^= v * 0x1b873593;
	h = (h << 13) | (h >> 19);
	return h * 5 + 0xe6546b64;
}

static __always_inline __u32 endpoint_hash(const int v6, const struct pkt *p, __u32 seed)
{
	__u32 h = mix32(seed, p->daddr[0]);

	if (v6) {
		h = mix32(h, p->daddr[1]);
		h = mix32(h, p->daddr[2]);
		h = mix32(h, p->daddr[3]);
	}
	h = mix32(h, (__u32)p->dport << 8 | p->proto);
	h ^= h >> 16;
	h *= 0x85ebca6b;
	h ^= h >> 13;
	h *= 0xc2b2ae35;
	return h ^ (h >> 16);
}

/* count_attempts adds an allocation that took n probes to the port_attempts histogram. */
static __always_inline void count_attempts(__u32 n)
{
	__u32 b = 0, sum = PORT_ATTEMPT_SUM;
	__u64 *c;

	while (b < PORT_ATTEMPT_BUCKETS - 1 && (1u << b) < n)
		b++;
	c = bpf_map_lookup_elem(&port_attempts, &b);
	if (c)
		*c += 1;
	c = bpf_map_lookup_elem(&port_attempts, &sum);
	if (c)
		*c += n;
}

/* port_claim claims the ingress key rk (its NAT port set) for the reply half rev: inserted into
 * nat_new_* unless either table holds it. A claim that raced the confirmation of the key's
 * previous owner is given back. */
static __always_inline int port_claim(const int v6, const union nat_key *rk, const struct nat_entry *rev,
				      int precheck)
{
	/* A lookup is cheaper than an insert undone: worth it once a probe has found a port taken. */
	if (precheck && nat_get(v6, NAT_CONFIRMED, rk))
		return -1;
	if (nat_put(v6, NAT_UNREPLIED, rk, rev, BPF_NOEXIST) != 0)
		return -1;
	if (nat_get(v6, NAT_CONFIRMED, rk)) {
		nat_del(v6, NAT_UNREPLIED, rk);
		return -1;
	}
	return 0;
}

/* port_try claims the reply half's key in nat_scratch with port (host order): port_claim. One
 * global function per family, so that the verifier checks a claim once rather than at each of
 * the probes of nat_probe's loop, which it walks one by one. */
static __always_inline int port_try(const int v6, __u32 port, __u32 precheck)
{
	struct nat_scratch *s = scratch();

	if (!s)
		return -1;
	nat_key_set_dport(v6, &s->rk, bpf_htons(port));
	return port_claim(v6, &s->rk, &s->rev, precheck);
}

__attribute__((noinline)) int port_try_v4(__u32 port, __u32 precheck)
{
	return port_try(0, port, precheck);
}

__attribute__((noinline)) int port_try_v6(__u32 port, __u32 precheck)
{
	return port_try(1, port, precheck);
}

/* nat_probe claims a port for the reply half in nat_scratch: orig first when it is not 0, then
 * NAT_SEQ_PROBES ports in a row from index start of the n ports, then random ones. Returns the probes it
 * took, 0 when every one found its port taken. The random probes have a loop of their own, whose
 * state the verifier walks once per probe: one that holds only its counter. */
static __always_inline __u32 nat_probe(const int v6, __u32 n, __u32 start, __u32 orig)
{
	struct nat_scratch *s = scratch();
	__u32 tries = 0;

	if (!s || n == 0 || n > NAT_PORTS_MAX)
		return 0;
	if (orig) {
		tries++;
		if ((v6 ? port_try_v6(orig, 0) : port_try_v4(orig, 0)) == 0) {
			s->step = 0;
			return tries;
		}
	}
	for (__u32 j = 0; j < NAT_SEQ_PROBES; j++) {
		__u32 idx = (start + j) % n;
		__u16 *pp = bpf_map_lookup_elem(&nat_ports, &idx);

		tries++;
		if (!pp)
			continue; /* cannot happen: idx < n <= NAT_PORTS_MAX */
		if ((v6 ? port_try_v6(*pp, tries > 1) : port_try_v4(*pp, tries > 1)) == 0) {
			/* The endpoint's next flow starts after this port. */
			s->step = j + 1;
			return tries;
		}
	}
	for (__u32 i = 0; i < NAT_PROBES - NAT_SEQ_PROBES - 1; i++) {
		__u32 idx = bpf_get_prandom_u32() % n;
		__u16 *pp = bpf_map_lookup_elem(&nat_ports, &idx);

		if (!pp)
			continue;
		if ((v6 ? port_try_v6(*pp, 1) : port_try_v4(*pp, 1)) == 0) {
			s->step = 1; /* a random find moves the sequence on */
			return tries + i + 1;
		}
	}
	/* Without orig, one random probe more: NAT_PROBES in all either way. */
	if (!orig) {
		__u32 idx = bpf_get_prandom_u32() % n;
		__u16 *pp = bpf_map_lookup_elem(&nat_ports, &idx);

		if (pp && (v6 ? port_try_v6(*pp, 1) : port_try_v4(*pp, 1)) == 0) {
			s->step = 1;
			return NAT_PROBES;
		}
	}
	return 0;
}

/* One global function per family: the verifier checks each loop once, not at every call site. */
__attribute__((noinline)) __u32 nat_probe_v4(__u32 n, __u32 start, __u32 orig)
{
	return nat_probe(0, n, start, orig);
}

__attribute__((noinline)) __u32 nat_probe_v6(__u32 n, __u32 start, __u32 orig)
{
	return nat_probe(1, n, start, orig);
}

/* port_pick claims the reply half's key s->rk (port_claim) with a port of the ranges; orig, when
 * not 0, is tried first. A protocol without ports has one key per remote: a flow holding it is a
 * clash, dropped as conntrack's generic tracking drops it. */
static __always_inline int port_pick(const int v6, const struct pkt *p, const struct nat_config *cfg,
				     struct nat_scratch *s, __u32 orig)
{
	__u32 start, turn = 0, probes;
	__u32 *tp = 0;

	if (p->l4 == L4_ADDR) {
		if (port_claim(v6, &s->rk, &s->rev, 0) == 0)
			return 0;
		event_add(EV_DROP_NO_PORT, 1);
		return -1;
	}
	if (cfg->random_fully) {
		start = bpf_get_prandom_u32();
	} else {
		__u32 h = endpoint_hash(v6, p, cfg->port_seed), tk = h & (PORT_TURNS - 1);

		tp = bpf_map_lookup_elem(&port_turns, &tk);
		if (tp)
			turn = *tp;
		start = h + turn;
	}
	probes = v6 ? nat_probe_v6(cfg->nports, start, orig) : nat_probe_v4(cfg->nports, start, orig);
	if (probes == 0) {
		event_add(EV_PORT_RETRY, NAT_PROBES);
		event_add(EV_DROP_NO_PORT, 1);
		return -1;
	}
	event_add(EV_PORT_RETRY, probes - 1);
	count_attempts(probes);
	if (tp && s->step)
		*tp = turn + s->step;
	return 0;
}

/* nat_alloc creates both entries of a new flow translated to (to_addr, a port from the ranges),
 * in nat_new_*: the reply half first, whose claim (port_claim) owns the port toward that remote,
 * then the opener's half, which *out receives (tracked: the packet is its first). Returns 1 when
 * another CPU created the flow's mapping meanwhile, which *out then holds: the flow is not new. */
static __always_inline int nat_alloc(struct __sk_buff *skb, const int v6, const struct pkt *p,
				     const struct nat_config *cfg, const union nat_key *k, const __be32 *to_addr,
				     __u8 kind, __u32 slot, __u64 now, struct nat_entry *out)
{
	struct nat_scratch *s = scratch();
	__u32 orig = 0;

	if (!s)
		return -1;
	s->rev = (struct nat_entry){.port = p->sport, .kind = kind, .slot = slot, .last_seen = now,
				    .wscale = NAT_WSCALE_UNKNOWN};
	addr_copy(v6, WORDS_MUT(s->rev.addr), p->saddr);
	nat_key(v6, &s->rk, p->daddr, to_addr, p->dport, 0, p->proto, DIR_INGRESS);
	if (!cfg->random_fully && port_in_ranges(cfg, bpf_ntohs(p->sport)))
		orig = bpf_ntohs(p->sport);
	if (port_pick(v6, p, cfg, s, orig) < 0)
		return -1;
	*out = (struct nat_entry){.port = v6 ? s->rk.k6.dport : s->rk.k4.dport, .kind = kind, .flags = NAT_F_ORIG,
				  .slot = slot, .last_seen = now, .wscale = NAT_WSCALE_UNKNOWN};
	addr_copy(v6, WORDS_MUT(out->addr), to_addr);
	if (p->proto == IPPROTO_TCP)
		tcp_track(skb, out, p);
	if (nat_put(v6, NAT_UNREPLIED, k, out, BPF_NOEXIST) != 0) {
		/* Another CPU created this flow's mapping meanwhile: release our port, use theirs. */
		struct nat_entry *e;

		nat_del(v6, NAT_UNREPLIED, &s->rk);
		event_add(EV_NAT_RACE, 1);
		e = nat_lookup(v6, k);
		if (!e)
			return -1;
		*out = *e;
		return 1;
	}
	return 0;
}

/* Later fragments carry no ports; the first fragment's are remembered by datagram. */
static __always_inline void frag_remember(const int v6, const struct pkt *p, __u8 dir)
{
	struct frag_ports fp = {.sport = p->sport, .dport = p->dport};

	if (v6) {
		struct frag6_key fk = {.id = p->frag_id, .proto = p->proto, .dir = dir};

		__builtin_memcpy(fk.saddr, p->saddr, 16);
		__builtin_memcpy(fk.daddr, p->daddr, 16);
		bpf_map_update_elem(&frag_v6, &fk, &fp, BPF_ANY);
	} else {
		struct frag4_key fk = {.id = (__be16)p->frag_id, .proto = p->proto, .dir = dir};

		__builtin_memcpy(fk.saddr, p->saddr, 4);
		__builtin_memcpy(fk.daddr, p->daddr, 4);
		bpf_map_update_elem(&frag_v4, &fk, &fp, BPF_ANY);
	}
}

static __always_inline struct frag_ports *frag_lookup(const int v6, const struct pkt *p, __u8 dir)
{
	if (v6) {
		struct frag6_key fk = {.id = p->frag_id, .proto = p->proto, .dir = dir};

		__builtin_memcpy(fk.saddr, p->saddr, 16);
		__builtin_memcpy(fk.daddr, p->daddr, 16);
		return bpf_map_lookup_elem(&frag_v6, &fk);
	}
	struct frag4_key fk = {.id = (__be16)p->frag_id, .proto = p->proto, .dir = dir};

	__builtin_memcpy(fk.saddr, p->saddr, 4);
	__builtin_memcpy(fk.daddr, p->daddr, 4);
	return bpf_map_lookup_elem(&frag_v4, &fk);
}
