/* The flow table: a flow's two entries (each finds its partner by its own key and value), the
 * confirmed and unreplied tables, and the moves between them: the first reply, the confirmation
 * of a flow that proved two-way, the repair of a missing half (flow_slow). Also the per-CPU
 * nat_scratch that the global functions of every header share. The design is in docs/design.md,
 * Flow state (nat.h says what builds on this): change it with the code. */
#pragma once

#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>

#include "maps.h"
#include "parse.h"

/* last_seen is rewritten at most this often, to keep flow entries' cache lines quiet. */
#define REFRESH_NS 1000000000ULL
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
