//go:build ignore

/* The ip-masq-agent SNAT engine: tc programs for the egress and ingress of an uplink.
 *
 * Egress: a packet of a known flow is translated from the NAT table at once. A new flow from
 * one of the node's own addresses is a host flow: never translated, recorded (when its port is
 * one a pod mapping could take) so no pod mapping takes its port. Any other new flow is classified by the policy tries;
 * MASQUERADE gets a mapping to the rule's masquerade address (the trie value's), else the uplink's,
 * and a port from the NAT range.
 * Ingress: replies to a mapping are translated back; new flows toward addresses behind the node
 * are recorded so their replies leave untouched (and toward others, once a reply shows the node
 * translated them); ICMP errors quoting a flow are translated. Fragments in any order: bpf/frag.h.
 * Scope: only what the node's IP stack sent or forwarded is masqueraded (bpf/scope.h); frames
 * that merely pass the uplink's hooks (VLAN-tagged, macvlan and ipvlan children's) pass.
 * bpf/nat.h has the flow-state design.
 *
 * Where the verifier's work goes: it walks every path of a program, and the paths of inlined code
 * multiply (each state a parse leaves, times each way a flow is found, times each rewrite). A
 * global function (non-static, noinline) is checked once, for any arguments, whatever its callers'
 * states: the entry points parse the packet into a per-CPU map (parse.h: packet), and each
 * family's egress and ingress, its ICMP errors, later fragments, untranslatable packets, new
 * mappings and rewrites run in global functions of their own (name_v4, name_v6), which find the
 * packet there. A global function takes the skb and scalars only; what else it needs is in the
 * per-CPU nat_scratch (flow.h: its fields say whose). The hot path (a packet of an established
 * flow) makes two calls: its family's egress or ingress, and the rewrite. New code that adds paths
 * goes into a global function of its own; TestVerifierComplexity prints the instructions checked
 * and the headroom left. */

#include <linux/bpf.h>
#include <linux/pkt_cls.h>
#include <bpf/bpf_helpers.h>

#include "types.h"
#include "maps.h"
#include "parse.h"
#include "csum.h"
#include "policy.h"
#include "flow.h"
#include "tcp.h"
#include "ports.h"
#include "nat.h"
#include "icmp.h"
#include "scope.h"
#include "frag.h"

char __license[] SEC("license") = "Dual BSD/GPL";

/* xlate rewrites the source (egress) or destination (ingress) of the packet being handled to
 * (to, to_port), to being nat_scratch's; fields that already hold the value stay untouched. A
 * failed helper leaves a half-rewritten packet, which is dropped rather than sent. */
static __always_inline int xlate(struct __sk_buff *skb, const int v6, const int source, __be16 to_port)
{
	struct nat_scratch *s = scratch();
	const struct pkt *p = packet();
	const __be32 *from, *to;
	__be16 from_port;

	if (!s || !p)
		goto drop;
	to = s->to;
	from = source ? p->saddr : p->daddr;
	from_port = source ? p->sport : p->dport;
	if (!addr_eq(v6, from, to) && rewrite_addr(skb, p, v6, source, from, to) < 0)
		goto drop;
	if (p->l4 != L4_NONE && from_port != to_port && rewrite_port(skb, p, source, from_port, to_port) < 0)
		goto drop;
	return TC_NEXT;
drop:
	event_add(EV_DROP_REWRITE, 1);
	return TC_ACT_SHOT;
}

__attribute__((noinline)) int xlate_v4(struct __sk_buff *skb, __u32 source, __u32 to_port)
{
	return xlate(skb, 0, source, to_port);
}

__attribute__((noinline)) int xlate_v6(struct __sk_buff *skb, __u32 source, __u32 to_port)
{
	return xlate(skb, 1, source, to_port);
}

/* xlate_to copies to into nat_scratch and rewrites the packet to (to, to_port): xlate. */
static __always_inline int xlate_to(struct __sk_buff *skb, const int v6, const int source, const __be32 *to,
				    __be16 to_port)
{
	struct nat_scratch *s = scratch();

	if (!s) {
		event_add(EV_DROP_REWRITE, 1);
		return TC_ACT_SHOT;
	}
	addr_copy(v6, s->to, to);
	return v6 ? xlate_v6(skb, source, to_port) : xlate_v4(skb, source, to_port);
}

/* Later fragments: the flow is found through the first fragment's ports; NOT_TRANSLATED when
 * it is not, FRAG_UNSEEN when the first fragment was not seen (bpf/frag.h). */
static __always_inline int frag_later(struct __sk_buff *skb, const int v6, const int dir)
{
	const struct pkt *p = packet();
	struct frag_ports *fp;
	union nat_key k;
	struct nat_entry *e;

	if (!p)
		return NOT_TRANSLATED;
	fp = frag_lookup(v6, p, dir);
	if (!fp)
		return FRAG_UNSEEN;
	nat_key(v6, &k, p->saddr, p->daddr, fp->sport, fp->dport, p->proto, dir);
	e = nat_lookup(v6, &k);
	if (!e)
		return NOT_TRANSLATED;
	if (dir == DIR_EGRESS && e->kind == NAT_MASQ)
		count_rule(e->slot, p->len);
	return xlate_to(skb, v6, dir == DIR_EGRESS, WORDS(e->addr), e->port);
}

