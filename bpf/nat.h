/* The NAT table: both directions of every flow in one LRU hash per family, port allocation,
 * the state the userspace sweep expires entries by, and the fragment table.
 *
 * A flow has an egress entry (key: the tuple as it leaves) and an ingress entry (key: the
 * tuple of its replies as they arrive). Each entry's value plus its own key give the other
 * entry's key, so either half finds its partner (the sweep and the repair path rely on it):
 *
 *   egress  {s, d, sp, dp} -> {addr A, port P}  partner: ingress {d, A, dp, P}
 *   ingress {s, d, sp, dp} -> {addr A, port P}  partner: egress  {A, s, P, sp}
 *
 * The ingress key of a masqueraded flow is (remote, uplink address, remote port, NAT port):
 * exactly the uniqueness a port needs, so claiming it with BPF_NOEXIST is the allocation. */
#pragma once

#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>

#include "maps.h"
#include "parse.h"

/* Port claims per new mapping before the packet is dropped. */
#define NAT_RETRIES 32
/* last_seen is rewritten at most this often, to keep flow entries' cache lines quiet. */
#define REFRESH_NS 1000000000ULL

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

/* The key's destination port (the NAT port of an ingress key), rewritten between claims. */
static __always_inline void nat_key_set_dport(const int v6, union nat_key *k, __be16 port)
{
	if (v6)
		k->k6.dport = port;
	else
		k->k4.dport = port;
}

static __always_inline struct nat_entry *nat_lookup(const int v6, const union nat_key *k)
{
	if (v6)
		return bpf_map_lookup_elem(&nat_v6, &k->k6);
	return bpf_map_lookup_elem(&nat_v4, &k->k4);
}

static __always_inline long nat_update(const int v6, const union nat_key *k, const struct nat_entry *e,
				       __u64 flags)
{
	if (v6)
		return bpf_map_update_elem(&nat_v6, &k->k6, e, flags);
	return bpf_map_update_elem(&nat_v4, &k->k4, e, flags);
}

