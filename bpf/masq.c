//go:build ignore

/* The ip-masq-agent SNAT engine: tc programs for the egress and ingress of an uplink.
 *
 * Egress: a packet of a known flow is translated from the NAT table at once. A new flow from
 * the uplink's own address is a host flow: recorded so no pod mapping takes its port. Any
 * other new flow is classified by the policy tries; MASQUERADE gets a mapping to the uplink
 * address and a port from the NAT range.
 * Ingress: replies to a mapping are translated back; new flows toward pod addresses are
 * recorded so their replies leave untouched; ICMP errors quoting a flow are translated.
 * Scope: only what the node's IP stack sent or forwarded is masqueraded (bpf/scope.h); frames
 * that merely pass the uplink's hooks (VLAN-tagged, macvlan and ipvlan children's) pass. */

#include <linux/bpf.h>
#include <linux/pkt_cls.h>
#include <bpf/bpf_helpers.h>

#include "types.h"
#include "maps.h"
#include "parse.h"
#include "csum.h"
#include "policy.h"
#include "nat.h"
#include "icmp.h"
#include "scope.h"

char __license[] SEC("license") = "Dual BSD/GPL";

/* xlate rewrites the source (egress) or destination (ingress) to (to, to_port); fields that
 * already hold the value stay untouched. A failed helper leaves a half-rewritten packet,
 * which is dropped rather than sent. */
static __always_inline int xlate(struct __sk_buff *skb, const struct pkt *p, const int v6, const int source,
				 const __be32 *to, __be16 to_port)
{
	const __be32 *from = source ? p->saddr : p->daddr;
	__be16 from_port = source ? p->sport : p->dport;

	if (!addr_eq(v6, from, to) && rewrite_addr(skb, p, v6, source, from, to) < 0)
		goto drop;
	if (p->l4 != L4_NONE && from_port != to_port && rewrite_port(skb, p, source, from_port, to_port) < 0)
		goto drop;
	return TC_NEXT;
drop:
	event_add(EV_DROP_REWRITE, 1);
	return TC_ACT_SHOT;
}

/* Later fragments: the flow is found through the first fragment's ports; NOT_TRANSLATED when
 * it is not. */
static __always_inline int frag_later(struct __sk_buff *skb, struct pkt *p, const int v6, const int dir)
{
	struct frag_ports *fp = frag_lookup(v6, p, dir);
	union nat_key k;
	struct nat_entry *e;

	if (!fp) {
		event_add(EV_FRAG_MISS, 1);
		return NOT_TRANSLATED;
	}
	nat_key(v6, &k, p->saddr, p->daddr, fp->sport, fp->dport, p->proto, dir);
	e = nat_lookup(v6, &k);
	if (!e)
		return NOT_TRANSLATED;
	if (dir == DIR_EGRESS && e->kind == NAT_MASQ)
		count_rule(e->slot, p->len);
	return xlate(skb, p, v6, dir == DIR_EGRESS, WORDS(e->addr), e->port);
}

static __always_inline const __be32 *uplink_addr(const struct uplink *u, const int v6)
{
	if (!u || !(v6 ? u->has_v6 : u->has_v4))
		return 0;
	return v6 ? WORDS(u->v6) : WORDS(u->v4);
}

/* A host socket's flow: reserve its port toward this remote, or remap it when a pod mapping
 * already holds that port. */
static __always_inline int host_flow(struct __sk_buff *skb, const struct pkt *p, const int v6,
				     const struct nat_config *cfg, const union nat_key *k, __u64 now)
{
	struct nat_entry e = {.port = p->sport, .kind = NAT_HOST, .slot = NO_SLOT, .last_seen = now};
	struct nat_entry *re;
	union nat_key rk;

	addr_copy(v6, WORDS_MUT(e.addr), p->saddr);
	nat_key(v6, &rk, p->daddr, p->saddr, p->dport, p->sport, p->proto, DIR_INGRESS);
	if (nat_update(v6, &rk, &e, BPF_NOEXIST) == 0) {
		e.flags = NAT_F_SEEN;
		nat_update(v6, k, &e, BPF_NOEXIST);
		event_add(EV_HOST_FLOW, 1);
		return TC_NEXT;
	}
	re = nat_lookup(v6, &rk);
	if (re && re->kind == NAT_HOST && points_back(v6, k, re)) {
		/* Our own reservation whose egress half was evicted. */
		e.flags = NAT_F_SEEN;
		nat_update(v6, k, &e, BPF_NOEXIST);
		return TC_NEXT;
	}
	if (nat_alloc(v6, p, cfg, k, p->saddr, NAT_HOST, NO_SLOT, now, &e) < 0)
		return TC_ACT_SHOT;
	event_add(EV_HOST_REMAP, 1);
	return xlate(skb, p, v6, 1, WORDS(e.addr), e.port);
}