__attribute__((noinline)) int frag_later_v4(struct __sk_buff *skb, __u32 dir)
{
	return frag_later(skb, 0, dir);
}

__attribute__((noinline)) int frag_later_v6(struct __sk_buff *skb, __u32 dir)
{
	return frag_later(skb, 1, dir);
}

static __always_inline struct keep_entry *keep_get(const int v6, const union nat_key *k)
{
	if (v6)
		return bpf_map_lookup_elem(&keep_v6, &k->k6);
	return bpf_map_lookup_elem(&keep_v4, &k->k4);
}

static __always_inline void keep_del(const int v6, const union nat_key *k)
{
	if (v6)
		bpf_map_delete_elem(&keep_v6, &k->k6);
	else
		bpf_map_delete_elem(&keep_v4, &k->k4);
}

/* keep_return records that a flow was left alone, so it keeps that verdict. */
static __always_inline void keep_return(const int v6, const union nat_key *k, __u32 slot, __u64 now)
{
	struct keep_entry ke = {.slot = slot, .last_seen = now};
	int err = v6 ? map_update(&keep_v6, &k->k6, &ke, BPF_NOEXIST)
		     : map_update(&keep_v4, &k->k4, &ke, BPF_NOEXIST);

	if (err == 0)
		event_add(EV_KEEP_RETURN, 1);
}

/* keep_packet: a packet of a flow left alone. A pod's FIN or RST marks its TCP connection closing
 * (its own word: no window to check), for the sweep's shorter timeout. */
static __always_inline int keep_packet(struct keep_entry *ke, const struct pkt *p, __u64 now)
{
	count_rule(ke->slot, p->len);
	if (p->tcp_flags & (TCPF_FIN | TCPF_RST) && p->proto == IPPROTO_TCP && !ke->closing)
		ke->closing = 1;
	if (now - ke->last_seen >= REFRESH_NS)
		ke->last_seen = now;
	return TC_NEXT;
}

/* keep_reply refreshes the kept verdict of the flow whose reply p is, if any, and tells whether it
 * is one: conntrack refreshes a connection on either direction's packets, so a flow whose far side
 * does the talking keeps its verdict while it talks. Only the pod's FIN or RST marks it closing
 * (keep_packet): a kept flow has no window to tell the far side's plausible ones by. */
static __always_inline int keep_reply(const int v6, const struct pkt *p, __u64 now)
{
	union nat_key ek;
	struct keep_entry *ke;

	nat_key(v6, &ek, p->daddr, p->saddr, p->dport, p->sport, p->proto, DIR_EGRESS);
	ke = keep_get(v6, &ek);
	if (!ke)
		return 0;
	if (now - ke->last_seen >= REFRESH_NS)
		ke->last_seen = now;
	return 1;
}

/* inbound_orphan restores the egress half of an inbound flow that the LRU evicted, when the packet
 * at k is the pod's reply to it: the reply then leaves untouched instead of being masqueraded.
 * Returns 1 when it did. */
static __always_inline int inbound_orphan(const int v6, const struct pkt *p, const union nat_key *k, __u64 now)
{
	struct nat_scratch *s = scratch();
	struct nat_entry *ie;

	if (!s)
		return 0;
	nat_key(v6, &s->pk, p->daddr, p->saddr, p->dport, p->sport, p->proto, DIR_INGRESS);
	ie = nat_get(v6, NAT_UNREPLIED, &s->pk);
	if (!ie || ie->kind != NAT_INBOUND || !points_back(v6, &s->pk, ie))
		return 0;
	ie->flags |= NAT_F_REPLIED;
	partner_value(v6, &s->pk, ie, &s->ne, now);
	if (nat_put(v6, NAT_UNREPLIED, k, &s->ne, BPF_NOEXIST) == 0)
		event_add(EV_REPAIR, 1);
	return 1;
}

/* The inbound openers toward addresses not behind the node (inbound_v4/v6), by their replies'
 * egress key. */
static __always_inline struct nat_entry *inbound_get(const int v6, const union nat_key *k)
{
	if (v6)
		return bpf_map_lookup_elem(&inbound_v6, &k->k6);
	return bpf_map_lookup_elem(&inbound_v4, &k->k4);
}

static __always_inline void inbound_hold(const int v6, const union nat_key *k, const struct nat_entry *e)
{
	if (v6)
		bpf_map_update_elem(&inbound_v6, &k->k6, e, BPF_ANY);
	else
		bpf_map_update_elem(&inbound_v4, &k->k4, e, BPF_ANY);
}

static __always_inline void inbound_del(const int v6, const union nat_key *k)
{
	if (v6)
		bpf_map_delete_elem(&inbound_v6, &k->k6);
	else
		bpf_map_delete_elem(&inbound_v4, &k->k4);
}

