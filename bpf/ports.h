/* Port allocation: the NAT port of a new flow's mapping, claimed by inserting the reply half's
 * key (port_claim), probed along the remote endpoint's port sequence and then at random
 * (nat_probe), counted in port_attempts; and nat_alloc, which creates a new flow's two entries
 * with it. The design is in docs/design.md, Flow state (Ports). */
#pragma once

#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>

#include "maps.h"
#include "parse.h"
#include "flow.h"
#include "tcp.h"

/* Port probes per new mapping before the packet is dropped, and how many of them follow the
 * endpoint's sequence before the rest go random. */
#define NAT_PROBES 128
#define NAT_SEQ_PROBES 4

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