static __always_inline int egress_new(struct __sk_buff *skb, struct pkt *p, const int v6,
				      const union nat_key *k, __u64 now)
{
	__u32 zero = 0, ifindex = skb->ifindex, slot;
	const struct nat_config *cfg = bpf_map_lookup_elem(&nat_config, &zero);
	const struct uplink *u = bpf_map_lookup_elem(&uplink_snat, &ifindex);
	const __be32 *snat = uplink_addr(u, v6);
	const struct family_cfg *fc;
	struct nat_entry e;
	__be32 to[4] = {};

	if (!cfg)
		return TC_NEXT;
	fc = family_cfg(cfg, v6);
	if (!fc->enabled)
		return TC_NEXT;
	if (p->l4 == L4_ECHO && !p->echo_request)
		return TC_NEXT; /* an echo reply opens nothing */
	if (!from_node_stack(skb, p, v6, snat))
		return TC_NEXT;
	if (snat && addr_eq(v6, p->saddr, snat))
		return host_flow(skb, p, v6, cfg, k, now);

	if (classify(v6, p->daddr, fc, &slot) == ACTION_RETURN) {
		count_rule(slot, p->len);
		return TC_NEXT;
	}
	count_rule(slot, p->len);
	if (!snat) {
		event_add(EV_DROP_NO_ADDR, 1);
		return TC_ACT_SHOT;
	}
	addr_copy(v6, to, snat);
	if (nat_alloc(v6, p, cfg, k, to, NAT_MASQ, slot, now, &e) < 0)
		return TC_ACT_SHOT;
	if (e.kind == NAT_MASQ)
		event_add(EV_NEW_MASQ, 1);
	if (p->frag == FRAG_FIRST)
		frag_remember(v6, p, DIR_EGRESS);
	return xlate(skb, p, v6, 1, WORDS(e.addr), e.port);
}

/* untranslatable: an egress packet the NAT cannot translate (parse.h: cut short, too many IPv6
 * extension headers, an ICMP type conntrack does not track; an ICMP error quoting no known flow;
 * a later fragment of no known datagram). A pod's (forwarded by the node) to a destination the
 * policy masquerades is dropped and counted rather than sent with the pod's address; the node's
 * own carry the node's addresses, and pass, as do packets the policy leaves alone. */
static __always_inline int untranslatable(struct __sk_buff *skb, const struct pkt *p, const int v6)
{
	__u32 zero = 0, slot;
	const struct nat_config *cfg = bpf_map_lookup_elem(&nat_config, &zero);
	const struct family_cfg *fc;

	if (!cfg)
		return TC_NEXT;
	fc = family_cfg(cfg, v6);
	if (!fc->enabled || !skb->ingress_ifindex || !from_node_stack(skb, p, v6, 0))
		return TC_NEXT;
	if (classify(v6, p->daddr, fc, &slot) == ACTION_RETURN) {
		count_rule(slot, p->len);
		return TC_NEXT;
	}
	count_rule(slot, p->len);
	event_add(EV_DROP_UNTRANSLATABLE, 1);
	return TC_ACT_SHOT;
}

static __always_inline int egress(struct __sk_buff *skb, struct pkt *p, const int v6, __u64 now)
{
	union nat_key k;
	struct nat_entry *e;
	int verdict;

	switch (p->l4) {
	case L4_ICMP_ERROR:
		verdict = icmp_error(skb, p, v6, DIR_EGRESS);
		return verdict == NOT_TRANSLATED ? untranslatable(skb, p, v6) : verdict;
	case L4_NONE:
		verdict = frag_later(skb, p, v6, DIR_EGRESS);
		return verdict == NOT_TRANSLATED ? untranslatable(skb, p, v6) : verdict;
	case L4_UNTRACKED:
	case L4_UNSAFE:
		return untranslatable(skb, p, v6);
	}

	nat_key(v6, &k, p->saddr, p->daddr, p->sport, p->dport, p->proto, DIR_EGRESS);
	e = nat_lookup(v6, &k);
	if (e) {
		if (is_reopen(p, e))
			reopen(v6, &k, e);
		if (!touch(e, p, now) || check_partner(v6, &k, e, p, now) == 0) {
			if (e->kind == NAT_MASQ)
				count_rule(e->slot, p->len);
			if (p->frag == FRAG_FIRST)
				frag_remember(v6, p, DIR_EGRESS);
			return xlate(skb, p, v6, 1, WORDS(e->addr), e->port);
		}
		/* The LRU evicted this flow's ingress half and another flow owns its port now. */
		nat_delete(v6, &k);
		event_add(EV_REALLOC, 1);
	}
	return egress_new(skb, p, v6, &k, now);
}

/* A new flow arriving from outside toward an address behind the uplink (a pod): record both
 * halves as an identity mapping, so that its replies are never masqueraded. */