/* How long an inbound opener waits for its reply: conntrack's longest wait for an unanswered
 * connection (nf_conntrack_tcp_timeout_syn_sent). */
#define INBOUND_WAIT_NS (120 * 1000000000ULL)

/* inbound_translated: the packet at k, which leaves with a source address that is not behind the
 * node, is the reply to an opener that ingress held for it (inbound_v4/v6): the node's stack
 * translated that opener's destination to an address behind the node (kube-proxy's DNAT, whose
 * conntrack translates the reply back). The flow becomes an inbound one, both halves recorded as
 * ingress records one toward a pod, with this reply seen; the reply leaves untouched. Returns 1
 * when it did. */
static __always_inline int inbound_translated(struct __sk_buff *skb, const int v6, const struct pkt *p,
					      const union nat_key *k, __u64 now)
{
	struct nat_scratch *s = scratch();
	struct nat_entry *held = inbound_get(v6, k);

	if (!s || !held)
		return 0;
	if (now - held->last_seen > INBOUND_WAIT_NS) {
		inbound_del(v6, k);
		return 0;
	}
	s->ne = *held;
	s->ne.flags |= NAT_F_REPLIED;
	inbound_del(v6, k);
	nat_key(v6, &s->pk, p->daddr, p->saddr, p->dport, p->sport, p->proto, DIR_INGRESS);
	if (nat_lookup(v6, &s->pk) || nat_put(v6, NAT_UNREPLIED, &s->pk, &s->ne, BPF_NOEXIST) != 0)
		return 0; /* that tuple has another flow now */
	partner_value(v6, &s->pk, &s->ne, &s->pv, now);
	if (p->proto == IPPROTO_TCP)
		tcp_track(skb, &s->pv, p);
	if (nat_put(v6, NAT_UNREPLIED, k, &s->pv, BPF_NOEXIST) != 0) {
		nat_del(v6, NAT_UNREPLIED, &s->pk);
		return 0;
	}
	event_add(EV_INBOUND_FLOW, 1);
	return 1;
}

/* What the helpers below return besides a verdict: FLOW_NEW, a packet that opens a flow needing a
 * new mapping; FLOW_REMAP, a packet of a masqueraded flow that lost its port and needs another. */
#define FLOW_NEW 0x100
#define FLOW_REMAP 0x101

/* A host socket's packet of no known flow, its source port inside the NAT range: reserve the
 * port toward this remote; FLOW_NEW when a pod mapping already holds it, so the host flow must
 * be remapped. */
static __always_inline int host_reserve(struct __sk_buff *skb, const struct pkt *p, const int v6,
					const union nat_key *k, __u64 now)
{
	struct nat_scratch *s = scratch();
	struct nat_entry *re;

	if (!s)
		return TC_NEXT;
	s->rev = (struct nat_entry){.port = p->sport, .kind = NAT_HOST, .slot = NO_SLOT, .last_seen = now,
				    .wscale = NAT_WSCALE_UNKNOWN};
	addr_copy(v6, WORDS_MUT(s->rev.addr), p->saddr);
	nat_key(v6, &s->rk, p->daddr, p->saddr, p->dport, p->sport, p->proto, DIR_INGRESS);
	if (port_claim(v6, &s->rk, &s->rev, 1) == 0) {
		s->rev.flags = NAT_F_ORIG;
		if (p->proto == IPPROTO_TCP)
			tcp_track(skb, &s->rev, p);
		nat_put(v6, NAT_UNREPLIED, k, &s->rev, BPF_NOEXIST);
		event_add(EV_HOST_FLOW, 1);
		return TC_NEXT;
	}
	re = nat_lookup(v6, &s->rk);
	if (re && re->kind == NAT_HOST && points_back(v6, k, re)) {
		/* Our own reservation whose egress half was evicted. */
		partner_value(v6, &s->rk, re, &s->ne, now);
		if (nat_put(v6, NAT_UNREPLIED, k, &s->ne, BPF_NOEXIST) == 0)
			event_add(EV_REPAIR, 1);
		return TC_NEXT;
	}
	return FLOW_NEW;
}

/* A pod's packet of no known flow: the policy decides. FLOW_NEW (with *slot, the deciding rule,
 * and *to, its masquerade address or 0 for the uplink's) when it opens a masqueraded flow. Only a
 * TCP SYN opens a TCP mapping: any other TCP packet to a masqueraded destination belongs to a
 * connection whose state is gone (or that began before the agent), which no mapping can serve,
 * and is dropped rather than sent with the pod's address. */
static __always_inline int pod_decide(struct __sk_buff *skb, const struct pkt *p, const int v6,
				      const struct nat_config *cfg, const union nat_key *k, __u64 now, __u32 *slot,
				      const __be32 **to)
{
	if (p->l4 == L4_ECHO && !p->echo_request)
		return TC_NEXT; /* an echo reply opens nothing */
	if (classify_snat(v6, p->saddr, p->daddr, cfg, slot, to) == ACTION_RETURN) {
		count_rule(*slot, p->len);
		keep_return(v6, k, *slot, now);
		return TC_NEXT;
	}
	/* Inbound flows exist only toward remotes the policy masquerades. */
	if (!tcp_is_syn(p) && (inbound_orphan(v6, p, k, now) || inbound_translated(skb, v6, p, k, now)))
		return TC_NEXT;
	count_rule(*slot, p->len);
	if (p->proto == IPPROTO_TCP && !tcp_is_syn(p)) {
		event_add(EV_DROP_UNTRANSLATABLE, 1);
		return TC_ACT_SHOT;
	}
	return FLOW_NEW;
}

