/* Fragments in any order. A later fragment carries no ports: its flow is found by the ports its
 * datagram's first fragment carried (frag_v4/v6, remembered for every first fragment). One that
 * comes before its first fragment, as a multipath network delivers them, would be lost: on egress
 * a pod's cannot be translated (and must not leave with the pod's address), on ingress an answer's
 * would reach the node's stack untranslated while its first fragment, translated, goes to the pod.
 * Conntrack reassembles the datagram first; a tc program cannot queue a packet, so it keeps the
 * fragment's bytes instead:
 *
 *   - such a fragment that may need translation (egress: a pod's; ingress: one for the node's own
 *     addresses, where the mappings are) is held: its frame is copied into frag_held_v4/v6, keyed
 *     by datagram and slot (up to FRAG_HELD_SLOTS a datagram), and dropped from the hook;
 *   - when the first fragment comes, its datagram's held fragments are sent again to the hook
 *     they were held on (bpf_clone_redirect: on egress the copies run through the programs at
 *     once, within the helper, on ingress after this packet), the first fragment first, as it
 *     came, so that its flow is found or made before the others follow it; each held one is
 *     written over the packet (bpf_skb_change_tail, bpf_skb_store_bytes) and sent, and the packet
 *     itself, whose copy went first, is dropped. Every copy is translated by the programs as any
 *     fragment is, so none leaves with a pod's address;
 *   - a fragment that finds no room (the map full, a frame larger than FRAG_HELD_BYTES, its
 *     datagram's slots taken) is handled as before: counted (frag_miss), dropped on egress when
 *     the policy masquerades it, passed untranslated on ingress. What waits longer than the
 *     kernel's own reassembly would (net.ipv4.ipfrag_time) is removed by the userspace sweep.
 *
 * The kernel could reassemble instead, before the programs: a netfilter program attached with
 * BPF_F_NETFILTER_IP_DEFRAG (Linux 6.6) makes the stack reassemble forwarded datagrams and send
 * them out again in order, which mends egress only (tc ingress runs before netfilter), on new
 * kernels only; tc's ct action reassembles on either hook, but needs conntrack and a filter of
 * ours beside the programs. Holding the bytes works on both hooks of every kernel the programs
 * load on, and costs nothing while fragments come in order.
 *
 * A copy sent to the egress hook runs the programs again inside this run, on this CPU: the per-CPU
 * packet and scratch are then the copy's, so frag_release keeps what it needs on its stack and
 * reads neither after its first copy; slot 0's releasing mark tells the copy of the first fragment
 * that its held fragments are being sent already. */
#pragma once

#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>

#include "maps.h"
#include "parse.h"
#include "flow.h"
#include "scope.h"

/* frag_later's result for a later fragment whose datagram's first fragment was not seen, and
 * frag_release's for a first fragment that had no held fragments. */
#define FRAG_UNSEEN 0x102
#define NOT_HELD 0x103

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

union frag_held_key {
	struct frag4_held_key k4;
	struct frag6_held_key k6;
};

/* frag_held_key is the key of slot 0 of the held fragments of p's datagram (dir). */
static __always_inline void frag_held_key(const int v6, union frag_held_key *hk, const struct pkt *p, __u8 dir)
{
	if (v6) {
		hk->k6 = (struct frag6_held_key){.dgram = {.id = p->frag_id, .proto = p->proto, .dir = dir}};
		__builtin_memcpy(hk->k6.dgram.saddr, p->saddr, 16);
		__builtin_memcpy(hk->k6.dgram.daddr, p->daddr, 16);
	} else {
		hk->k4 = (struct frag4_held_key){.dgram = {.id = (__be16)p->frag_id, .proto = p->proto, .dir = dir}};
		__builtin_memcpy(hk->k4.dgram.saddr, p->saddr, 4);
		__builtin_memcpy(hk->k4.dgram.daddr, p->daddr, 4);
	}
}

static __always_inline void frag_held_slot(const int v6, union frag_held_key *hk, __u32 slot)
{
	if (v6)
		hk->k6.slot = slot;
	else
		hk->k4.slot = slot;
}

static __always_inline struct frag_held *frag_held_get(const int v6, const union frag_held_key *hk)
{
	if (v6)
		return bpf_map_lookup_elem(&frag_held_v6, &hk->k6);
	return bpf_map_lookup_elem(&frag_held_v4, &hk->k4);
}

static __always_inline void frag_held_del(const int v6, const union frag_held_key *hk)
{
	if (v6)
		bpf_map_delete_elem(&frag_held_v6, &hk->k6);
	else
		bpf_map_delete_elem(&frag_held_v4, &hk->k4);
}

/* frag_hold keeps the packet being handled, a later fragment, in the first free slot of its
 * datagram. Returns 1 when it did (the caller drops the packet), 0 when there is no room. */