static __always_inline int ingress_new(struct __sk_buff *skb, const struct pkt *p, const int v6,
				       const union nat_key *k, __u64 now)
{
	__u32 zero = 0, ifindex = skb->ifindex;
	const struct nat_config *cfg;
	const struct uplink *u;
	const __be32 *snat;
	struct nat_entry e = {.port = p->dport, .kind = NAT_INBOUND, .slot = NO_SLOT, .last_seen = now};
	union nat_key ek;

	/* The checks that need no map first: most packets of this path stop here. */
	if (p->l4 == L4_ECHO && !p->echo_request)
		return TC_NEXT;
	cfg = bpf_map_lookup_elem(&nat_config, &zero);
	if (!cfg || !family_cfg(cfg, v6)->enabled)
		return TC_NEXT;
	u = bpf_map_lookup_elem(&uplink_snat, &ifindex);
	snat = uplink_addr(u, v6);
	if (snat && addr_eq(v6, p->daddr, snat))
		return TC_NEXT; /* to the host itself: its replies are host flows */

	/* Only a remote whose traffic the policy masquerades needs its replies protected: replies to
	 * any other remote leave untouched anyway. Recording every flow toward pods would fill the
	 * LRU table with traffic that needs no NAT (pod to pod, replies of RETURN flows), evict
	 * real mappings, and take RETURN flows off the per-packet rule counters. */
	{
		__u32 slot;

		if (classify(v6, p->saddr, family_cfg(cfg, v6), &slot) != ACTION_MASQUERADE)
			return TC_NEXT;
	}
	addr_copy(v6, WORDS_MUT(e.addr), p->daddr);
	nat_key(v6, &ek, p->daddr, p->saddr, p->dport, p->sport, p->proto, DIR_EGRESS);
	if (nat_update(v6, &ek, &e, BPF_NOEXIST) != 0)
		return TC_NEXT; /* that tuple already has a flow */
	e.flags = NAT_F_SEEN;
	nat_update(v6, k, &e, BPF_NOEXIST);
	event_add(EV_INBOUND_FLOW, 1);
	if (p->frag == FRAG_FIRST)
		frag_remember(v6, p, DIR_INGRESS);
	return TC_NEXT;
}

static __always_inline int ingress(struct __sk_buff *skb, struct pkt *p, const int v6, __u64 now)
{
	union nat_key k;
	struct nat_entry *e;
	int verdict;

	/* What ingress cannot translate is for the node's stack as it is: nothing leaks. A packet
	 * with segments left in its IPv6 routing header is not at its destination yet. */
	switch (p->l4) {
	case L4_ICMP_ERROR:
		verdict = icmp_error(skb, p, v6, DIR_INGRESS);
		return verdict == NOT_TRANSLATED ? TC_NEXT : verdict;
	case L4_NONE:
		verdict = frag_later(skb, p, v6, DIR_INGRESS);
		return verdict == NOT_TRANSLATED ? TC_NEXT : verdict;
	case L4_UNTRACKED:
	case L4_UNSAFE:
		return TC_NEXT;
	}
	if (p->transit)
		return TC_NEXT;

	nat_key(v6, &k, p->saddr, p->daddr, p->sport, p->dport, p->proto, DIR_INGRESS);
	e = nat_lookup(v6, &k);
	if (!e)
		return ingress_new(skb, p, v6, &k, now);
	if (is_reopen(p, e))
		reopen(v6, &k, e);
	touch(e, p, now);
	if (p->frag == FRAG_FIRST)
		frag_remember(v6, p, DIR_INGRESS);
	return xlate(skb, p, v6, 0, WORDS(e->addr), e->port);
}

/* hook_seen_mark records that the program ran on this device's hook (see hook_seen). */
static __always_inline void hook_seen_mark(const struct __sk_buff *skb, __u32 dir, __u64 now)
{
	__u32 k = hook_slot(skb->ifindex, dir);
	__u64 *last = bpf_map_lookup_elem(&hook_seen, &k);

	if (last && now - *last >= HOOK_REFRESH_NS)
		*last = now;
}

SEC("tc")
int tc_egress(struct __sk_buff *skb)
{
	__u64 now = bpf_ktime_get_ns();
	struct pkt p = {};

	hook_seen_mark(skb, DIR_EGRESS, now);
	if (skb->vlan_present)
		return TC_NEXT; /* a VLAN sub-interface's frame (bpf/scope.h) */
	switch (parse(skb, &p)) {
	case 4:
		return egress(skb, &p, 0, now);
	case 6:
		return egress(skb, &p, 1, now);
	}
	return TC_NEXT;
}

SEC("tc")
int tc_ingress(struct __sk_buff *skb)
{
	__u64 now = bpf_ktime_get_ns();
	struct pkt p = {};

	hook_seen_mark(skb, DIR_INGRESS, now);
	/* A VLAN sub-interface's frame, or one for another host (a macvlan child), a broadcast or a
	 * multicast: no reply to a flow of ours, and no flow to record. */
	if (skb->vlan_present || skb->pkt_type != PACKET_HOST)
		return TC_NEXT;
	switch (parse(skb, &p)) {
	case 4:
		return ingress(skb, &p, 0, now);
	case 6:
		return ingress(skb, &p, 1, now);
	}
	return TC_NEXT;
}