/* A packet of no known flow leaving (its key in nat_scratch): a host flow's reservation (from any
 * of the node's addresses: bpf/scope.h), or the policy's verdict, and the new mapping either may
 * need (the one place that allocates ports), to the host's own address, the rule's masquerade
 * address or else the uplink's, written into nat_scratch's to. A masqueraded
 * flow that lost its port (remap, to holding the address it was translated to) keeps its verdict,
 * rule (slot) and address, as conntrack keeps a flow's binding. */
static __always_inline int egress_new(struct __sk_buff *skb, const int v6, __u64 now, int remap, __u32 slot)
{
	__u32 zero = 0;
	const struct nat_config *cfg = bpf_map_lookup_elem(&nat_config, &zero);
	struct nat_scratch *s = scratch();
	const struct pkt *p = packet();
	const __be32 *rule_to = 0, *snat;
	const union nat_key *k;
	struct nat_entry e;
	__be32 *to;
	int origin, host, r;

	if (!cfg || !s || !p)
		return TC_NEXT;
	k = &s->key;
	to = s->to;
	snat = s->snat_set ? s->snat : 0; /* egress read it */
	origin = from_node_stack(skb, p, v6, snat);
	if (origin == FROM_ELSEWHERE)
		return TC_NEXT;
	host = origin == FROM_HOST;
	/* A host listener's SYN-ACK answers a connection opened from outside, which the host's next
	 * packet records once the far side completed the handshake: a SYN flood at a listener on a
	 * port of the range costs the table nothing. */
	if (host && !remap && tcp_is_synack(p))
		return TC_NEXT;
	if (host)
		r = host_reserve(skb, p, v6, k, now);
	else
		r = remap ? FLOW_NEW : pod_decide(skb, p, v6, cfg, k, now, &slot, &rule_to);
	if (r != FLOW_NEW)
		return r;
	if (host) {
		addr_copy(v6, to, p->saddr); /* a host flow keeps its address, on another port */
	} else if (!remap) {
		if (rule_to)
			snat = rule_to;
		if (!snat) {
			event_add(EV_DROP_NO_ADDR, 1);
			return TC_ACT_SHOT;
		}
		addr_copy(v6, to, snat);
	}
	r = nat_alloc(skb, v6, p, cfg, k, to, host ? NAT_HOST : NAT_MASQ, slot, now, &e);
	if (r < 0)
		return TC_ACT_SHOT;
	if (r == 0)
		event_add(host ? EV_HOST_REMAP : EV_NEW_MASQ, 1);
	return xlate_to(skb, v6, 1, WORDS(e.addr), e.port);
}

__attribute__((noinline)) int egress_new_v4(struct __sk_buff *skb, __u64 now, __u32 remap, __u32 slot)
{
	return egress_new(skb, 0, now, remap, slot);
}

__attribute__((noinline)) int egress_new_v6(struct __sk_buff *skb, __u64 now, __u32 remap, __u32 slot)
{
	return egress_new(skb, 1, now, remap, slot);
}

/* untranslatable: an egress packet the NAT cannot translate (parse.h: cut short, too many IPv6
 * extension headers, an ICMP type conntrack does not track; an ICMP error quoting no known flow;
 * a later fragment of no known datagram). A pod's (forwarded by the node) to a destination the
 * policy masquerades is dropped and counted rather than sent with the pod's address; the node's
 * own carry the node's addresses, and pass, as do packets the policy leaves alone. */
static __always_inline int untranslatable(struct __sk_buff *skb, const int v6)
{
	__u32 zero = 0, slot;
	const struct nat_config *cfg = bpf_map_lookup_elem(&nat_config, &zero);
	const struct pkt *p = packet();
	const struct family_cfg *fc;

	if (!cfg || !p)
		return TC_NEXT;
	fc = family_cfg(cfg, v6);
	if (!fc->enabled || !ingress_ifindex(skb) || from_node_stack(skb, p, v6, snat_addr(skb, v6)) != FROM_POD)
		return TC_NEXT;
	if (classify(v6, p->saddr, p->daddr, cfg, &slot) == ACTION_RETURN) {
		count_rule(slot, p->len);
		return TC_NEXT;
	}
	count_rule(slot, p->len);
	event_add(EV_DROP_UNTRANSLATABLE, 1);
	return TC_ACT_SHOT;
}

__attribute__((noinline)) int untranslatable_v4(struct __sk_buff *skb)
{
	return untranslatable(skb, 0);
}

__attribute__((noinline)) int untranslatable_v6(struct __sk_buff *skb)
{
	return untranslatable(skb, 1);
}