static __always_inline void nat_delete(const int v6, const union nat_key *k)
{
	if (v6)
		bpf_map_delete_elem(&nat_v6, &k->k6);
	else
		bpf_map_delete_elem(&nat_v4, &k->k4);
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

/* touch records a packet on an entry: its direction has been seen, TCP closing flags, and
 * the time. Returns 1 when last_seen was refreshed (at most once per REFRESH_NS). */
static __always_inline int touch(struct nat_entry *e, const struct pkt *p, __u64 now)
{
	__u8 f = NAT_F_SEEN;

	if (p->proto == IPPROTO_TCP) {
		if (p->tcp_flags & TCPF_FIN)
			f |= NAT_F_FIN;
		if (p->tcp_flags & TCPF_RST)
			f |= NAT_F_RST;
	}
	if ((e->flags | f) != e->flags)
		e->flags |= f;
	if (now - e->last_seen >= REFRESH_NS) {
		e->last_seen = now;
		return 1;
	}
	return 0;
}

/* is_reopen: a new SYN on a flow that was closed (a pod reusing its source port). The mapping
 * is kept, so the far side sees the same port again, and the flow's state starts over. */
static __always_inline int is_reopen(const struct pkt *p, const struct nat_entry *e)
{
	return p->proto == IPPROTO_TCP && (p->tcp_flags & (TCPF_SYN | TCPF_ACK)) == TCPF_SYN &&
	       (e->flags & (NAT_F_FIN | NAT_F_RST));
}

static __always_inline void reopen(const int v6, const union nat_key *k, struct nat_entry *e)
{
	union nat_key pk;
	struct nat_entry *pe;

	e->flags = 0;
	partner_key(v6, &pk, k, e);
	pe = nat_lookup(v6, &pk);
	if (pe && points_back(v6, k, pe))
		pe->flags = 0;
	event_add(EV_REOPEN, 1);
}

/* check_partner makes sure the ingress half of a flow still exists (the LRU may evict one
 * half alone). A missing half is re-created; returns -1 when another flow has taken the key,
 * so this flow's mapping must be given up. */
static __always_inline int check_partner(const int v6, const union nat_key *k, const struct nat_entry *e,
					 const struct pkt *p, __u64 now)
{
	union nat_key pk;
	struct nat_entry *pe;
	struct nat_entry ne = {.port = p->sport, .kind = e->kind, .slot = NO_SLOT,
			       .last_seen = now};

	partner_key(v6, &pk, k, e);
	pe = nat_lookup(v6, &pk);
	if (pe)
		return points_back(v6, k, pe) ? 0 : -1;
	addr_copy(v6, WORDS_MUT(ne.addr), p->saddr);
	if (nat_update(v6, &pk, &ne, BPF_NOEXIST) == 0) {
		event_add(EV_REPAIR, 1);
		return 0;
	}
	pe = nat_lookup(v6, &pk); /* created meanwhile by another CPU */
	return pe && points_back(v6, k, pe) ? 0 : -1;
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

/* nat_alloc creates both entries of a new flow translated to (to_addr, a port from the
 * ranges). The ingress entry is claimed first with BPF_NOEXIST: whoever inserts it owns the
 * port toward that remote. The original port is tried first unless random_fully; then
 * consecutive ports of the ranges (nat_ports) from a random start. On success *out holds the
 * egress entry. */
static __always_inline int nat_alloc(const int v6, const struct pkt *p, const struct nat_config *cfg,
				     const union nat_key *k, const __be32 *to_addr, __u8 kind, __u32 slot,
				     __u64 now, struct nat_entry *out)
{
	struct nat_entry rev = {.port = p->sport, .kind = kind, .slot = NO_SLOT, .last_seen = now};
	union nat_key rk;
	__u32 n = cfg->nports, start, tries, i;
	__u16 orig = bpf_ntohs(p->sport), port = 0;
	int preserve;

	if (n == 0 || n > NAT_PORTS_MAX)
		return -1;
	addr_copy(v6, WORDS_MUT(rev.addr), p->saddr);
	nat_key(v6, &rk, p->daddr, to_addr, p->dport, 0, p->proto, DIR_INGRESS);
	preserve = !cfg->random_fully && port_in_ranges(cfg, orig);
	start = bpf_get_prandom_u32() % n;
	tries = n < NAT_RETRIES ? n : NAT_RETRIES;
	if (p->l4 == L4_ADDR) {
		/* No ports: one mapping per protocol and remote, as conntrack's generic tracking
		 * (another flow holding it is a clash, which conntrack drops too). */
		preserve = 1;
		tries = 1;
	}

	for (i = 0; i < NAT_RETRIES; i++) {
		if (i >= tries)
			break;
		if (preserve && i == 0) {
			port = orig;
		} else {
			/* start + i < 2n: tries is at most n when n < NAT_RETRIES */
			__u32 idx = start + i >= n ? start + i - n : start + i;
			__u16 *pp = bpf_map_lookup_elem(&nat_ports, &idx);

			if (!pp)
				continue; /* cannot happen: idx < n <= NAT_PORTS_MAX */
			port = *pp;
		}
		nat_key_set_dport(v6, &rk, bpf_htons(port));
		if (nat_update(v6, &rk, &rev, BPF_NOEXIST) == 0)
			break;
	}
	if (i > 0)
		event_add(EV_PORT_RETRY, i);
	if (i >= tries) {
		event_add(EV_DROP_NO_PORT, 1);
		return -1;
	}

	*out = (struct nat_entry){.port = bpf_htons(port), .kind = kind, .flags = NAT_F_SEEN,
				  .slot = slot, .last_seen = now};
	addr_copy(v6, WORDS_MUT(out->addr), to_addr);
	if (nat_update(v6, k, out, BPF_NOEXIST) != 0) {
		/* Another CPU created this flow's mapping meanwhile: release our port, use theirs. */
		struct nat_entry *e;

		nat_delete(v6, &rk);
		event_add(EV_NAT_RACE, 1);
		e = nat_lookup(v6, k);
		if (!e)
			return -1;
		*out = *e;
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