static __always_inline int frag_hold(struct __sk_buff *skb, const int v6, __u8 dir, __u64 now)
{
	const struct pkt *p = packet();
	union frag_held_key hk;
	struct frag_held *blank, *h;
	__u32 zero = 0, len = skb->len;

	if (!p || !size_in(len, FRAG_HELD_BYTES))
		return 0;
	blank = bpf_map_lookup_elem(&frag_blank, &zero);
	if (!blank)
		return 0;
	frag_held_key(v6, &hk, p, dir);
	for (__u32 i = 0; i < FRAG_HELD_SLOTS; i++) {
		int err;

		frag_held_slot(v6, &hk, i);
		err = v6 ? map_update(&frag_held_v6, &hk.k6, blank, BPF_NOEXIST)
			 : map_update(&frag_held_v4, &hk.k4, blank, BPF_NOEXIST);
		if (err == -17 /* EEXIST: the slot holds another fragment */)
			continue;
		if (err)
			return 0; /* the map is full */
		h = frag_held_get(v6, &hk);
		if (!h)
			return 0;
		if (bpf_skb_load_bytes(skb, 0, h->data, len) < 0) {
			frag_held_del(v6, &hk);
			return 0;
		}
		h->held_at = now;
		h->len = len; /* last: a slot whose len is 0 is being written */
		return 1;
	}
	return 0;
}

/* frag_release sends the packet being handled, a first fragment, and then the held fragments of
 * its datagram (dir) again to the hook they came by, and returns the verdict of the packet
 * itself: dropped, its copy sent first. NOT_HELD when nothing of its datagram is held, or its
 * held fragments are being sent already (this is the copy of the first fragment). */
static __always_inline int frag_release(struct __sk_buff *skb, const int v6, __u8 dir)
{
	const struct pkt *p = packet();
	__u32 ifindex = skb->ifindex, flags = dir == DIR_INGRESS ? BPF_F_INGRESS : 0;
	union frag_held_key hk;
	struct frag_held *h;

	if (!p)
		return NOT_HELD;
	frag_held_key(v6, &hk, p, dir);
	h = frag_held_get(v6, &hk);
	if (!h || h->releasing)
		return NOT_HELD;
	h->releasing = 1;
	bpf_clone_redirect(skb, ifindex, flags);
	for (__u32 i = 0; i < FRAG_HELD_SLOTS; i++) {
		__u32 len;

		frag_held_slot(v6, &hk, i);
		h = frag_held_get(v6, &hk);
		if (!h)
			continue;
		len = h->len;
		if (!size_in(len, FRAG_HELD_BYTES))
			continue; /* being written: it stays for a duplicate first fragment, or the sweep */
		if (bpf_skb_change_tail(skb, len, 0) == 0 &&
		    bpf_skb_store_bytes(skb, 0, h->data, len, BPF_F_RECOMPUTE_CSUM) == 0)
			bpf_clone_redirect(skb, ifindex, flags);
		frag_held_del(v6, &hk);
	}
	return TC_ACT_SHOT;
}

__attribute__((noinline)) int frag_release_v4(struct __sk_buff *skb, __u32 dir)
{
	return frag_release(skb, 0, dir);
}

__attribute__((noinline)) int frag_release_v6(struct __sk_buff *skb, __u32 dir)
{
	return frag_release(skb, 1, dir);
}

/* frag_wait decides a later fragment whose first fragment was not seen (FRAG_UNSEEN): held when
 * it may need translation (egress: a pod's; ingress: one for an address of the node, the uplink's
 * or another that a rule masquerades to), dropped from the hook then. NOT_TRANSLATED for the
 * caller to decide otherwise: counted as frag_miss when it needed holding and found no room. */
static __always_inline int frag_wait(struct __sk_buff *skb, const int v6, __u8 dir, __u64 now)
{
	const struct pkt *p = packet();
	const __be32 *snat = snat_addr(skb, v6);
	int needs;

	if (!p)
		return NOT_TRANSLATED;
	if (dir == DIR_EGRESS)
		needs = ingress_ifindex(skb) && from_node_stack(skb, p, v6, snat) == FROM_POD;
	else
		needs = (snat && addr_eq(v6, p->daddr, snat)) || node_owns(skb, p->daddr, v6);
	if (!needs)
		return NOT_TRANSLATED;
	if (frag_hold(skb, v6, dir, now))
		return TC_ACT_SHOT;
	event_add(EV_FRAG_MISS, 1);
	return NOT_TRANSLATED;
}

__attribute__((noinline)) int frag_wait_v4(struct __sk_buff *skb, __u32 dir, __u64 now)
{
	return frag_wait(skb, 0, dir, now);
}

__attribute__((noinline)) int frag_wait_v6(struct __sk_buff *skb, __u32 dir, __u64 now)
{
	return frag_wait(skb, 1, dir, now);
}