/* frag_first remembers a first fragment's ports for its later fragments, whatever its flow (they
 * then tell a datagram that needs no translation from one whose first fragment was not seen), and
 * sends its held later fragments again after it (bpf/frag.h): NOT_HELD when there were none, and
 * the packet goes on. A global function per family: the key it builds stays off its callers'
 * stacks. */
static __always_inline int frag_first(struct __sk_buff *skb, const int v6, __u8 dir)
{
	const struct pkt *p = packet();

	if (!p)
		return NOT_HELD;
	frag_remember(v6, p, dir);
	return v6 ? frag_release_v6(skb, dir) : frag_release_v4(skb, dir);
}

__attribute__((noinline)) int frag_first_v4(struct __sk_buff *skb, __u32 dir)
{
	return frag_first(skb, 0, dir);
}

__attribute__((noinline)) int frag_first_v6(struct __sk_buff *skb, __u32 dir)
{
	return frag_first(skb, 1, dir);
}

/* frag_next translates a later fragment by its datagram's flow, or holds it until the first
 * fragment comes (bpf/frag.h); NOT_TRANSLATED for the caller to decide. */
static __always_inline int frag_next(struct __sk_buff *skb, const int v6, __u8 dir, __u64 now)
{
	int verdict = v6 ? frag_later_v6(skb, dir) : frag_later_v4(skb, dir);

	if (verdict == FRAG_UNSEEN)
		verdict = v6 ? frag_wait_v6(skb, dir, now) : frag_wait_v4(skb, dir, now);
	return verdict;
}

/* The egress verdict of a packet that icmp_error or frag_later did not translate. */
static __always_inline int untranslated(struct __sk_buff *skb, const int v6, int verdict)
{
	if (verdict != NOT_TRANSLATED)
		return verdict;
	return v6 ? untranslatable_v6(skb) : untranslatable_v4(skb);
}

/* A packet of a known flow leaving: its state recorded, then translated. FLOW_NEW when the flow
 * starts over (a closed connection reopened under another verdict), FLOW_REMAP (with *slot, and
 * its address in nat_scratch's to) when its port was taken over. */
static __always_inline int egress_known(struct __sk_buff *skb, const struct pkt *p, struct nat_scratch *s,
					const int v6, const int tbl, struct nat_entry *e, __u64 now, __u32 ifindex,
					__u32 *remap_slot)
{
	const union nat_key *k = &s->key;
	__be16 to_port;
	__u8 kind = e->kind;
	__u32 slot = e->slot;

	if (is_reopen(p, e)) {
		/* nslot is read only where classify_snat set it, but verifiers before 6.8 lose that
		 * (kind is spilled as 32 bits) and refuse the read of an uninitialised register. */
		__u32 zero = 0, nslot = slot;
		const struct nat_config *cfg = bpf_map_lookup_elem(&nat_config, &zero);
		const __be32 *rule_to, *now_to;
		int keep = kind == NAT_HOST;

		/* A new connection: it follows the policy in force now. One still masqueraded to the
		 * same address keeps its port (the far side sees it again); any other starts over as a
		 * new flow, as conntrack binds a new connection by the rules in force. */
		if (kind == NAT_MASQ && cfg &&
		    classify_snat(v6, p->saddr, p->daddr, cfg, &nslot, &rule_to) == ACTION_MASQUERADE) {
			now_to = rule_to ? rule_to : uplink_snat_of(ifindex, v6);
			keep = now_to && addr_eq(v6, now_to, WORDS(e->addr));
		}
		if (keep) {
			if (kind == NAT_MASQ)
				e->slot = slot = nslot;
			reopen(v6, k, e);
		} else {
			partner_key(v6, &s->pk, k, e);
			nat_del(v6, tbl, &s->pk);
			nat_del(v6, tbl, k);
			return FLOW_NEW;
		}
	}
	if (syn_from_replier(p, e))
		return TC_NEXT; /* an inbound flow's pod, the only replier egress sees: untranslated */
	addr_copy(v6, s->to, WORDS(e->addr));
	to_port = e->port;
	if (flow_seen(skb, v6, tbl, k, e, p, now) < 0) {
		/* The LRU evicted this flow's ingress half and another flow owns its port now. */
		nat_del(v6, tbl, k);
		event_add(EV_REALLOC, 1);
		*remap_slot = slot;
		return FLOW_REMAP;
	}
	if (kind == NAT_MASQ)
		count_rule(slot, p->len);
	return v6 ? xlate_v6(skb, 1, to_port) : xlate_v4(skb, 1, to_port);
}

/* node_sent tells whether the packet being handled, sent by the node, comes from one of its
 * addresses: a global function per family, so that the FIB lookup's request stays off its
 * caller's stack. */
static __always_inline int node_sent(struct __sk_buff *skb, const int v6)
{
	const struct pkt *p = packet();

	return p && from_node_stack(skb, p, v6, 0) == FROM_HOST;
}

__attribute__((noinline)) int node_sent_v4(struct __sk_buff *skb)
{
	return node_sent(skb, 0);
}

__attribute__((noinline)) int node_sent_v6(struct __sk_buff *skb)
{
	return node_sent(skb, 1);
}

/* host_source tells whether the packet is the node's own, from one of its addresses: the uplink's
 * (snat) needs no FIB lookup, and a packet the node forwarded is a pod's. */
static __always_inline int host_source(struct __sk_buff *skb, const struct pkt *p, const int v6, const __be32 *snat)
{
	if (snat && addr_eq(v6, p->saddr, snat))
		return 1;
	if (ingress_ifindex(skb))
		return 0;
	return v6 ? node_sent_v6(skb) : node_sent_v4(skb);
}

/* egress handles the packet being handled (parse_packet), leaving by the uplink. */
static __always_inline int egress(struct __sk_buff *skb, const int v6, __u64 now)
{
	__u32 zero = 0, slot = NO_SLOT, ifindex = skb->ifindex;
	const struct nat_config *cfg = bpf_map_lookup_elem(&nat_config, &zero);
	struct nat_scratch *s = scratch();
	const struct pkt *p = packet();
	const __be32 *snat;
	union nat_key *k;
	struct nat_entry *e;
	int tbl = NAT_CONFIRMED, remap = 0;

	if (!cfg || !s || !p || !family_cfg(cfg, v6)->enabled)
		return TC_NEXT;
	if (p->frag == FRAG_FIRST) {
		int verdict = v6 ? frag_first_v6(skb, DIR_EGRESS) : frag_first_v4(skb, DIR_EGRESS);

		if (verdict != NOT_HELD)
			return verdict;
	}
	switch (p->l4) {
	case L4_ICMP_ERROR:
		return untranslated(skb, v6, v6 ? icmp_error_v6(skb, DIR_EGRESS) : icmp_error_v4(skb, DIR_EGRESS));
	case L4_NONE:
		return untranslated(skb, v6, frag_next(skb, v6, DIR_EGRESS, now));
	case L4_UNTRACKED:
	case L4_UNSAFE:
		return v6 ? untranslatable_v6(skb) : untranslatable_v4(skb);
	}

	snat = uplink_snat_of(ifindex, v6);
	/* For egress_new_*, which would look it up again. */
	s->snat_set = snat != 0;
	if (snat)
		addr_copy(v6, s->snat, snat);
	/* A host port outside the range is one no pod mapping can take: host traffic there, from
	 * any of the node's addresses, is neither looked up nor recorded (a protocol without ports
	 * has one mapping per remote, which any pod flow could take). A held port (port_held) is
	 * recorded: toward a remote a pod's flow holds it for, the host flow moves off it. */
	if (p->l4 != L4_ADDR && host_source(skb, p, v6, snat) && !port_mapped(cfg, bpf_ntohs(p->sport)))
		return TC_NEXT;
	k = &s->key;
	nat_key(v6, k, p->saddr, p->daddr, p->sport, p->dport, p->proto, DIR_EGRESS);
	if (tcp_is_syn(p)) {
		/* A bare SYN is most often a new flow's, or a retransmission of one still unreplied:
		 * looked up in that table first (nat_get_moved), two lookups where a miss of the
		 * confirmed table first takes three. It opens a new connection, which follows the
		 * policy in force now: a kept verdict of the tuple ends. */
		e = nat_get_moved(v6, k, &tbl);
		if (!e && keep_get(v6, k))
			keep_del(v6, k);
	} else if (!(e = nat_get(v6, NAT_CONFIRMED, k))) {
		/* Kept verdicts are of pod flows: a host's packet finds none. */
		struct keep_entry *ke = keep_get(v6, k);

		if (ke)
			return keep_packet(ke, p, now);
		e = nat_get_moved(v6, k, &tbl);
	}
	if (e) {
		int r = egress_known(skb, p, s, v6, tbl, e, now, ifindex, &slot);

		if (r == FLOW_REMAP)
			remap = 1;
		else if (r != FLOW_NEW)
			return r;
	}
	return v6 ? egress_new_v6(skb, now, remap, slot) : egress_new_v4(skb, now, remap, slot);
}

__attribute__((noinline)) int egress_v4(struct __sk_buff *skb, __u64 now)
{
	return egress(skb, 0, now);
}

__attribute__((noinline)) int egress_v6(struct __sk_buff *skb, __u64 now)
{
	return egress(skb, 1, now);
}

/* local_dest tells whether the destination of an inbound packet is behind this node: delivered
 * to it (or not forwarded at all), or routed out another device than the one it came by, as the
 * kernel's routing (policy rules included) decides for this very packet. That device may be an
 * uplink too (a pods' device whose routes make it one, another uplink): its egress masquerades
 * the flow where the policy says so, as POSTROUTING does, and the replies, translated back on
 * its ingress, must leave here untouched. A packet routed back out the device it came by is
 * not for this node. */
static __always_inline int local_dest(struct __sk_buff *skb, const struct pkt *p, const int v6)
{
	struct bpf_fib_lookup fib = {.family = v6 ? AF_INET6 : AF_INET, .l4_protocol = p->proto,
				     .sport = p->sport, .dport = p->dport, .ifindex = skb->ifindex};

	if (v6) {
		__builtin_memcpy(fib.ipv6_src, p->saddr, 16);
		__builtin_memcpy(fib.ipv6_dst, p->daddr, 16);
	} else {
		fib.ipv4_src = p->saddr[0];
		fib.ipv4_dst = p->daddr[0];
	}
	switch (bpf_fib_lookup(skb, &fib, sizeof(fib), 0)) {
	case BPF_FIB_LKUP_RET_SUCCESS:
	case BPF_FIB_LKUP_RET_NO_NEIGH:
		return fib.ifindex != skb->ifindex;
	case BPF_FIB_LKUP_RET_NOT_FWDED:   /* a local address */
	case BPF_FIB_LKUP_RET_FWD_DISABLED: /* nothing is routed on: only the node can take it */
		return 1;
	}
	return 0;
}

/* is_opener: a packet that may open a flow from outside. UDP and protocols without connections
 * have no opening packet: any datagram opens, as in conntrack. */
static __always_inline int is_opener(const struct pkt *p)
{
	if (p->proto == IPPROTO_TCP)
		return tcp_is_syn(p);
	if (p->l4 == L4_ECHO)
		return p->echo_request;
	return 1;
}

/* A packet of no known flow arriving (its key in nat_scratch): a flow opened from outside toward
 * an address behind the uplink (a pod) gets both halves recorded as an identity mapping, so that
 * its replies are never masqueraded. */
static __always_inline int ingress_new(struct __sk_buff *skb, const int v6, __u64 now)
{
	__u32 zero = 0, slot;
	const struct pkt *p = packet();
	const struct nat_config *cfg;
	struct nat_scratch *s;
	const __be32 *snat;
	const union nat_key *k;
	struct nat_entry e;
	union nat_key ek;

	/* The checks that need no map first: most packets of this path stop here. */
	if (!p || !is_opener(p))
		return TC_NEXT;
	cfg = bpf_map_lookup_elem(&nat_config, &zero);
	s = scratch();
	if (!cfg || !s)
		return TC_NEXT;
	k = &s->key;
	snat = snat_addr(skb, v6);
	if (snat && addr_eq(v6, p->daddr, snat))
		return TC_NEXT; /* to the host itself: its replies are host flows */
	/* Only a remote whose traffic the policy masquerades needs its replies protected: replies to
	 * any other remote leave untouched anyway. The pod (the destination) is the replies' source,
	 * which picks the source rule. */
	if (classify(v6, p->daddr, p->saddr, cfg, &slot) != ACTION_MASQUERADE)
		return TC_NEXT;
	e = (struct nat_entry){.port = p->dport, .kind = NAT_INBOUND, .slot = NO_SLOT, .last_seen = now,
			       .wscale = NAT_WSCALE_UNKNOWN};
	addr_copy(v6, WORDS_MUT(e.addr), p->daddr);
	nat_key(v6, &ek, p->daddr, p->saddr, p->dport, p->sport, p->proto, DIR_EGRESS);
	if (!local_dest(skb, p, v6)) {
		/* Not behind the node by its routes: held by its replies' key until one leaves, which
		 * tells that the node's stack translated the destination (inbound_translated). */
		e.flags = NAT_F_ORIG;
		if (p->proto == IPPROTO_TCP)
			tcp_track(skb, &e, p);
		inbound_hold(v6, &ek, &e);
		event_add(EV_INBOUND_NOT_LOCAL, 1);
		return TC_NEXT;
	}
	if (nat_lookup_from(v6, NAT_UNREPLIED, &ek) || nat_put(v6, NAT_UNREPLIED, &ek, &e, BPF_NOEXIST) != 0)
		return TC_NEXT; /* that tuple already has a flow */
	e.flags = NAT_F_ORIG;
	if (p->proto == IPPROTO_TCP)
		tcp_track(skb, &e, p);
	nat_put(v6, NAT_UNREPLIED, k, &e, BPF_NOEXIST);
	event_add(EV_INBOUND_FLOW, 1);
	return TC_NEXT;
}

__attribute__((noinline)) int ingress_new_v4(struct __sk_buff *skb, __u64 now)
{
	return ingress_new(skb, 0, now);
}

__attribute__((noinline)) int ingress_new_v6(struct __sk_buff *skb, __u64 now)
{
	return ingress_new(skb, 1, now);
}

/* A packet of a known flow arriving: its state recorded, then translated back. */
static __always_inline int ingress_known(struct __sk_buff *skb, const struct pkt *p, struct nat_scratch *s,
					 const int v6, const int tbl, struct nat_entry *e, __u64 now)
{
	const union nat_key *k = &s->key;
	__be16 to_port;

	/* A remote's SYN on a mapping its pod opened and answered (or closed) reopens nothing toward
	 * the pod: it reaches the node as it came, as conntrack leaves the invalid packet. */
	if (syn_from_replier(p, e))
		return TC_NEXT;
	if (is_reopen(p, e))
		reopen(v6, k, e);
	addr_copy(v6, s->to, WORDS(e->addr));
	to_port = e->port;
	if (flow_seen(skb, v6, tbl, k, e, p, now) < 0) {
		/* Its egress key holds another mapping now: this half is an orphan holding a port. */
		nat_del(v6, tbl, k);
		event_add(EV_ORPHAN, 1);
		return TC_NEXT;
	}
	return v6 ? xlate_v6(skb, 0, to_port) : xlate_v4(skb, 0, to_port);
}

/* ingress handles the packet being handled (parse_packet), arriving by the uplink. */
static __always_inline int ingress(struct __sk_buff *skb, const int v6, __u64 now)
{
	__u32 zero = 0;
	const struct nat_config *cfg;
	struct nat_scratch *s = scratch();
	const struct pkt *p = packet();
	union nat_key *k;
	struct nat_entry *e;
	int verdict, tbl = NAT_CONFIRMED;

	cfg = bpf_map_lookup_elem(&nat_config, &zero);
	if (!s || !p || !cfg || !family_cfg(cfg, v6)->enabled)
		return TC_NEXT;
	if (p->frag == FRAG_FIRST) {
		verdict = v6 ? frag_first_v6(skb, DIR_INGRESS) : frag_first_v4(skb, DIR_INGRESS);
		if (verdict != NOT_HELD)
			return verdict;
	}
	/* What ingress cannot translate is for the node's stack as it is: nothing leaks. A packet
	 * with segments left in its IPv6 routing header is not at its destination yet. */
	switch (p->l4) {
	case L4_ICMP_ERROR:
		verdict = v6 ? icmp_error_v6(skb, DIR_INGRESS) : icmp_error_v4(skb, DIR_INGRESS);
		return verdict == NOT_TRANSLATED ? TC_NEXT : verdict;
	case L4_NONE:
		verdict = frag_next(skb, v6, DIR_INGRESS, now);
		return verdict == NOT_TRANSLATED ? TC_NEXT : verdict;
	case L4_UNTRACKED:
	case L4_UNSAFE:
		return TC_NEXT;
	}
	if (p->transit)
		return TC_NEXT;
	/* To the uplink address, only ports of the range can be a flow of ours (masqueraded, or a
	 * host socket's recorded one), and those an earlier range's flows hold: traffic to host
	 * services is not even looked up. */
	if (p->l4 != L4_ADDR && !port_in_ranges(cfg, bpf_ntohs(p->dport))) {
		const __be32 *snat = snat_addr(skb, v6);

		if (snat && addr_eq(v6, p->daddr, snat) && !port_held(bpf_ntohs(p->dport)))
			return TC_NEXT;
	}
	k = &s->key;
	nat_key(v6, k, p->saddr, p->daddr, p->sport, p->dport, p->proto, DIR_INGRESS);
	if (tcp_is_syn(p) || tcp_is_synack(p)) {
		/* A handshake's packet: a SYN-ACK most often answers a flow still unreplied, a SYN opens
		 * one or is a retransmission of one: that table first (as egress's bare SYN), then the
		 * kept verdicts. */
		e = nat_get_moved(v6, k, &tbl);
		if (!e && keep_reply(v6, p, now))
			return TC_NEXT;
	} else if (!(e = nat_get(v6, NAT_CONFIRMED, k))) {
		/* Kept verdicts, as egress finds them: a reply of a flow left alone finds no mapping. */
		if (keep_reply(v6, p, now))
			return TC_NEXT;
		e = nat_get_moved(v6, k, &tbl);
	}
	if (!e)
		return v6 ? ingress_new_v6(skb, now) : ingress_new_v4(skb, now);
	return ingress_known(skb, p, s, v6, tbl, e, now);
}

__attribute__((noinline)) int ingress_v4(struct __sk_buff *skb, __u64 now)
{
	return ingress(skb, 0, now);
}

__attribute__((noinline)) int ingress_v6(struct __sk_buff *skb, __u64 now)
{
	return ingress(skb, 1, now);
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

	hook_seen_mark(skb, DIR_EGRESS, now);
	if (skb->vlan_present)
		return TC_NEXT; /* a VLAN sub-interface's frame (bpf/scope.h) */
	switch (parse_packet(skb)) {
	case 4:
		return egress_v4(skb, now);
	case 6:
		return egress_v6(skb, now);
	}
	return TC_NEXT;
}

SEC("tc")
int tc_ingress(struct __sk_buff *skb)
{
	__u64 now = bpf_ktime_get_ns();

	hook_seen_mark(skb, DIR_INGRESS, now);
	/* A VLAN sub-interface's frame, or one for another host (a macvlan child), a broadcast or a
	 * multicast: no reply to a flow of ours, and no flow to record. */
	if (skb->vlan_present || skb->pkt_type != PACKET_HOST)
		return TC_NEXT;
	switch (parse_packet(skb)) {
	case 4:
		return ingress_v4(skb, now);
	case 6:
		return ingress_v6(skb, now);
	}
	return TC_NEXT;
}
